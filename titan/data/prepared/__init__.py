"""Sources tokenized once into memory-mapped token shards plus a document index (`titan data prepare`).

In the spirit of Megatron's indexed datasets and nanoGPT's .bin files. A prepared source is a folder
<cache_root>/<slug>-<key>/ holding:

    tokens-00000.bin, ...  every document's tokens (BOS + text + EOS, as Tokenizer.encode gives them), concatenated
                           in the source's order as raw little-endian uint16 (uint32 when the vocabulary needs it);
                           a shard holds at most SHARD_TOKENS tokens, unless one document is longer, ends at a
                           document boundary and holds the documents of one unit (below)
    offsets.npy            int64, one per document and one more: where each document starts in the source's tokens
                           (the shards one after another), then their count: 8 bytes per document, memory-mapped
    blocks.npy             int64: offsets.npy at every block's first document (titan.data.order), then the count
    meta.json              format version, key, source, tokenizer, dtype, counts, shards, documents per block
    COMPLETE               the key, written last

The key hashes everything the tokens depend on: the format version, the source's identity (local files: paths
and contents, whose digests <cache_root>/.digests/ remembers; hub datasets: name, subset, split and revision), the
text field, the tokenizer file's contents and the BOS/EOS tokens; so a changed file or tokenizer never reuses
stale tokens, and a copied or touched source reuses its own.

Preparation goes by units: runs of consecutive source files of at least UNIT_BYTES (a hub dataset is one unit),
each tokenized into <cache_root>/.<slug>-<key>.parts/unit-<first>-<stop>/ and kept once complete. A prepare that
is interrupted resumes at the first unit it had not completed; `--part i/N` prepares the i-th of N contiguous
runs of units, so machines sharing the cache split a source; whoever completes the last unit merges the units
into the folder (the shards are hard-linked, offsets.npy is written once) and removes the parts. Every folder
is written under a temporary name and renamed once complete, under a lock on <folder>.lock (titan.files): of
several processes preparing one source (the ranks of a job), the first prepares and the others wait and reuse.

cache.py holds the keys, folders and their checks and the cache's listing, write.py the preparation, encode.py
the tokenizer processes it uses, and read.py the reader.
"""

from titan.data.prepared.cache import (
    FORMAT_VERSION,
    CachedSource,
    cache_root_for,
    cached_sources,
    describe,
    find_prepared,
    remove_cached,
)
from titan.data.prepared.read import PreparedDocuments
from titan.data.prepared.write import Sizes, ensure_prepared, prepare

__all__ = [
    "Sizes",
    "FORMAT_VERSION",
    "CachedSource",
    "PreparedDocuments",
    "cache_root_for",
    "cached_sources",
    "describe",
    "ensure_prepared",
    "find_prepared",
    "prepare",
    "remove_cached",
]
