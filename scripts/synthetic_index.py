"""A prepared source of any number of documents without tokenizing anything, and what a rank's loader costs on it.

    python scripts/synthetic_index.py make /tmp/index --documents 1e9       # 8 GB of offsets.npy, sparse shards
    python scripts/synthetic_index.py measure /tmp/index --restore-at 1e10  # start-up, restore and memory, as JSON
    rm -r /tmp/index

`make` writes what `titan data prepare` would (offsets.npy, blocks.npy, meta.json, COMPLETE) for documents of
random lengths, and token shards as sparse files of zeros: 8 bytes per document on disk, whatever the tokens.
`measure` runs, in this process, what one data-parallel rank of `titan train` runs: open the source, hold out
validation, build the training loader and read its first step; then restore it at a global sample far into
training and read that step. It reports the seconds of each, and this process's resident memory (VmRSS, VmHWM)
after the imports and at the end: the loader's share is the difference.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHARD_TOKENS = 2**32  # tokens per sparse shard file (8 GB of zeros that take no disk)
CHUNK = 1 << 24  # documents generated at once


def make(folder: Path, documents: int, min_length: int, max_length: int, seed: int) -> dict:
    from numpy.lib.format import open_memmap

    from titan.data.order import block_documents
    from titan.data.prepared import FORMAT_VERSION

    folder.mkdir(parents=True)
    per_block = block_documents(documents)
    chunk = CHUNK // per_block * per_block  # whole blocks per chunk, so each chunk's block starts are its own
    offsets = open_memmap(folder / "offsets.npy", mode="w+", dtype="<i8", shape=(documents + 1,))
    offsets[0] = 0
    blocks = [np.zeros(1, dtype=np.int64)]  # the first block starts at token 0
    rng = np.random.default_rng(seed)
    for begin in range(0, documents, chunk):
        n = min(chunk, documents - begin)
        ends = offsets[begin] + np.cumsum(rng.integers(min_length, max_length, size=n))
        offsets[begin + 1 : begin + 1 + n] = ends
        blocks.append(ends[per_block - 1 :: per_block])  # the end of each block: the next one's start
    tokens = int(offsets[-1])
    if documents % per_block:
        blocks.append(np.array([tokens]))
    offsets.flush()
    del offsets
    np.save(folder / "blocks.npy", np.concatenate(blocks))
    # Shards end at document boundaries: here, at the first document end past every SHARD_TOKENS.
    ends = np.load(folder / "offsets.npy", mmap_mode="r")
    cuts = [0]
    while tokens - cuts[-1] > SHARD_TOKENS:
        cuts.append(int(ends[np.searchsorted(ends, cuts[-1] + SHARD_TOKENS)]))
    cuts.append(tokens)
    shard_tokens = np.diff(cuts).tolist()
    for shard, size in enumerate(shard_tokens):
        with open(folder / f"tokens-{shard:05d}.bin", "wb") as f:
            f.truncate(2 * size)  # uint16 zeros, sparse
    meta = {
        "format_version": FORMAT_VERSION,
        "key": "synthetic",
        "source": {"source": "synthetic", "documents": documents, "seed": seed},
        "tokenizer": {"vocab_size": 2**16},
        "dtype": "uint16",
        "documents": documents,
        "tokens": tokens,
        "empty_documents_skipped": 0,
        "shard_tokens": shard_tokens,
        "block_documents": per_block,
    }
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))
    (folder / "COMPLETE").write_text(meta["key"])
    return {"documents": documents, "tokens": tokens, "block_documents": per_block, "shards": len(shard_tokens)}


def memory() -> dict:
    """This process's resident memory now and at its peak, in MiB."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {key: int(status[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}


def measure(folder: Path, seq_len: int, global_batch: int, ranks: int, fraction: float, restore_at: int) -> dict:
    from titan.data.loader import Blend, GlobalBatchLoader, PackedSamples
    from titan.data.order import ORDER_VERSION, hold_out
    from titan.data.prepared import PreparedDocuments

    imported = memory()
    start = time.perf_counter()
    documents = PreparedDocuments(folder)
    samples = PackedSamples(documents, hold_out(documents, fraction)[0], seq_len, 0, True)
    rows = global_batch // ranks  # rank 0's rows, in one micro-batch
    loader = GlobalBatchLoader([samples], Blend([1.0]), global_batch, range(rows), [rows], True)
    next(loader)
    started = time.perf_counter() - start
    start = time.perf_counter()
    loader.load_state_dict({"next_sample": restore_at, "order": ORDER_VERSION})
    next(loader)
    restored = time.perf_counter() - start
    return {
        "documents": documents.n_documents,
        "tokens": documents.n_tokens,
        "block_documents": documents.block_documents,
        "samples_per_epoch": samples.samples_per_epoch,
        "restored_epoch": restore_at // samples.samples_per_epoch,
        "start_seconds": round(started, 3),
        "restore_seconds": round(restored, 3),
        "rss_mib_after_imports": imported,
        "rss_mib_at_end": memory(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    made = sub.add_parser("make", help="write a synthetic prepared source")
    made.add_argument("folder", type=Path)
    made.add_argument("--documents", type=float, required=True)
    made.add_argument("--min-length", type=int, default=2)
    made.add_argument("--max-length", type=int, default=1024, help="lengths are uniform in [min, max)")
    made.add_argument("--seed", type=int, default=0)
    measured = sub.add_parser("measure", help="start-up, restore and memory of one rank's loader on it")
    measured.add_argument("folder", type=Path)
    measured.add_argument("--seq-len", type=int, default=2048)
    measured.add_argument("--global-batch", type=int, default=512)
    measured.add_argument("--ranks", type=int, default=64, help="data-parallel ranks: rank 0 reads its rows")
    measured.add_argument("--validation-fraction", type=float, default=0.001)
    measured.add_argument("--restore-at", type=float, default=1e10, help="global sample to restore at")
    args = parser.parse_args()
    if args.command == "make":
        start = time.perf_counter()
        figures = make(args.folder, int(args.documents), args.min_length, args.max_length, args.seed)
        figures["seconds"] = round(time.perf_counter() - start, 1)
    else:
        figures = measure(
            args.folder, args.seq_len, args.global_batch, args.ranks, args.validation_fraction, int(args.restore_at)
        )
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
