"""`titan tokenizer train`: a byte-level BPE tokenizer (titan.data.bpe) trained on a data source, read as training
reads it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers

from titan.config import DataSource
from titan.data.bpe import SPECIAL_TOKENS, train_bpe
from titan.data.dataset import iter_texts, open_documents
from titan.errors import ConfigError

BYTES = len(pre_tokenizers.ByteLevel.alphabet())  # the symbols every byte-level vocabulary holds
# The largest vocabulary titan's model families take (their LIMITS): a tokenizer larger than that trains no model,
# and the BPE trainer allocates for the vocabulary it is asked for (10^9 aborts the process).
MAX_VOCAB = 2**22


@dataclass(frozen=True)
class Trained:
    """A tokenizer trained on a source, and how much it read."""

    tokenizer: HFTokenizer
    documents: int
    characters: int


def train_on_sources(
    sources: list[DataSource],
    vocab_size: int,
    min_frequency: int = 2,
    show_progress: bool = False,
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
) -> Trained:
    """A byte-level BPE tokenizer trained on the documents of `sources` (any titan trains on, read as training reads
    them, text_unit included), streamed rather than held in memory."""
    smallest = BYTES + len(special_tokens)
    if vocab_size < smallest:
        raise ConfigError(
            f"--vocab-size {vocab_size} is smaller than a byte-level tokenizer's {BYTES} bytes and "
            f"{len(special_tokens)} special tokens: give at least {smallest} (32000 or more for a real corpus)"
        )
    if vocab_size > MAX_VOCAB:
        raise ConfigError(
            f"--vocab-size {vocab_size:,} is more than titan's models take ({MAX_VOCAB:,}); Llama 3's is 128,256"
        )
    if min_frequency < 1:
        raise ConfigError(
            f"--min-frequency {min_frequency}: a pair is merged when seen at least this often; give 1 or more"
        )
    opened = [open_documents(source) for source in sources]  # each checked before anything is trained
    read = {"documents": 0, "characters": 0}

    def counted() -> Iterator[str]:
        for text in (text for documents in opened for text in iter_texts(documents)):
            if text:  # an empty document teaches nothing, and would hide a source with no text
                read["documents"] += 1
                read["characters"] += len(text)
                yield text

    tokenizer = train_bpe(counted(), vocab_size, min_frequency, show_progress, special_tokens)
    if not read["documents"]:
        names = ", ".join(source.source for source in sources)
        raise ConfigError(f"data.source: {names} holds no text to train a tokenizer on (every document is empty)")
    return Trained(tokenizer, **read)
