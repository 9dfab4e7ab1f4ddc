"""`python -m titan` for torchrun, with SIGKILLs planted: `TITAN_TEST_KILL=RANK:STEP:PLACE[,RANK:STEP:PLACE...]
torchrun ... tests/elastic_kill.py train ...`. The i-th kill is in the workers of torchrun's i-th restart
(TORCHELASTIC_RESTART_COUNT = i; the first start is 0): there, rank RANK kills itself at step STEP, at PLACE:

- `forward`: as its forward begins (or any other phase the watchdog names, as it begins: `data`, or
  `forward_backward` under a pipeline);
- `snapshot`: inside the in-memory snapshot's save, once the snapshot folder holds the step's partial save;
- `collective`: as it enters the backward's reduce-scatter, the other ranks already waiting in it.

Workers past the last kill run as titan does. With `TITAN_TEST_STEP_S=SECONDS`, every rank sleeps that long as each
step's data phase begins: a run slow enough for a test to act on it mid-run."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # this checkout's titan, whatever is installed

import torch.distributed as dist  # noqa: E402

from titan.checkpoint.format.storage import CheckpointWriter  # noqa: E402
from titan.train.recovery.watchdog import Watchdog  # noqa: E402

REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")


def die(place: str, step: int) -> None:
    print(f"elastic_kill: rank {os.environ['RANK']} SIGKILL at step {step} ({place})", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def plant(step: int, place: str) -> None:
    """Wrap the functions that mark PLACE so that the rank dies there at `step`; the watchdog's position says
    which step and phase the rank is in."""
    enter = Watchdog.enter

    def entering(self, phase: str, at: int | None = None) -> None:
        enter(self, phase, at)
        where = plant.where = self.where[:2]
        if place not in ("snapshot", "collective") and where == (step, place):
            die(place, step)

    Watchdog.enter = entering
    if place == "snapshot":
        write_data = CheckpointWriter.write_data

        def writing(self, *args, **kwargs):
            folder = Path(self.path)
            if plant.where == (step, "snapshot") and any(folder.iterdir()):  # the step's partial save
                die(place, step)
            return write_data(self, *args, **kwargs)

        CheckpointWriter.write_data = writing
    if place == "collective":
        for name in (n for n in REDUCE_SCATTERS if hasattr(dist, n)):

            def reducing(*args, _collective=getattr(dist, name), **kwargs):
                if plant.where == (step, "backward"):
                    die(place, step)
                return _collective(*args, **kwargs)

            setattr(dist, name, reducing)


plant.where = (0, "start-up")


def slow_down(seconds: float) -> None:
    enter = Watchdog.enter

    def entering(self, phase: str, at: int | None = None) -> None:
        enter(self, phase, at)
        if phase == "data":
            time.sleep(seconds)

    Watchdog.enter = entering


if __name__ == "__main__":
    kills = os.environ.get("TITAN_TEST_KILL", "").split(",")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart < len(kills) and kills[restart]:
        rank, step, place = kills[restart].split(":")
        if rank == os.environ.get("RANK"):
            plant(int(step), place)
    if os.environ.get("TITAN_TEST_STEP_S"):
        slow_down(float(os.environ["TITAN_TEST_STEP_S"]))
    from titan.cli import main

    main()
