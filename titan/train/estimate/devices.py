"""The accelerators `titan plan` knows: datasheet figures of one device and of the links around it (any figure
can be replaced from the recipe's [plan] section, e.g. for another node design), and the time the links take."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titan.config import PlanTarget
from titan.train.estimate.counters import Cost

# Collectives that FSDP overlaps with compute (prefetched all-gathers, reduce-scatters behind the backward); efsdp:
# the routed experts' FSDP under expert parallelism.
OVERLAPPED = {"fsdp", "dp_shard", "dp_replicate", "efsdp"}


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float  # dense bf16 FLOP/s (no sparsity)
    memory_gib: float  # as the driver reports it (nvidia-smi, rocm-smi)
    hbm_gbs: float  # memory bandwidth, GB/s
    intra_node_gbs: float  # to the other devices of its node (NVLink, Infinity Fabric), GB/s each way
    inter_node_gbs: float  # to other nodes (one 400 or 200 Gb/s NIC per device), GB/s each way
    gpus_per_node: int
    host_gbs: float  # to host memory (PCIe x16), GB/s each way: activation offload's copies


DEVICES = {
    "h100": Device("NVIDIA H100 SXM 80GB", 989e12, 79.6, 3350, 450, 50, 8, 64),
    "h200": Device("NVIDIA H200 SXM 141GB", 989e12, 140.4, 4800, 450, 50, 8, 64),
    "a100": Device("NVIDIA A100 SXM4 80GB", 312e12, 80.0, 2039, 300, 25, 8, 32),
    "mi300x": Device("AMD Instinct MI300X", 1307e12, 191.7, 5300, 448, 50, 8, 64),
}


def planned_device(target: PlanTarget) -> Device:
    """The recipe's device, with the figures its [plan] section sets (0 keeps the table's)."""
    device = DEVICES[target.device]
    overrides = {f.name: getattr(target, f.name) for f in dataclasses.fields(Device) if f.name != "name"}
    return dataclasses.replace(device, **{key: value for key, value in overrides.items() if value})


class Links:
    """Seconds for the bytes a rank moves: ring collectives at the bandwidth of the slowest link their group
    crosses (within a node, or between nodes)."""

    def __init__(self, device: Device, world_size: int):
        self.device, self.world_size = device, world_size

    def transfer(self, nbytes: float, ranks: tuple[int, ...]) -> float:
        same_node = len({r // self.device.gpus_per_node for r in ranks}) == 1
        return nbytes / (1e9 * (self.device.intra_node_gbs if same_node else self.device.inter_node_gbs))

    def collective(self, kind: str, nbytes: float, ranks: tuple[int, ...]) -> float:
        """A ring collective over `ranks` of a tensor of `nbytes` (whole: gathered, or before reducing): each rank
        sends (n - 1) / n of it, twice for an all-reduce (a reduce-scatter, then an all-gather). Point to point and
        all-to-all bytes are what crosses the rank's link already (all to one neighbour; all_to_all_bytes)."""
        if kind in ("send/recv", "all-to-all"):
            return self.transfer(nbytes, ranks)
        n = len(ranks)
        return self.transfer(nbytes * (2 if kind == "all-reduce" else 1) * (n - 1) / n, ranks)

    def seconds(self, cost: Cost, groups: dict[str, tuple[int, ...]]) -> float:
        """A phase's time: its compute, the collectives it waits for, what FSDP's do not hide, and what context
        parallelism's ring does not hide behind the attention kernels (each block in flight while the one before
        it is computed). The ring's is taken over the phase, not hop by hop: a lower bound, as the hops carry
        alike and compute about alike (each step after the first computes two chunk pairs)."""
        hidden = exposed = ring = 0.0
        for (kind, role), nbytes in cost.traffic.items():
            seconds = self.collective(kind, nbytes, groups.get(role, tuple(range(self.world_size))))
            if role in OVERLAPPED:
                hidden += seconds
            elif role == "cp" and kind == "send/recv":
                ring += seconds
            else:
                exposed += seconds
        ring_exposed = max(0.0, ring - cost.attention_seconds)
        return cost.seconds + exposed + ring_exposed + max(0.0, hidden - cost.seconds)
