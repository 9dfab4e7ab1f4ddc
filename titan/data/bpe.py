"""How titan trains a tokenizer: byte-level BPE with the Llama 3 names for BOS and EOS."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN)  # order here fixes their ids: 0 and 1
LONGEST_WORD = 256  # characters of one pre-tokenized word, at most


def training_pre_tokenizer(byte_level: pre_tokenizers.PreTokenizer) -> pre_tokenizers.PreTokenizer:
    """`byte_level`'s words as the BPE trainer sees them: runs of LONGEST_WORD or more non-space characters (DNA,
    hashes, minified code) first cut into pieces of that many. The trainer's time grows with the square of a word's
    length (a 250,000-letter word took 48 s, a 32M-character one would take days), and no merge spans hundreds of
    characters. Text of shorter runs is split as before, so the tokenizer saved, which encodes with byte_level
    alone, is plain byte-level training's."""
    long_run = pre_tokenizers.Split(Regex(rf"\S{{{LONGEST_WORD}}}"), behavior="isolated")
    return pre_tokenizers.Sequence([long_run, byte_level])


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    min_frequency: int = 2,
    show_progress: bool = False,
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
) -> HFTokenizer:
    """A byte-level BPE tokenizer trained on `texts`, with `special_tokens` as ids 0, 1, ...

    Byte-level means every string is encodable (no <unk>): the 256 byte symbols are always in the vocab,
    whatever the training text contained. No BOS/EOS post-processor is attached on purpose: titan's data
    pipeline adds BOS/EOS itself, so `encode()` must return only the text's tokens.
    """
    tok = HFTokenizer(models.BPE())
    # GPT-2 style: split on words/punctuation/whitespace with a regex, map bytes to
    # printable symbols; no prefix space, so decode(encode(s)) == s exactly.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = training_pre_tokenizer(byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),  # added first -> ids 0..len-1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    # With the length known, the progress bar (show_progress) shows a total and an ETA.
    length = len(texts) if hasattr(texts, "__len__") else None
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    tok.pre_tokenizer = byte_level
    return tok
