"""What `titan plan` measures while it runs a rank's step under fake tensors, with torch's tools where they can:

- MemTracker (torch.distributed._tools.mem_tracker) follows every tensor's storage, FSDP's resizes included;
- FLOPs use FlopCounterMode's formulas (torch.utils.flop_counter.flop_registry), applied to each local op:
  FlopCounterMode counts a DTensor op once at its global shape (tp times this rank's work), and has no formula
  for the CPU's flash attention, which stands in for the GPU's;
- collectives are sized by torch.distributed._tools.fake_collectives: CommDebugMode counts them, not their bytes;
  an all-to-all by its split sizes (all_to_all_bytes), which fake_collectives does not read;
- op times are a roofline from the plan's device figures: torch.distributed._tools.runtime_estimator's roofline
  reads them from a CUDA device, which this CPU has not.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops, sync_ops
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

aten = torch.ops.aten
c10d = torch.ops.c10d
RECEIVES = {c10d.recv_.default, c10d.recv_any_source_.default}
# Expert parallelism's exchanges: the tokens' (functional, differentiable) and their counts' (c10d).
ALL_TO_ALL = {
    torch.ops._c10d_functional.all_to_all_single.default,
    torch.ops._c10d_functional_autograd.all_to_all_single.default,
    c10d.alltoall_base_.default,
}
NO_TRAFFIC = {aten._unsafe_view}  # a view, though its schema does not say so
ALLOCATIONS = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided}  # write nothing


def grouped_mm_flops(a, b, *args, out_shape=None, **kwargs) -> int:
    """torch._grouped_mm's FLOPs (a MoE's routed experts): each output element sums a row of `a` times a column of
    `b` of one group. With both 2-D (a weight gradient, out (groups, k, n)), the groups split the contraction, a's
    columns; otherwise every row contracts a's last dimension."""
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    return 2 * math.prod(out_shape) * a[-1]


def causal_share(q, is_causal: bool) -> float:
    """The share of the score matrix a flash kernel computes: the lower triangle, diagonal included, of a causal
    one (a 128k step's attention is most of it; FlopCounterMode counts the whole matrix)."""
    seq = q[-2]
    return (seq + 1) / (2 * seq) if is_causal else 1.0


# FlopCounterMode's formulas, plus the CPU's flash attention (the kernel the GPU's flash attention is traced as),
# causal at its triangle, and the grouped matmul.
FLOPS = {
    **flop_registry,
    aten._grouped_mm: shape_wrapper(grouped_mm_flops),
    aten._scaled_dot_product_flash_attention_for_cpu: shape_wrapper(
        lambda q, k, v, dropout_p=0.0, is_causal=False, *_, out_shape=None, **__: (
            sdpa_flop_count(q, k, v) * causal_share(q, is_causal)
        )
    ),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: shape_wrapper(
        lambda grad, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *_, out_shape=None, **__: (
            sdpa_backward_flop_count(grad, q, k, v) * causal_share(q, is_causal)
        )
    ),
}
# The attention kernels, behind which context parallelism's ring sends its next block.
ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
}


@dataclass
class Cost:
    """What a phase of the step costs this rank: FLOPs, roofline seconds, and bytes per (collective, group)."""

    flops: float = 0.0
    seconds: float = 0.0
    traffic: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    attention_seconds: float = 0.0  # the part of `seconds` in attention kernels

    def add(self, other: Cost, times: float = 1.0) -> None:
        self.flops += times * other.flops
        self.seconds += times * other.seconds
        self.attention_seconds += times * other.attention_seconds
        for key, value in other.traffic.items():
            self.traffic[key] += times * value


