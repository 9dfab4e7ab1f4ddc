"""A HF `tokenizers` tokenizer plus the BOS/EOS ids that frame every document (a tokenizer may have no BOS, as
Qwen's: its documents end with EOS and start with nothing)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from titan.config import NO_TOKENIZER
from titan.config import Tokenizer as TokenizerConfig
from titan.data.corpora import resolve_tokenizer_path
from titan.errors import ConfigError
from titan.hub import hub_folder, looks_like_hub_name


def tokenizer_file(path: str) -> Path:
    """The tokenizer.json that tokenizer.path `path` names: the file itself, a model folder's, a `titan:` corpus's
    (built on first use) or a hub model's in the local HF cache; ConfigError (one line) otherwise."""
    if not path:
        raise ConfigError(NO_TOKENIZER)
    found = Path(resolve_tokenizer_path(path)).expanduser()
    if found.is_dir():
        found = found / "tokenizer.json"
        if not found.is_file():
            raise ConfigError(f"tokenizer.path: the folder {path} has no tokenizer.json; name one, or its file")
    elif not found.exists():
        hub = hub_folder(path)
        if hub is not None and (hub / "tokenizer.json").is_file():
            return hub / "tokenizer.json"
    if not found.is_file():
        hub = ""
        if looks_like_hub_name(path):
            hub = (
                f", nor a hub model whose tokenizer.json is in the local HF cache (fetch it where there is "
                f"internet: titan download {path})"
            )
        raise ConfigError(
            f"tokenizer.path: file not found: {found}{hub}; point it at a tokenizer.json or a model folder"
        )
    return found


class Tokenizer:
    def __init__(self, cfg: TokenizerConfig):
        path = tokenizer_file(cfg.path)
        self.path = path  # the file read, for what must hash or copy it
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise ConfigError(f"tokenizer.path: {path} is not a valid tokenizer.json: {e}") from None
        self.bos_id = self._special_id(cfg.bos_token, "bos_token", path) if cfg.bos_token else None
        self.eos_id = self._special_id(cfg.eos_token, "eos_token", path)
        self.vocab_size = self._tok.get_vocab_size()

    def _special_id(self, token: str, key: str, path: Path) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ConfigError(f"tokenizer.{key}: {token!r} is not in the vocabulary of {path}")
        return token_id

    @property
    def starts(self) -> list[int]:
        """What begins every document: its BOS, or nothing for a tokenizer without one."""
        return [] if self.bos_id is None else [self.bos_id]

    def encode(self, text: str) -> list[int]:
        """BOS + text + EOS, so packed sequences keep document boundaries visible to the model."""
        return [*self.starts, *self._tok.encode(text, add_special_tokens=False).ids, self.eos_id]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)
