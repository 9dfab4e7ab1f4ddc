"""Train a byte-level BPE tokenizer (HF `tokenizers`) on a jsonl or plain-text file.

    python scripts/train_tokenizer.py --data data/stories.jsonl --text-field text \
        --vocab-size 2048 --out data/tokenizer.json

Special tokens use the Llama 3 names and get ids 0 and 1. No BOS/EOS post-processor is
attached on purpose: titan's data pipeline adds BOS/EOS itself, so `encode()` must return
only the text's tokens. After training, the CLI prints corpus statistics, including the
unigram entropy: the loss a model that learned nothing beyond token frequencies reaches.
"""

import argparse
import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN]  # order here fixes their ids: 0 and 1


def iter_texts(path: str, text_field: str = "text") -> Iterator[str]:
    """Yield documents: the `text_field` of each line of a .jsonl file, else each
    non-empty line of a plain-text file."""
    is_jsonl = path.endswith((".jsonl", ".json"))
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            yield json.loads(line)[text_field] if is_jsonl else line.rstrip("\n")


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 2048,
    special_tokens: list[str] = SPECIAL_TOKENS,
    min_frequency: int = 2,
    show_progress: bool = True,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer on an iterable of documents and return it.

    Byte-level means every string is encodable (no <unk>): the 256 byte symbols are
    always in the vocab, whatever the training text contained.
    """
    tok = Tokenizer(models.BPE())
    # GPT-2 style: split on words/punctuation/whitespace with a regex, map bytes to
    # printable symbols; no prefix space, so decode(encode(s)) == s exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
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
    return tok


def corpus_stats(tok: Tokenizer, texts: list[str]) -> dict:
    """Token count, tokens per character and unigram entropy of the tokenized corpus
    (BOS/EOS excluded: the pipeline adds one pair per document)."""
    counts: Counter = Counter()
    for enc in tok.encode_batch(texts):
        counts.update(enc.ids)
    n_tokens = sum(counts.values())
    n_chars = sum(len(t) for t in texts)
    nats = -sum(c / n_tokens * math.log(c / n_tokens) for c in counts.values())
    return {
        "docs": len(texts),
        "chars": n_chars,
        "tokens": n_tokens,
        "tokens_per_char": n_tokens / n_chars,
        "distinct_tokens_used": len(counts),
        "unigram_entropy_nats": nats,
        "unigram_entropy_bits": nats / math.log(2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description="Train a byte-level BPE tokenizer.")
    ap.add_argument("--data", default="data/stories.jsonl", help=".jsonl (one JSON object a line) or .txt")
    ap.add_argument("--text-field", default="text", help="JSON field holding the text (jsonl only)")
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--min-frequency", type=int, default=2)
    ap.add_argument("--out", default="data/tokenizer.json")
    ap.add_argument("--no-stats", action="store_true", help="skip the corpus statistics")
    args = ap.parse_args()

    texts = list(iter_texts(args.data, args.text_field))
    tok = train_tokenizer(texts, vocab_size=args.vocab_size, min_frequency=args.min_frequency)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    tok.save(args.out)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    print(f"saved {args.out}: vocab size {tok.get_vocab_size()}, special token ids {ids}")

    # Sanity check: byte-level BPE must round-trip any text exactly.
    sample = texts[0]
    assert tok.decode(tok.encode(sample).ids) == sample, "tokenizer does not round-trip"
    if not args.no_stats:
        for k, v in corpus_stats(tok, texts).items():
            print(f"  {k}: {v:.4f}" if isinstance(v, float) else f"  {k}: {v}")


if __name__ == "__main__":
    main()
