"""What the launcher (torchrun, or none) tells a process through its environment, read in one place; and local
ranks started as torchrun starts its workers, forked from a server process (run_local_ranks)."""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Launch:
    """This process's place in the job: its rank among `world`, its agent's (node's) `local_world` processes, and
    under an elastic torchrun the worker restarts so far (`restart`) and allowed (`max_restarts`). One process
    outside any launcher: rank 0 of 1, no restarts."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    restart: int = 0
    max_restarts: int = 0
    launched: bool = False  # under a launcher that says the world size (torchrun, or a test's own)
    agent: bool = False  # under torchrun's elastic agent
    run_id: str = ""  # torchrun's --rdzv-id (a new one per --standalone launch)

    @classmethod
    def from_env(cls) -> Launch:
        get = lambda name, default: int(os.environ.get(name, default))  # noqa: E731
        return cls(
            rank=get("RANK", 0),
            world=get("WORLD_SIZE", 1),
            local_rank=get("LOCAL_RANK", 0),
            local_world=get("LOCAL_WORLD_SIZE", 1),
            restart=get("TORCHELASTIC_RESTART_COUNT", 0),
            max_restarts=get("TORCHELASTIC_MAX_RESTARTS", 0),
            launched="WORLD_SIZE" in os.environ,
            agent="TORCHELASTIC_RUN_ID" in os.environ,
            run_id=os.environ.get("TORCHELASTIC_RUN_ID", ""),
        )

    @property
    def restarts_left(self) -> int:
        """How many more times torchrun's agent restarts the workers (0 outside torchrun)."""
        return self.max_restarts - self.restart


def run_local_ranks(context, target: Callable, args_of: Callable[[int, dict], tuple], world: int,
                    timeout: float | None = None) -> int:  # fmt: skip
    """target(*args_of(rank, env)) on `world` local ranks, each a process forked from the server of `context` (a
    multiprocessing forkserver context, whose preloaded imports the ranks then skip), `env` being what torchrun gives
    its workers: RANK, WORLD_SIZE, ... and the address of a store hosted here, as torchrun's agent hosts it (empty for
    one rank). As torchrun does, once one rank fails the others are stopped. Returns the first failed rank's exit
    status, else 0; TimeoutError after `timeout` seconds."""
    import torch.distributed as dist

    shared, store = {}, None
    if world > 1:  # port 0: the system picks a free one, so launches side by side never race for it
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        shared = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}  # fmt: skip
    deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
    with tempfile.TemporaryDirectory(prefix="titan-ranks-") as statuses:
        ranks = []
        for rank in range(world):
            env = {**shared, "RANK": str(rank), "LOCAL_RANK": str(rank)} if store else {}
            status = str(Path(statuses) / str(rank))
            ranks.append(context.Process(target=_with_status, args=(target, args_of(rank, env), status)))
            ranks[-1].start()
        try:
            while not first_failure(ranks, statuses) and any(rank.is_alive() for rank in ranks):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world} local ranks still running after {timeout:g} s")
                time.sleep(0.05)
        finally:
            for rank in ranks:
                rank.kill()  # the ranks left: a failed rank's peers, waiting in a collective (or all, on Ctrl-C)
                rank.join()
        return first_failure(ranks, statuses)


def first_failure(ranks: list, statuses: str) -> int:
    """The first ended rank's status that is not 0. A rank writes it to a file as it ends: multiprocessing's own
    report from the forkserver is lost under load (CPython issue 140867), read as 255."""
    for rank, process in enumerate(ranks):
        if process.exitcode is None:
            continue
        written = Path(statuses) / str(rank)
        status = int(written.read_text()) if written.is_file() else process.exitcode
        if status:
            return status
    return 0


def _with_status(target: Callable, args: tuple, status: str) -> None:
    """A rank's body: target(*args), its exit status (a SystemExit's, 1 for an exception, whose traceback is printed)
    written to `status` before the rank ends with it."""
    code = 1
    try:
        target(*args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        Path(status).write_text(str(code))
    sys.exit(code)
