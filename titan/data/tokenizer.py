"""A HF `tokenizers` tokenizer plus the BOS/EOS ids that frame every document."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from titan.config import ConfigError, Tokenizer as TokenizerConfig


class Tokenizer:
    def __init__(self, cfg: TokenizerConfig):
        path = Path(cfg.path)
        if not path.is_file():
            raise ConfigError(f"tokenizer.path: file not found: {path} (point it at a tokenizer.json)")
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
