"""What the launcher (torchrun, or none) tells a process through its environment, read in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass


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
