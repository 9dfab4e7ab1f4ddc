"""What a titan checkpoint folder is, and the checks that make reading one safe.

A checkpoint folder holds DCP's tensor shards (`*.distcp`), their index `tensors.json`, titan's JSON files
(train_state.json, data.json), `manifest.json` (every other file's size and SHA-256) and, written last, the
`COMPLETE` marker (and later, once the step after it ran finite, the `NEXT_STEP_FINITE` mark). Nothing in it is
code:

* DCP's own writer pickles its index (`.metadata`) and its reader unpickles it, so a shared checkpoint could run
  code on whoever loads it. titan writes the same index as JSON (CheckpointWriter) and turns it back into DCP's
  Metadata itself (CheckpointReader), after checking every entry against the folder: plain file names that the
  manifest lists, byte ranges inside those files, chunks that tile their tensor (each element in exactly one).
  A tensor's declared size is therefore bounded by the bytes on disk.
* Each shard entry is a tensor saved with torch.save, which DCP reads with torch.load(weights_only=True), once
  its zip records are known to be stored and no larger than its bytes (archive_problem).
* DCP stores values that are not tensors as "bytes" entries and reads them with torch.load(weights_only=False),
  which runs code. titan never writes them (its state is tensors and JSON), and the JSON index cannot express one.

Checkpoints of titan before this format hold the pickled `.metadata`; `titan convert upgrade` rewrites one to
`tensors.json` once, reading the pickle through an allow-list of DCP's exact metadata classes, setting the state
of no object but those it made (legacy_index).

folder.py: the folder, its manifest and their checks (seal, verify); index.py: tensors.json (index_of,
metadata_of); chunks.py: the chunks' checks (boxes_tile, archive_problem); storage.py: DCP's reader and writer
for these folders; legacy.py: the pickled index of older checkpoints (legacy_index, upgrade).
"""

from titan.checkpoint.format.chunks import archive_problem
from titan.checkpoint.format.folder import (
    INDEX,
    LEGACY_INDEX,
    MANIFEST,
    MARKER,
    PROVEN,
    folder_problems,
    read_manifest,
    seal,
    sha256_files,
    verify,
)
from titan.checkpoint.format.index import FORMAT, VERSION, index_of, metadata_of
from titan.checkpoint.format.legacy import legacy_index, upgrade
from titan.checkpoint.format.storage import CheckpointReader, CheckpointWriter, dcp_error, single_process_quiet

__all__ = [
    "FORMAT",
    "INDEX",
    "LEGACY_INDEX",
    "MANIFEST",
    "MARKER",
    "PROVEN",
    "VERSION",
    "CheckpointReader",
    "CheckpointWriter",
    "archive_problem",
    "dcp_error",
    "folder_problems",
    "index_of",
    "legacy_index",
    "metadata_of",
    "read_manifest",
    "seal",
    "sha256_files",
    "single_process_quiet",
    "upgrade",
    "verify",
]
