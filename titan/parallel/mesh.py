"""The process group and the device mesh: the recipe's parallel degrees become named mesh dimensions.

Mesh dims, outermost first: pp, dp_replicate, dp_shard, cp, tp. TP is innermost so its heavy traffic stays on
the fastest links (within a node), the context-parallel ring next to it; PP is outermost because it only sends
activations between neighbours.
"""

from __future__ import annotations

import datetime
import os
import platform
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan.config import Layout
from titan.errors import UserError
from titan.launcher import Launch

T = TypeVar("T")


def init_distributed(backend: str, device: torch.device, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the job's process group when launched by torchrun/srun; returns (rank, world size). timeout_s: how long
    joining and each collective wait for the other ranks (TITAN_DIST_TIMEOUT_S, when set, wins: for tests)."""
    world_size = Launch.from_env().world
    if world_size == 1 or dist.is_initialized():
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    require_fresh_store()
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=float(os.environ.get("TITAN_DIST_TIMEOUT_S", timeout_s)))
    dist.init_process_group(backend=backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    return dist.get_rank(), dist.get_world_size()


def require_fresh_store() -> None:
    """torchrun's agent by default lends its workers one store for the whole job, and a restarted worker joining
    the process group there can read the address a dead worker wrote, and fail to connect. With
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 each restart gets a store of its own (rank 0's)."""
    shared = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if shared and Launch.from_env().max_restarts:
        raise UserError(
            "torchrun --max-restarts with its shared store: a restarted worker would read a dead one's address and "
            "fail to connect; start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment "
            "(docs/fault-tolerance.md)"
        )


def build_mesh(layout: Layout, device: torch.device) -> dict[str, DeviceMesh]:
    """Sub-meshes by role: pp, tp, cp, dp (both data-parallel dims flattened: data loading, loss sums) and
    fsdp (dp_shard, or dp_replicate x dp_shard for HSDP; with context parallelism, dp_shard x cp flattened, as the
    cp ranks' gradients are summed like the data-parallel ones); with expert parallelism ep and efsdp
    (_expert_meshes). Empty for one process."""
    if layout.world_size == 1:
        return {}
    root = init_device_mesh(
        device.type,
        (layout.pp, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp),
        mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"),
    )
    shard = "dp_shard"
    # With cp, the meshes below slice the flattened dp_shard_cp from the root mesh, which torch (2.11 on) says
    # "will be deprecated" each time: HSDP x cp has no other way to its 2-D mesh yet. A torch that ends it fails
    # the layout tests, not a user's run silently.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Slicing a flattened dim from root mesh", UserWarning)
        if layout.cp > 1:
            shard = "dp_shard_cp"
            root["dp_shard", "cp"]._flatten(shard)
        # Norms of parameters sharded by FSDP and TP (gradient clipping) reduce over both dims: flattened, DTensor
        # reduces them in one collective instead of one per dim.
        root[shard, "tp"]._flatten()
        return {
            "pp": root["pp"],
            "tp": root["tp"],
            "cp": root["cp"],
            "dp": root["dp_replicate", "dp_shard"]._flatten("dp"),
            "fsdp": root["dp_replicate", shard] if layout.dp_replicate > 1 else root[shard],
            **(_expert_meshes(root, layout) if layout.ep > 1 else {}),
        }


def _expert_meshes(root: DeviceMesh, layout: Layout) -> dict[str, DeviceMesh]:
    """Expert parallelism borrows its ranks from dp_shard x cp, as TorchTitan does: dp_shard unflattens into
    (efsdp, ep / cp) and ep is its inner part x cp, the neighbouring ranks (the all-to-all's heavy traffic on the
    fastest links). The ep group splits the experts; the ranks that hold the same experts (efsdp, and dp_replicate
    for HSDP) shard them by FSDP, while the other parameters are sharded over the whole fsdp mesh."""
    within = layout.ep // layout.cp
    sparse = root._unflatten("dp_shard", (layout.dp_shard // within, within), ("efsdp", "ep_shard"))
    return {
        "ep": sparse["ep_shard", "cp"]._flatten("ep"),
        "efsdp": sparse["dp_replicate", "efsdp"] if layout.dp_replicate > 1 else sparse["efsdp"],
    }


def new_gloo_group(timeout_s: float | None = None):
    """A gloo group over every rank (None for one process): for work that must not share a group with
    training's collectives, such as checkpoint barriers, stop votes and DCP's background saves. timeout_s: how
    long its collectives wait for the other ranks (None: torch's default)."""
    if not dist.is_initialized():
        return None
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    return dist.new_group(backend="gloo", timeout=timeout)


def on_rank_0(work: Callable[[], T], group=None, device: torch.device | None = None) -> T:
    """`work()` done by rank 0 alone and its result given to every rank of `group` (the default group when None),
    so that they all decide from the same numbers; without a process group, just `work()`. A UserError on rank 0
    is raised on every rank, which would otherwise wait for rank 0 at their next collective. `device`: where the
    group's backend sends objects from (a GPU for NCCL)."""
    if not dist.is_initialized():
        return work()
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = work()
        except UserError as e:
            error = e
    shared = [(result, error)]
    dist.broadcast_object_list(shared, src=0, group=group, device=device)
    result, error = shared[0]
    if error is not None:
        raise error
    return result


def rank_devices(group) -> list[str]:
    """Each rank's device, in rank order: its host and local rank (under torchrun, the node and its GPU)."""
    mine = f"{platform.node()}:{Launch.from_env().local_rank}"
    if group is None:
        return [mine]
    devices = [""] * dist.get_world_size()
    dist.all_gather_object(devices, mine, group=group)
    return devices
