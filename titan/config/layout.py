"""The parallel layout: how the recipe's degrees split the world."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titan.config.sections import Parallel
from titan.errors import ConfigError
from titan.schema import Integer, Table


def degrees_world_size(p: Parallel) -> int:
    """The world the recipe's parallel degrees make by themselves; dp_shard = -1 (whatever is left) counts as 1."""
    return p.dp_replicate * abs(p.dp_shard) * p.cp * p.tp * p.pp


class LayoutError(ConfigError):
    """The parallel degrees cannot make the world size."""


@dataclass(frozen=True)
class Layout:
    """How the world is split: the one description of a parallel layout, used by the trainer, the mesh,
    the metrics and `titan compare` (this module is torch-free, so reports never import torch)."""

    dp_replicate: int = 1  # HSDP replicas
    dp_shard: int = 1  # FSDP shards
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: ranks sharing each sequence
    ep: int = 1  # expert parallel: ranks splitting the experts, taken from dp_shard x cp (not in the world size)

    @classmethod
    def from_config(cls, p: Parallel, world_size: int) -> Layout:
        """The recipe's degrees with dp_shard = -1 resolved; they must multiply to the world size."""
        others = p.dp_replicate * p.cp * p.tp * p.pp
        degrees = other_degrees(p)
        dp_shard = p.dp_shard if p.dp_shard != -1 else world_size // others
        if p.dp_shard == -1 and (dp_shard < 1 or others * dp_shard != world_size):
            raise LayoutError(
                f"parallel.dp_shard = -1 takes what {degrees} = {others} leaves of the world size {world_size}, and "
                f"{others} does not divide it; launch a multiple of {others} processes (torchrun --nproc-per-node) "
                "or lower the degrees"
            )
        if dp_shard < 1 or others * dp_shard != world_size:
            raise LayoutError(
                f"parallel degrees {degrees} x dp_shard={p.dp_shard} do not multiply to the world size "
                f"{world_size}; set parallel.dp_shard = -1 or change the degrees"
            )
        check_expert_parallel(p, dp_shard)
        return cls(p.dp_replicate, dp_shard, p.tp, p.pp, p.cp, p.ep)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: replicas x shards."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def name(self) -> str:
        """The degrees other than 1, e.g. 'dp_shard2-tp2'; 'single' when there are none."""
        return "-".join(f"{k}{v}" for k, v in dataclasses.asdict(self).items() if v != 1) or "single"


# A layout as files record it (run_info.json, a saved re-plan): degrees of Layout, an absent one 1.
LAYOUT_SPEC = Table({f.name: Integer(1) for f in dataclasses.fields(Layout)}, closed=True)


def check_expert_parallel(p: Parallel, dp_shard: int) -> None:
    """The expert-parallel group is whole context-parallel groups times a divisor of dp_shard: the ranks whose
    tokens it shares, innermost after cp (titan/parallel/mesh.py)."""
    if p.ep == 1:
        return
    if p.ep % p.cp:
        raise ConfigError(
            f"parallel.ep = {p.ep} must be a multiple of parallel.cp = {p.cp}: the expert-parallel group takes whole "
            "context-parallel groups; raise ep or lower cp"
        )
    if p.dp_replicate * dp_shard == 1:
        raise ConfigError(
            f"parallel.ep = {p.ep} without data parallelism (dp_shard = 1: the ep group is the cp group) is not "
            "supported yet: expert parallelism runs under FSDP, which shards each rank's experts, and FSDP needs "
            "data-parallel ranks; use dp_shard >= 2 (launch more processes)"
        )
    if dp_shard % (p.ep // p.cp):
        raise ConfigError(
            f"parallel.ep = {p.ep} must divide dp_shard x cp = {dp_shard} x {p.cp}: expert-parallel ranks are "
            "taken from the FSDP (and context-parallel) ranks, not added to the world; use a divisor of "
            f"{dp_shard * p.cp} or launch more processes"
        )


def other_degrees(p: Parallel) -> str:
    """The degrees besides dp_shard, as messages name them (cp only where it is used)."""
    cp = f" x cp={p.cp}" if p.cp != 1 else ""
    return f"dp_replicate={p.dp_replicate}{cp} x tp={p.tp} x pp={p.pp}"
