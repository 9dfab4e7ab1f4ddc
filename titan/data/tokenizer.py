"""A HF `tokenizers` tokenizer plus the BOS/EOS ids that frame every document."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from titan.config import Tokenizer as TokenizerConfig
from titan.data.corpora import resolve_tokenizer_path
from titan.errors import ConfigError


def looks_like_hub_name(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not name.endswith(".json")


def hub_tokenizer(name: str) -> Path | None:
    """The tokenizer.json of HF hub model `name` (e.g. "meta-llama/Llama-3.2-1B") in the local HF cache, or
    None when `name` is no hub name or the cache does not hold it: titan never downloads at run time."""
    if not looks_like_hub_name(name):
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name, "tokenizer.json")
    return Path(found) if isinstance(found, str) else None


class Tokenizer:
    def __init__(self, cfg: TokenizerConfig):
        path = Path(resolve_tokenizer_path(cfg.path))  # a `titan:` corpus's tokenizer is built on first use
        if not path.exists():
            path = hub_tokenizer(cfg.path) or path
        self.path = path  # the file read, for what must hash or copy it
        if not path.is_file():
            hub = ""
            if looks_like_hub_name(cfg.path):
                hub = (
                    f", nor a hub model whose tokenizer.json is in the local HF cache (fetch it where there is "
                    f"internet: hf download {cfg.path} tokenizer.json)"
                )
            raise ConfigError(f"tokenizer.path: file not found: {path}{hub}; point it at a tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise ConfigError(f"tokenizer.path: {path} is not a valid tokenizer.json: {e}") from None
        self.bos_id = self._special_id(cfg.bos_token, "bos_token", path)
        self.eos_id = self._special_id(cfg.eos_token, "eos_token", path)
        self.vocab_size = self._tok.get_vocab_size()

    def _special_id(self, token: str, key: str, path: Path) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ConfigError(f"tokenizer.{key}: {token!r} is not in the vocabulary of {path}")
        return token_id

    def encode(self, text: str) -> list[int]:
        """BOS + text + EOS, so packed sequences keep document boundaries visible to the model."""
        return [self.bos_id, *self._tok.encode(text, add_special_tokens=False).ids, self.eos_id]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)
