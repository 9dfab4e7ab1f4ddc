"""Progress of long work (conversions, downloads, checkpoint loads and saves, hub datasets), shown on rank 0 only.

On a terminal it is a tqdm bar (as `titan data prepare` draws); in a log file, where a bar's carriage returns
would pile up, it is a line every LOG_EVERY_S seconds. Work that ends sooner shows nothing either way. Times read
as tqdm writes them (01:20). Neither torch nor any other titan package is imported here: the data plane, the
checkpoints and the commands all report through it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from titan.launcher import Launch

LOG_EVERY_S = 30.0
BAR_DELAY_S = 1.0  # a bar appears only for work still going after this long


def is_rank_0() -> bool:
    """Whether this process is rank 0 (or the only one): RANK is set by torchrun and SLURM launches."""
    return Launch.from_env().rank == 0


class Progress:
    """`with Progress("exporting", total=n_bytes, unit="B") as p: ... p.update(k)`.

    total: the amount of work when known (None: a count without a percentage or time left); unit "B" shows sizes
    as 1.2GB. enabled=False shows nothing (e.g. work in the background). stream and clock are what the bar
    writes to and how the log lines tell time, log_every_s how often they come (default LOG_EVERY_S).
    """

    def __init__(
        self,
        what: str,
        total: float | None = None,
        unit: str = "",
        *,
        enabled: bool = True,
        stream=None,
        clock: Callable[[], float] = time.monotonic,
        log_every_s: float | None = None,
    ):
        self.what, self.total, self.unit = what, total or None, unit
        self.done = 0.0
        self._stream = stream if stream is not None else sys.stderr
        self._clock, self._every = clock, LOG_EVERY_S if log_every_s is None else log_every_s
        self._start = self._last = clock()
        self._logged = False
        self._detail = ""
        self._lock = threading.Lock()  # DCP may write from several threads
        self._bar = None
        self.enabled = enabled and is_rank_0()
        if self.enabled and _is_terminal(self._stream):
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total,
                desc=what,
                unit=unit or "it",
                unit_scale=True,
                unit_divisor=1024 if unit == "B" else 1000,
                file=self._stream,
                delay=BAR_DELAY_S,
                mininterval=0.5,
            )

    def update(self, amount: float = 1) -> None:
        if not self.enabled:
            return
        with self._lock:
            self.done += amount
            if self._bar is not None:
                self._bar.update(amount)
                return
            now = self._clock()
            if now - self._last >= self._every:
                self._last, self._logged = now, True
                self._emit(self.describe(now - self._start))

    def detail(self, text: str) -> None:
        """A note after the figures, e.g. '2,600 documents, 1.2M tokens/s', replaced by the next one."""
        if not self.enabled:
            return
        self._detail = text
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)

    def describe(self, seconds: float) -> str:
        """'exporting: 1.2GB of 2.6GB (46%), 35.0MB/s, about 00:40 left' (what a log line says)."""
        from tqdm import tqdm

        rate = self.done / seconds if seconds > 0 else 0.0
        if self.unit == "B":  # sizes: 1.2GB of 2.6GB, 35.0MB/s
            amount = lambda n: tqdm.format_sizeof(n, "B", 1024)  # noqa: E731
            unit = ""
        else:  # counts: 12 of 40 records, 12.3k of 100k records, 5.20k records/s
            amount = lambda n: tqdm.format_sizeof(n) if n >= 1000 else f"{n:g}"  # noqa: E731
            unit = self.unit
        line = f"{self.what}: {amount(self.done)}"
        line += f" of {amount(self.total)}{unit} ({100 * self.done / self.total:.0f}%)" if self.total else unit
        line += f", {tqdm.format_sizeof(rate, self.unit, 1024 if self.unit == 'B' else 1000)}/s"
        if self.total and rate > 0:
            line += f", about {tqdm.format_interval(max(0.0, self.total - self.done) / rate)} left"
        return line + (f"; {self._detail}" if self._detail else "")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._logged:  # a log that said it was under way says when it is done
            from tqdm import tqdm

            self._emit(f"{self.what}: done in {tqdm.format_interval(self._clock() - self._start)}")
        self.enabled = False

    def _emit(self, line: str) -> None:
        # As the trainer's log lines read (titan.observe.metrics.setup_logging), in commands that set up no logging too.
        print(f"{time.strftime('%H:%M:%S')} {line}", file=self._stream, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
