"""Pipeline schedules for `titan plan`: torch's own table of each rank's actions, what it implies for memory
(micro-batches in flight) and traffic (sends between ranks), and a replay of it with each stage's times."""

from __future__ import annotations

from torch import nn
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from titan.config import Config
from titan.parallel import pp
from titan.run_plan import RunPlan
from titan.train.estimate.trace import CPU


def schedule_actions(config: Config, plan: RunPlan, mesh, microbatches: int) -> dict[int, list]:
    """Every pipeline rank's actions in order (forward, backward, ... of a stage and micro-batch), from the schedule
    class the trainer builds."""
    stages = [(s, nn.Identity()) for s in plan.stages(0)]
    no_io = [None] * len(stages)  # the table needs no shapes
    schedule = pp.build_schedule(
        config.parallel, stages, no_io, plan.n_stages, microbatches, lambda *_: None, CPU, mesh["pp"].get_group()
    )
    # Overlapped pairs (DualPipeV's forward of one micro-batch with a backward of another) count as their parts.
    order = {
        rank: [part for a in actions if a is not None for part in a.sub_actions or [a]]
        for rank, actions in schedule.pipeline_order.items()
    }
    if not isinstance(schedule, PipelineScheduleMulti):
        # torch 2.13's 1F1B table numbers the last rank's forwards from 1 (its runtime does not read the table).
        # A single stage per rank takes the micro-batches in order: number them so.
        for actions in order.values():
            seen: dict[str, int] = {}
            for i, a in enumerate(actions):
                kind = a.computation_type.value
                actions[i] = a._replace(microbatch_index=seen.setdefault(kind, 0))
                seen[kind] += 1
    return order


def schedule_peak(actions: list, held: dict[int, int], first_peak: int, steady_peak: int) -> tuple[int, int, int]:
    """(peak bytes, bytes of activations then held, micro-batches then held) over the rank's actions. The trace
    measured the peak of a micro-batch's forward and backward with it alone in flight: `first_peak` before any
    gradient existed, `steady_peak` after. A backward's peak comes on top of everything its rank then holds: a
    forward adds its stage's activations, a full backward or a weight-gradient pass (zero-bubble schedules)
    releases them."""
    one_each = sum(held.values())  # the trace ran one micro-batch through each stage
    live = count = 0
    best, backward_done = (0, 0, 0), False
    for action in actions:
        kind, stage = action.computation_type.value, action.stage_index
        if kind == "F":
            live, count = live + held[stage], count + 1
        if kind in ("B", "I"):
            base = steady_peak if backward_done else first_peak
            best, backward_done = max(best, (base + live - one_each, live, count)), True
        if kind in ("B", "W"):
            live, count = live - held[stage], count - 1
    return best


def sends(order: dict[int, list], pp_rank: int) -> int:
    """Activations and gradients the pipeline rank sends to other ranks per step."""
    rank_of = {a.stage_index: r for r, actions in order.items() for a in actions}
    count = 0
    for action in order[pp_rank]:
        kind, stage = action.computation_type.value, action.stage_index
        peer = stage + 1 if kind == "F" else stage - 1 if kind in ("B", "I") else None
        count += peer in rank_of and rank_of[peer] != pp_rank
    return count


def replay(order: dict[int, list], forward: dict[int, float], backward: dict[int, float], hop: float) -> float:
    """When the last pipeline action ends, each rank running its actions in order, each as soon as its input is
    there (plus a hop when it comes from another rank). A zero-bubble schedule's input- and weight-gradient
    passes take half a backward each; communication and bookkeeping actions take no time here."""
    rank_of = {a.stage_index: r for r, actions in order.items() for a in actions}
    last = max(rank_of)
    done: dict[tuple[str, int, int], float] = {}  # (F or B, stage, micro-batch) -> when it ended
    clock, position = dict.fromkeys(order, 0.0), dict.fromkeys(order, 0)
    while any(position[r] < len(order[r]) for r in order):
        progressed = False
        for r, actions in order.items():
            while position[r] < len(actions):
                a = actions[position[r]]
                kind, stage = a.computation_type.value, a.stage_index
                if kind in ("F", "B", "I", "W"):
                    need = _needs(kind, stage, a.microbatch_index, last)
                    if need is not None and need not in done:
                        break  # its input is not there yet: another rank moves first
                    ready = 0.0 if need is None else done[need] + (hop if rank_of[need[1]] != r else 0.0)
                    seconds = {"F": forward[stage], "B": backward[stage]}.get(kind, backward[stage] / 2)
                    clock[r] = max(clock[r], ready) + seconds
                    done[("F" if kind == "F" else "B", stage, a.microbatch_index)] = clock[r]
                position[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule replay is stuck")  # torch's tables are complete: never
    return max(clock.values())


def _needs(kind: str, stage: int, micro_batch: int, last: int) -> tuple[str, int, int] | None:
    """The action an action waits for: a forward for the previous stage's, a backward (or input-gradient pass) for
    the next stage's backward or, on the last stage, its own forward; a weight-gradient pass for its own input-
    gradient pass."""
    if kind == "F":
        return ("F", stage - 1, micro_batch) if stage > 0 else None
    if kind == "W" or stage == last:
        return ("B" if kind == "W" else "F", stage, micro_batch)
    return ("B", stage + 1, micro_batch)
