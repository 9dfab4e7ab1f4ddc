"""`titan verify`: train a recipe's parallel layout beside its 1-process reference for a few steps and name
the first tensor where they part.

Three recorded runs, each a real trainer in its own processes (the layout's ranks as torchrun would start them):
  reference  the recipe on one process;
  floor      the recipe on one process with half the micro-batch rows (twice the gradient accumulation) and
             every module's fp32 output moved by one ulp: a known-good layout whose differences from the reference
             are rounding alone, and show on every machine what the step makes of them;
  layout     the recipe's layout.
Each rank records, step by step, the tokens it read, every module's forward output (with the global-batch
rows it holds), the gradients the optimizer receives and the parameters and Adam moments after its update;
sharded tensors are gathered to full ones. The comparison walks the steps in the order things happen (data,
forward by module, backward from the last module, optimizer) and reports the first tensor whose difference
from the reference, relative to the reference's largest magnitude, exceeds the phase's tolerance: at least
MIN_TOLERANCE for the dtype, and ten times what the floor run showed in that step and phase. Tokens and initial
parameters must be bitwise equal.

A tensor-parallel rank holds a slice of some outputs (a sequence shard, a head or column shard): its record is
compared with the matching chunk of the reference, found from the one dim whose size is the reference's / tp.
A context-parallel rank's tokens and outputs hold its positions of each row (the run plan's sequence): they are
compared with the reference's at those positions. A MoE's router is recorded as each token's weight for each expert,
its experts as each token's top_k results (under expert parallelism, computed on the experts' ranks and returned);
the experts' weights, sharded over ep, are gathered as any DTensor's.

recording.py records a run inside its processes (forked by processes.py), comparison.py compares the records
with their tolerances, runs.py starts the three runs and reports.
"""
