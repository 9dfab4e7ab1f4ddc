"""Which source serves each global sample of a run in stages ([[data.stages]]), and which of that source's own
samples: a pure function of the stages and the sample's index, so a resumed run, on any layout, reads what the
uninterrupted run read.

A stage reads its mixture with a Blend of its own, counted from the stage's first sample. The run reads each
distinct source as one stream (one shuffled order per epoch, by [seed, stream, epoch]): a stage that reads a source
an earlier stage read goes on after the samples the earlier stages took of it, so no document repeats before the
source's epoch ends. A run without [[data.stages]] is one stage, read exactly as a plain mixture.
"""

from __future__ import annotations

import bisect

import numpy as np

from titan.config import Stage
from titan.data.loader import Blend


class StagedBlend:
    """Global sample g -> (stream, the stream's own sample index), for the run's `stages` at `global_batch` rows a
    step; `streams` is the number of distinct sources (Stage.streams index them)."""

    def __init__(self, stages: list[Stage], streams: int, global_batch: int):
        self.first_samples = [stage.first_step * global_batch for stage in stages]
        self.blends = [Blend([source.weight for source in stage.sources]) for stage in stages]
        self.streams = [np.asarray(stage.streams) for stage in stages]
        # Where each stage's sources begin in their streams: after what the stages before it took.
        taken = np.zeros(streams, dtype=np.int64)
        self.begin = []
        for stage, blend, ids in zip(stages, self.blends, self.streams):
            self.begin.append(taken[ids].copy())
            np.add.at(taken, ids, blend.counts((stage.end_step - stage.first_step) * global_batch))

    def locate(self, sample: int) -> tuple[int, int]:
        """(stream, that stream's own sample index) of global sample `sample`."""
        k = bisect.bisect_right(self.first_samples, sample) - 1
        source, index = self.blends[k].locate(sample - self.first_samples[k])
        return int(self.streams[k][source]), int(self.begin[k][source]) + index
