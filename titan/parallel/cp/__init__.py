"""Context parallelism: each sequence split across the ranks of a cp group, attention run as a ring.

Each row is cut into 2·cp equal chunks and cp rank i holds chunks i and 2·cp-1-i (RunPlan.sequence), so that
under a causal mask every rank has as many query-key pairs to compute. Attention is a ring over the group
(ring.py), its work planned per pair of chunks (masks.py), each pair run on a block kernel (blocks.py).

torch's context-parallel API (`torch.distributed.tensor.experimental.context_parallel`) is not used, on any backend;
the ring shares only its CUDA kernels. Its SDPA ring takes no mask (no documents, no dropout of titan's) and
dispatches only CUDA's kernels; where it applies, it computes what this ring computes, with the same kernels and the
same head-and-tail chunks (its load balancer's), so a second ring would only add a path the CPU tests cannot run.
Its flex-attention path takes document masks, but by all-gathering every rank's keys and values at each layer: the
whole sequence's keys and values on every rank, which the ring exists to avoid. So one ring serves every backend,
masks, dropout and tensor parallelism included, and only the block kernel depends on the device.
"""

from titan.parallel.cp.blocks import BlockAttention, BlockKernel
from titan.parallel.cp.masks import PairKind, PairMask, RingMask, document_runs
from titan.parallel.cp.ring import ContextParallel, all_reduce_gradients, apply_context_parallel, ring_hop

__all__ = [
    "BlockAttention",
    "BlockKernel",
    "ContextParallel",
    "PairKind",
    "PairMask",
    "RingMask",
    "all_reduce_gradients",
    "apply_context_parallel",
    "document_runs",
    "ring_hop",
]