class StepCounter(TorchDispatchMode):
    """Counts each op this rank runs: FLOPs, roofline seconds (the slower of compute at the peak FLOP/s and moving
    its inputs and outputs through HBM), the largest tensor allocated, and collective bytes by process group."""

    def __init__(self, peak_flops: float, hbm_bytes_per_s: float, groups: dict[str, tuple[int, ...]]):
        super().__init__()
        self.peak_flops, self.hbm = peak_flops, hbm_bytes_per_s
        self.groups = groups
        # fsdp last: without HSDP its group is dp's, and FSDP's collectives are the ones worth naming.
        self.roles = {ranks: name for name, ranks in sorted(groups.items(), key=lambda item: item[0] == "fsdp")}
        self.cost = Cost()
        self.largest = (0, "")

    @contextlib.contextmanager
    def phase(self, into: Cost):
        self.cost, saved = into, self.cost
        try:
            yield
        finally:
            self.cost = saved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):  # let DTensor run its local ops, and count those
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in collective_ops:
            # Point to point, a rank receives what its neighbour sends: its sends count the traffic, as "send/recv".
            if func not in sync_ops and func not in RECEIVES:
                ranks = tuple(sorted(dist.get_process_group_ranks(CollectiveOp.get_process_group(func, args))))
                kind = _collective_kind(func.__name__)
                if func in ALL_TO_ALL:  # expert parallelism's, whose group may be FSDP's too
                    role = "ep" if ranks == self.groups.get("ep") else self.roles.get(ranks, "world")
                    moved = all_to_all_bytes(func, args, ranks.index(dist.get_rank()))
                else:
                    role = self.roles.get(ranks, "world")
                    moved = CollectiveOp.get_comm_tensor_size(func, out, args, kwargs)
                self.cost.traffic[(kind, role)] += moved
            return out
        flops = FLOPS[func._overloadpacket](*args, **kwargs, out_val=out) if func._overloadpacket in FLOPS else 0
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if outputs and not func.is_view and func._overloadpacket not in NO_TRAFFIC:
            moved = 0 if func._overloadpacket in ALLOCATIONS else sum(map(nbytes, tree_leaves((args, kwargs, out))))
            self.cost.flops += flops
            seconds = max(flops / self.peak_flops, moved / self.hbm)
            self.cost.seconds += seconds
            if func._overloadpacket in ATTENTION:
                self.cost.attention_seconds += seconds
            biggest = max(map(nbytes, outputs))
            if biggest > self.largest[0]:
                self.largest = (biggest, str(func._overloadpacket))
        return out


def total_bytes(tracker: MemTracker, which: str = "current") -> int:
    """The tracker's current or peak bytes, over all devices."""
    return sum(device["Total"] for device in tracker.get_tracker_snapshot(which).values())


class StepPeak(MemTracker):
    """MemTracker's running and peak totals without its per-module statistics, which cost a pass over every module
    at each op and refuse a module that runs more than once a step (once per micro-batch)."""

    def _pre_fw_hook(self, module, inputs) -> None:
        pass

    def _post_fw_hook(self, module, inputs, outputs) -> None:
        pass

    def _pre_bw_hook(self, module, args) -> None:
        pass

    def _post_bw_hook(self, module, args) -> None:
        pass


@contextlib.contextmanager
def unobserved_shape_propagation():
    """DTensor works out an op's output shape by running the op on global-shaped fake tensors under the active fake
    mode, where MemTracker and StepCounter would take it for this rank's work. Run that outside every mode."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagate = propagator._propagate_tensor_meta_non_cached

    def outside_modes(op_schema):
        with _disable_current_modes():
            return propagate(op_schema)

    propagator._propagate_tensor_meta_non_cached = outside_modes
    try:
        yield
    finally:
        del propagator._propagate_tensor_meta_non_cached  # the class's method again


def nbytes(t) -> int:
    """Bytes a tensor holds on this rank: a DTensor's local shard, not its global size (an op that the mode sees on
    DTensors, such as FSDP casting a TP-sharded gradient, allocates only the shard)."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def all_to_all_bytes(func, args, position: int) -> int:
    """What an all-to-all moves over the link of the rank at `position` in its group, in the busier direction (links
    are full duplex): the rows it sends to the other ranks, or those it receives from them, whichever are more.
    Without split sizes, each rank gets an even share."""
    if func is c10d.alltoall_base_.default:
        output, x, _, receive, send = args[:5]
    else:  # the functional all_to_all_single: its output's rows are the received splits
        x, receive, send = args[:3]
        output = x
    n = len(dist.get_process_group_ranks(CollectiveOp.get_process_group(func, args)))
    send = list(send) or [x.shape[0] // n] * n
    receive = list(receive) or [output.shape[0] // n] * n
    row = x[0].numel() * x.element_size() if x.shape[0] else 0
    return max(sum(send) - send[position], sum(receive) - receive[position]) * row


def _collective_kind(name: str) -> str:
    if name.startswith("send"):
        return "send/recv"
    if "all_to_all" in name or "alltoall" in name:
        return "all-to-all"
    for pattern, kind in (("gather", "all-gather"), ("scatter", "reduce-scatter"), ("reduce", "all-reduce")):
        if pattern in name:
            return kind
    return name.split(".")[0].strip("_")
