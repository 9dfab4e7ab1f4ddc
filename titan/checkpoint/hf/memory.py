"""The peak host memory a block of work added (init_from_hf and dcp-to-hf report it; so does titan generate)."""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path


class PeakMemory:
    """`with PeakMemory() as peak: ...`, then `peak.added`: the most resident host memory the block added, in
    bytes, or None where that cannot be measured.

    Linux keeps each process's high-water mark of resident memory (VmHWM in /proc/self/status), and writing "5"
    to /proc/self/clear_refs resets it to the current size (VmRSS): the mark after the block minus VmRSS before it
    is the block's peak. Elsewhere (not Linux, or a /proc that refuses the write) `added` stays None. It counts
    the pages of files mapped in (safetensors maps what it reads), not memory the allocator had kept from before
    and hands out again. A nested measurement resets the mark, hiding an outer block's earlier peak.
    """

    added: int | None = None

    def __enter__(self) -> PeakMemory:
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self._before = _proc_status_bytes("VmRSS")
        except (OSError, ValueError, KeyError):
            self._before = None
        return self

    def __exit__(self, *exc) -> None:
        if self._before is not None:
            with contextlib.suppress(OSError, ValueError, KeyError):
                self.added = max(0, _proc_status_bytes("VmHWM") - self._before)

    def __str__(self) -> str:
        return "not measured (needs Linux's /proc)" if self.added is None else f"{self.added / 2**20:.1f} MiB"


def _proc_status_bytes(field: str) -> int:
    """A '<field>:  123 kB' line of /proc/self/status, in bytes."""
    lines = Path("/proc/self/status").read_text().splitlines()
    return 1024 * int(dict(line.split(":", 1) for line in lines)[field].split()[0])


def release_freed_memory() -> None:
    """Hand the allocator's freed pages back to the OS (glibc's malloc_trim; elsewhere nothing). glibc keeps what a
    freed tensor held once its mmap threshold has grown past that size, so a loop that frees each file's tensors
    before the next would otherwise hold the pages of every size it has seen."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
