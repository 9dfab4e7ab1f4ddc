"""Whether a .zst file ends where a frame ends. zstandard's stream reader ends quietly inside a frame, so a file cut
short would read as shorter text; gzip and bz2 refuse the same damage. The frames' and blocks' headers say where
each ends (RFC 8878), so the check seeks from header to header and decompresses nothing."""

from __future__ import annotations

from pathlib import Path

MAGIC = 0xFD2FB528
SKIPPABLE = 0x184D2A50  # the 16 magic numbers of skippable frames, low nibble masked
BLOCK_RLE = 1  # a block type whose content is one byte, whatever its size field says


def check_frames(file: Path) -> None:
    """Raise EOFError where `file`'s last frame is cut short. Bytes that start no zstd frame are left to the
    decoder, whose own error names them."""
    size = file.stat().st_size
    with open(file, "rb") as f:

        def read(at: int, n: int) -> bytes:
            f.seek(at)
            data = f.read(n)
            if len(data) < n:
                raise EOFError(f"it ends inside a zstd frame, at byte {size:,}")
            return data

        at = 0
        while at < size:
            magic = int.from_bytes(read(at, 4), "little")
            if magic & 0xFFFFFFF0 == SKIPPABLE:
                at += 8 + int.from_bytes(read(at + 4, 4), "little")
                continue
            if magic != MAGIC:
                return
            descriptor = read(at + 4, 1)[0]
            single_segment = descriptor >> 5 & 1
            content_size = (single_segment, 2, 4, 8)[descriptor >> 6]
            at += 5 + (1 - single_segment) + (0, 1, 2, 4)[descriptor & 3] + content_size
            last = False
            while not last:
                header = int.from_bytes(read(at, 3), "little")
                last, kind, block = header & 1, header >> 1 & 3, header >> 3
                at += 3 + (1 if kind == BLOCK_RLE else block)
            at += 4 * (descriptor >> 2 & 1)  # the content checksum
        if at > size:
            raise EOFError(f"it ends inside a zstd frame, at byte {size:,}")
