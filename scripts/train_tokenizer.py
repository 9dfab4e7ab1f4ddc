"""Train a byte-level BPE tokenizer (HF `tokenizers`) on a jsonl or plain-text file.

    python scripts/train_tokenizer.py --data data/stories.jsonl --text-field text \
        --vocab-size 2048 --out data/tokenizer.json

The training itself is titan.data.bpe.train_bpe: special tokens with the Llama 3 names
get ids 0 and 1, and no BOS/EOS post-processor is attached. After training, the CLI prints
corpus statistics, including the unigram entropy: the loss a model that learned nothing beyond
token frequencies reaches.
"""

import argparse
import json
import math
import os
from collections import Counter
from collections.abc import Iterator

from tokenizers import Tokenizer

from titan.data.bpe import SPECIAL_TOKENS, train_bpe


def iter_texts(path: str, text_field: str = "text") -> Iterator[str]:
    """Yield documents: the `text_field` of each line of a .jsonl file, else each
    non-empty line of a plain-text file."""
    is_jsonl = path.endswith((".jsonl", ".json"))
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            yield json.loads(line)[text_field] if is_jsonl else line.rstrip("\n")


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
    tok = train_bpe(texts, args.vocab_size, args.min_frequency, show_progress=True)
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
