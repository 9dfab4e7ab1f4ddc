"""Layout-independent random numbers: every value titan draws is a pure function of (seed, stream name, global
element index, counter).

Why not torch's generators: they are stateful per rank, so sharded init and dropout depend on the parallel layout.
On a CPU mesh DTensor has no RNG tracker, so each rank draws its local shard from its own same-seeded generator:
the shards repeat each other and the full tensor differs from one process's. On CUDA the offset-based tracker
keeps shards distinct but moves each shard's offset by its position and local size, so the values still depend
on the layout (thread-to-element mapping, non-contiguous Shard(d > 0) shards, uneven shards). Here each element's
value comes from its global index through a counter-based generator, so a shard is bitwise the slice of the
tensor one process draws, on any mesh, and nothing (no offset, no generator state) is carried between calls,
pipeline stages or activation-checkpoint recomputation.

Modules, by concern:
    philox  Philox4x32-10 in torch integer ops, the stream key, the distributions (normal, truncated normal,
            dropout's keep mask);
    native  the same words and exact steps in C for CPU tensors (compiled on first use; bitwise the same values);
    shards  the global index of every element of a local shard (DTensor placements, uneven and strided shards);
    fills   in-place weight init (:func:`normal_`, :func:`trunc_normal_`), :class:`Dropout` and the step its masks
            are keyed by (:func:`dropout_step`).
"""

from titan.rng.fills import Dropout, dropout_step, normal_, trunc_normal_
from titan.rng.shards import dtensor_global_indices

__all__ = ["Dropout", "dropout_step", "dtensor_global_indices", "normal_", "trunc_normal_"]
