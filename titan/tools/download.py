"""`titan download NAME`: a hub model's config and tokenizer (and with --weights its safetensors) into the local
HF cache, through huggingface_hub's snapshot_download.

titan never downloads at run time: a recipe's `tokenizer.path = "NAME"` is looked up in this cache, and the
folder printed is what `checkpoint.init_from_hf` and `titan convert hf-to-dcp` read. On a terminal
huggingface_hub draws its own tqdm bars; elsewhere (a log file) it turns them off, and the bytes are reported
by a log line every few seconds instead (titan.progress).
"""

from __future__ import annotations

import sys
from pathlib import Path

from titan.errors import UserError
from titan.progress import Progress

CONFIG_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
]
WEIGHT_FILES = ["*.safetensors", "model.safetensors.index.json"]
LOGIN_HINT = "log in with `hf auth login` (or set HF_TOKEN)"


def download(name: str, weights: bool = False, revision: str | None = None) -> str:
    """Fetch `name`'s files into the HF cache (those already there are kept); returns the report to print."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise UserError(f"{name!r} is not a hub model name: give owner/name, e.g. meta-llama/Llama-3.2-1B") from None
    patterns = CONFIG_FILES + (WEIGHT_FILES if weights else [])
    try:
        folder = Path(snapshot_download(name, revision=revision, allow_patterns=patterns, tqdm_class=_bar_class()))
    except GatedRepoError:
        raise UserError(
            f"{name} is gated: accept its terms on https://huggingface.co/{name}, then {LOGIN_HINT}"
        ) from None
    except RevisionNotFoundError:
        raise UserError(f"{name} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise UserError(f"no model {name} on the hub, or it is private: check the name, or {LOGIN_HINT}") from None
    except LocalEntryNotFoundError:
        raise UserError(
            f"{name}: the hub cannot be reached (no internet, or HF_HUB_OFFLINE is set) and the HF cache does not "
            f"hold {'its weights' if weights else 'its config and tokenizer'}; run this where there is internet"
        ) from None
    except HfHubHTTPError as e:
        raise UserError(f"{name}: the hub answered {_first_line(e)}") from None
    got = sorted(p.name for p in folder.iterdir())
    if weights and not any(p.endswith(".safetensors") for p in got):
        raise UserError(f"{name} has no safetensors weights (only {', '.join(got)}): titan reads no other format")
    lines = [f"{name}: {', '.join(got)} in {folder}"]
    if "tokenizer.json" in got:
        lines.append(f'a recipe reads its tokenizer offline with tokenizer.path = "{name}"')
    if weights:
        lines.append(
            f'start a run from its weights with checkpoint.init_from_hf = "{folder}", or convert them with '
            f"titan convert hf-to-dcp {folder} OUT"
        )
    else:
        lines.append(f"its weights: titan download {name} --weights")
    return "\n".join(lines)


def _bar_class():
    """huggingface_hub's tqdm bars on a terminal; elsewhere none, and the bytes written reported through titan's
    Progress instead: a log line every few seconds."""
    from huggingface_hub.utils import tqdm

    terminal = sys.stderr.isatty()

    class Bar(tqdm):
        def __init__(self, *args, **kwargs):
            # snapshot_download's bar of the bytes written; its other bars count files, or bytes moved by Xet.
            counts_bytes = kwargs.get("name") == "huggingface_hub.snapshot_download"
            super().__init__(*args, **{**kwargs, "disable": kwargs.get("disable") or not terminal})
            self.log = Progress("downloading", unit="B") if counts_bytes and not terminal else None

        def update(self, n=1):
            if self.log is not None:
                self.log.total = self.total or None  # grows as each file starts
                self.log.update(n or 0)
            return super().update(n)

        def close(self):
            if getattr(self, "log", None) is not None:
                self.log.close()
            super().close()

    return Bar


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
