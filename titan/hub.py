"""Hub model names in the local HF cache, where `titan download` puts them: titan never downloads at run time.

Torch-free and without huggingface_hub's network modules, so that a recipe naming a model that is not there is
refused at once."""

from __future__ import annotations

from pathlib import Path

from titan.errors import ConfigError


def looks_like_hub_name(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not name.endswith(".json")


def hub_folder(name: str) -> Path | None:
    """The local HF cache's snapshot of hub model `name` (e.g. "meta-llama/Llama-3.2-1B") at its main branch, as
    huggingface_hub lays it out (models--owner--name/refs/main naming the snapshot), or None when `name` is no hub
    name or the cache does not hold it."""
    if not looks_like_hub_name(name):
        return None
    from huggingface_hub import constants  # read at call time: HF_HUB_CACHE follows the environment

    repo = Path(constants.HF_HUB_CACHE) / f"models--{name.replace('/', '--')}"
    try:
        commit = (repo / "refs" / "main").read_text().strip()
    except OSError:
        return None
    folder = repo / "snapshots" / commit
    return folder if commit and folder.is_dir() else None


def model_folder(value: str, key: str) -> Path:
    """The HF model folder that recipe key `key` names: a local folder, or a hub model in the local HF cache;
    ConfigError (one line) otherwise."""
    path = Path(value).expanduser()
    if path.is_dir():
        return path
    found = hub_folder(value)
    if found is not None:
        return found
    if path.exists():
        raise ConfigError(f"{key}: {value} is a file; name an HF model folder (config.json + *.safetensors)")
    hub = (
        f", nor a hub model in the local HF cache (fetch it where there is internet: titan download {value} --weights)"
        if looks_like_hub_name(value)
        else ""
    )
    raise ConfigError(f"{key}: {value} is no folder{hub}; name an HF model folder or a downloaded hub model")
