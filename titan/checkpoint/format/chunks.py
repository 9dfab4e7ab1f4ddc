"""The checks of a checkpoint's chunks: that an index's chunks tile their tensor (boxes_tile), and that each chunk's
bytes are a torch.save archive that torch.load reads within them (archive_problem)."""

from __future__ import annotations

import io
import itertools
import struct
import zipfile
from collections import Counter
from collections.abc import Sequence
from typing import BinaryIO


def boxes_tile(shape: list[int], boxes: list[tuple[Sequence[int], Sequence[int]]]) -> bool:
    """Whether the boxes (offsets, sizes) inside a tensor of `shape` hold each of its elements exactly once. A box's
    indicator is the signed sum of the orthants at its 2^d corners (+ at an even number of far ends, - at an odd),
    and distinct orthants are linearly independent: the boxes tile the tensor iff the signed counts of their
    corners are the tensor's own. O(boxes x 2^d), where comparing boxes pairwise would be O(boxes^2)."""
    counts: Counter[tuple[int, ...]] = Counter()

    def add(offsets: Sequence[int], sizes: Sequence[int], sign: int) -> None:
        for far in itertools.product((0, 1), repeat=len(sizes)):
            corner = tuple(o + n * f for o, n, f in zip(offsets, sizes, far))
            counts[corner] += -sign if sum(far) % 2 else sign

    for offsets, sizes in boxes:
        add(offsets, sizes, 1)
    add([0] * len(shape), shape, -1)
    return not any(counts.values())


class _ByteRange(io.RawIOBase):
    """Bytes [start, start + length) of an open file as a file of their own: a chunk's zip directory is read
    through it without reading the chunk."""

    def __init__(self, file: BinaryIO, start: int, length: int):
        super().__init__()
        self._file, self._start, self.length, self._at = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        at = offset + (0, self._at, self.length)[whence]
        if at < 0:
            raise ValueError(f"seek to byte {at}, before the chunk")
        self._at = at
        return at

    def readinto(self, buffer) -> int:
        self._file.seek(self._start + self._at)
        read = self._file.readinto(memoryview(buffer)[: max(0, self.length - self._at)])
        self._at += read
        return read


def archive_problem(file: BinaryIO, start: int, length: int) -> str | None:
    """What would make torch.load take more memory for the torch.save archive at bytes [start, start + length) of
    `file` than those bytes, or None.

    torch.load allocates each record it reads at the size the zip directory declares, and a deflated record
    declares what it likes (a 64-float view of a 100M-float storage in 390 KB took 394 MiB): the records must be
    stored, no larger together than the chunk. Checked, then read by torch.load rather than by titan, so that
    torch's own weights-only unpickler still rebuilds the tensor (storage, view, dtype). zipfile reads the
    directory it finds right before the end record, torch's zip reader (miniz) the one at the offset the end
    record states: the archive must end with its directory and end record, so that both read the same."""
    chunk = _ByteRange(file, start, length)
    entries = _directory_entries(chunk)
    if entries is None:
        return "is not a torch.save archive (its zip directory is not where its end record says)"
    try:
        with zipfile.ZipFile(chunk) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, ValueError, EOFError, OSError) as e:
        return f"is not a torch.save archive ({e})"
    if len(records) != entries:
        return f"is not a torch.save archive (its zip directory holds {len(records)} records, its end record {entries})"
    if any(r.compress_type != zipfile.ZIP_STORED or r.compress_size != r.file_size for r in records):
        return "holds compressed records (torch.save writes none; torch.load would inflate them whole)"
    if sum(r.file_size for r in records) > chunk.length:
        return f"declares records of {sum(r.file_size for r in records)} bytes, more than its {chunk.length}"
    return None


def _directory_entries(chunk: _ByteRange) -> int | None:
    """The number of records the archive's end record (zip64's where there is one) declares, if the archive ends
    with it (no comment) and its central directory lies right before it; else None."""
    end = chunk.length - zipfile.sizeEndCentDir
    try:
        chunk.seek(end)
        sig, *_, entries, size, offset, comment = struct.unpack(
            zipfile.structEndArchive, chunk.read(zipfile.sizeEndCentDir)
        )
        if sig != zipfile.stringEndArchive or comment:
            return None
        chunk.seek(end - zipfile.sizeEndCentDir64Locator)
        sig, _, record, _ = struct.unpack(
            zipfile.structEndArchive64Locator, chunk.read(zipfile.sizeEndCentDir64Locator)
        )
        if sig == zipfile.stringEndArchive64Locator:  # zip64: its end record, right before the locator
            end = end - zipfile.sizeEndCentDir64Locator - zipfile.sizeEndCentDir64
            chunk.seek(end)
            sig, *_, entries, size, offset = struct.unpack(
                zipfile.structEndArchive64, chunk.read(zipfile.sizeEndCentDir64)
            )
            if sig != zipfile.stringEndArchive64 or record != end:
                return None
    except (struct.error, ValueError):  # too short for the records
        return None
    return entries if offset + size == end else None
