"""Activation memory planned to a budget: how each transformer block runs (keeps its activations for backward,
recomputes some or all of them, or moves them to host memory) so that the blocks' saved activations fit a budget
at the least added time.

Pure functions of measured numbers, without torch: titan/parallel/ac.py measures the options on the training
device, and `titan plan` can bring its own. The problem is a multiple-choice knapsack (one option per block, total
bytes within the budget, least total seconds), solved exactly by dynamic programming over the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan.errors import ConfigError

GIB = 2**30


@dataclass(frozen=True)
class Option:
    """One way to run a block: the bytes it keeps saved for backward and the seconds it adds to a micro-batch."""

    name: str
    saved_bytes: int
    added_seconds: float


@dataclass(frozen=True)
class BlockChoices:
    """The option each block takes, and what they keep and add together."""

    choices: tuple[str, ...]  # the option of each block, in block order
    saved_bytes: int  # all blocks together, per micro-batch
    added_seconds: float  # all blocks together, per micro-batch


def fastest_choices(blocks: list[list[Option]], budget_bytes: int) -> BlockChoices:
    """The choices of least added seconds whose saved bytes fit `budget_bytes` (among equally fast choices, the
    ones that save the fewest bytes). `blocks` holds each block's options.

    Dynamic programming over the blocks on exact byte counts, so nothing is rounded and the budget is never
    exceeded: after each block it keeps the partial choices that no other partial choices beat on both bytes and
    seconds (any completion of beaten choices is beaten by the same completion of the better ones), and drops those
    that would overflow even if every later block took its smallest option. For blocks that are alike, as a
    Llama's are, the kept choices differ only in how many blocks take each option, so there are few of them.
    """
    smallest = [min(o.saved_bytes for o in options) for options in blocks]
    if sum(smallest) > budget_bytes:
        need = gib_rounded_up(sum(smallest))
        raise ConfigError(
            f"activation_checkpoint.budget_gib = {budget_bytes / GIB:.4g} is below the {need} GiB the blocks keep for "
            f"backward even with each at its smallest option; raise it to at least {need} or lower "
            "training.local_batch_size"
        )
    frontier: list[tuple[int, float, tuple[str, ...]]] = [(0, 0.0, ())]  # (bytes, seconds, choices) so far
    later = sum(smallest)  # the least the blocks still to choose for will add
    for options, least in zip(blocks, smallest):
        later -= least
        grown = [
            (saved + o.saved_bytes, seconds + o.added_seconds, choices + (o.name,))
            for saved, seconds, choices in frontier
            for o in options
            if saved + o.saved_bytes + later <= budget_bytes
        ]
        frontier = _unbeaten(grown)
    saved, seconds, choices = frontier[-1]  # the fastest; the frontier trades bytes for seconds
    return BlockChoices(choices, saved, seconds)


def _unbeaten(partial: list[tuple[int, float, tuple[str, ...]]]) -> list[tuple[int, float, tuple[str, ...]]]:
    """The partial choices no others beat on both bytes and seconds, from the fewest bytes (and most seconds) to
    the most bytes (and fewest seconds); of those with equal seconds, the ones with the fewest bytes."""
    kept: list[tuple[int, float, tuple[str, ...]]] = []
    for candidate in sorted(partial, key=lambda p: (p[0], p[1])):
        if not kept or candidate[1] < kept[-1][1]:
            kept.append(candidate)
    return kept


def gib_rounded_up(n_bytes: int) -> str:
    """n bytes in GiB with 4 decimals, rounded up: a budget set to the figure shown holds them."""
    return f"{-(-n_bytes * 10**4 // GIB) / 10**4:.4f}"
