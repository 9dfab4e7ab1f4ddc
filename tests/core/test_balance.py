"""The planners against brute force: rows per data-parallel rank, micro-batches, layers per stage; and every
re-plan the trainer can run."""

import itertools
import math
import random

import pytest

from titan.balance import data_shares, layer_split, micro_batch_sizes, plan_shares, runnable_counts
from titan.config import Config, Parallel, Training
from titan.run_plan import run_plan


def compositions(total: int, parts: int, least: int):
    """Every way to write `total` as `parts` ordered integers of at least `least`."""
    for cuts in itertools.combinations(range(total - parts * least + parts - 1), parts - 1):
        bounds = (-1, *cuts, total - parts * least + parts - 1)
        yield [bounds[k + 1] - bounds[k] - 1 + least for k in range(parts)]


def slowest(shares, weights) -> float:
    return max(r / w for r, w in zip(shares, weights))


@pytest.mark.parametrize("seed", range(40))
def test_data_shares_minimise_the_slowest_rank_as_brute_force_does(seed):
    rng = random.Random(seed)
    ranks, least = rng.randint(1, 4), rng.randint(0, 2)
    rows = rng.randint(ranks * least, 14)
    most = rng.choice([None, rng.randint(max(least, math.ceil(rows / ranks)), 14)])
    weights = [rng.choice([0.5, 1.0, 1.5, 2.0, 3.0, rng.uniform(0.2, 4)]) for _ in range(ranks)]
    shares = data_shares(rows, weights, least, most)
    assert sum(shares) == rows and min(shares) >= least and max(shares) <= (most or rows)
    best = min(slowest(c, weights) for c in compositions(rows, ranks, least) if max(c) <= (most or rows))
    assert slowest(shares, weights) == pytest.approx(best, rel=1e-12)


def test_data_shares_in_proportion_and_even_when_weights_are():
    assert data_shares(8, [1, 3]) == [2, 6]
    assert data_shares(8, [1, 1, 1, 1]) == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="at least 2"):
        data_shares(3, [1, 1], min_rows=2)


def test_micro_batches_are_as_many_on_every_rank_and_within_the_cap():
    sizes = micro_batch_sizes([2, 6], cap=4)
    assert sizes == [[1, 1], [3, 3]]
    for shares, cap in (([5, 11, 3], 4), ([8, 8], 8), ([7, 9], 3)):
        sizes = micro_batch_sizes(shares, cap)
        assert len({len(s) for s in sizes}) == 1 and all(max(s) <= cap for s in sizes)
        assert [sum(s) for s in sizes] == shares and all(max(s) - min(s) <= 1 for s in sizes)
    with pytest.raises(ValueError, match=r"\[1, 9\] rows cannot be cut into the same number of micro-batches"):
        micro_batch_sizes([1, 9], cap=3)
    assert micro_batch_sizes([4, 8], cap=4, pipeline=2) == [[2, 2], [4, 4]]  # equal, a multiple of 2 rows
    with pytest.raises(ValueError, match="a multiple of 2 rows"):
        micro_batch_sizes([4, 6], cap=4, pipeline=2)  # 6 rows are 3 micro-batches of 2, 4 rows not


@pytest.mark.parametrize("seed", range(60))
def test_plan_shares_is_the_fastest_runnable_plan_as_brute_force_finds(seed):
    """Among every composition of the rows that some count of micro-batches runs: the smallest max(rows / speed),
    and of those the fewest micro-batches; and no plan exactly when no composition runs."""
    rng = random.Random(seed)
    ranks, cap, pipeline = rng.randint(1, 4), rng.randint(1, 5), rng.choice([0, 0, 2, 3])
    rows = rng.randint(ranks, 16)
    weights = [rng.choice([1.0, 1 / 3, 0.5, rng.uniform(1 / 8, 1)]) for _ in range(ranks)]
    runnable = [c for c in compositions(rows, ranks, 1) if runnable_counts(c, cap, pipeline)]
    if not runnable:
        with pytest.raises(ValueError, match="cannot be cut into the same number of micro-batches"):
            plan_shares(rows, weights, cap, pipeline)
        return
    shares = plan_shares(rows, weights, cap, pipeline)
    best = min(slowest(c, weights) for c in runnable)
    assert slowest(shares, weights) == pytest.approx(best, rel=1e-12)
    fewest = min(runnable_counts(c, cap, pipeline)[0] for c in runnable if slowest(c, weights) <= best * (1 + 1e-12))
    assert runnable_counts(shares, cap, pipeline)[0] == fewest


def test_at_one_row_per_micro_batch_no_rows_move_and_at_two_some_do():
    """The issue's case: 16 rows on 2 ranks, the second at 0.45 of the first's speed. The speeds ask for 11 and
    5 rows, which no count of one-row micro-batches runs on both ranks."""
    assert data_shares(16, [1.0, 0.45]) == [11, 5]
    assert micro_batch_sizes(plan_shares(16, [1.0, 0.45], cap=1), cap=1) == [[1] * 8, [1] * 8]
    assert micro_batch_sizes(plan_shares(16, [1.0, 0.45], cap=2), cap=2) == [[2] * 5, [2, 1, 1, 1, 1]]  # 10, 6
    assert micro_batch_sizes(plan_shares(16, [1.0, 0.45], cap=8), cap=8) == [[6, 5], [3, 2]]  # 11, 5


def test_every_replan_runs_at_any_scale_micro_batch_and_speeds():
    """Property test: random data-parallel sizes 2-128, global batches 8-4,096, local batches 1-8, speeds from 1
    to 8x slower, with and without pipelines. Whenever the recipe runs at all (its even plan), the plan for any
    speeds is one the trainer runs: run_plan, through which apply_plan re-plans, returns it, and it holds
    every rank's rows in as many micro-batches of 1 to local_batch_size rows (under a pipeline, equal ones of a
    multiple of the schedule's micro-batches)."""
    rng = random.Random(0)
    checked = 0
    for _ in range(1500):
        dp, pipeline = round(2 ** rng.uniform(1, 7)), rng.choice([0, 0, 2, 4])
        local, global_batch = rng.randint(max(1, pipeline), 8), rng.randint(8, 4096)
        if pipeline:
            global_batch = max(8, global_batch // (pipeline * dp) * pipeline * dp)
        p = Parallel(dp_shard=dp, pp=2 if pipeline else 1, pp_microbatches=pipeline)
        t = Training(local_batch_size=local, global_batch_size=global_batch)
        config, world = Config(training=t, parallel=p), dp * p.pp
        slow = rng.choice(["one", "some", "all"])
        weights = [1.0] * dp
        for i in rng.sample(range(dp), {"one": 1, "some": max(1, dp // 4), "all": dp}[slow]):
            weights[i] = 1 / rng.uniform(1, 8)
        try:
            run_plan(config, world)
        except ValueError:  # the recipe is refused before training; so is every other plan
            with pytest.raises(ValueError):
                run_plan(config, world, dp_weights=weights)
            continue
        plan = run_plan(config, world, dp_weights=weights).micro_batches
        checked += 1
        assert sum(map(sum, plan)) == t.global_batch_size and len(plan) == dp
        assert len({len(sizes) for sizes in plan}) == 1  # FSDP's collectives in step on every rank
        assert all(1 <= size <= t.local_batch_size for sizes in plan for size in sizes)
        if pipeline:
            assert all(len(set(sizes)) == 1 and sizes[0] % pipeline == 0 for sizes in plan)
        shares = [sum(sizes) for sizes in plan]
        assert plan_shares(t.global_batch_size, weights, t.local_batch_size, pipeline) == shares
        # Never slower than the even plan: a re-plan only helps.
        even = [sum(sizes) for sizes in run_plan(config, world).micro_batches]
        assert slowest(shares, weights) <= slowest(even, weights) * (1 + 1e-12)
    assert checked >= 1000


def stage_time(counts, costs, speeds):
    bounds = [0, *itertools.accumulate(counts)]
    return max(sum(costs[bounds[s] : bounds[s + 1]]) / speeds[s] for s in range(len(counts)))


def stage_memory_fits(counts, memory, caps):
    bounds = [0, *itertools.accumulate(counts)]
    return all(sum(memory[bounds[s] : bounds[s + 1]]) <= caps[s] for s in range(len(counts)))


@pytest.mark.parametrize("seed", range(60))
def test_layer_split_minimises_the_slowest_stage_as_brute_force_does(seed):
    rng = random.Random(seed)
    stages = rng.randint(1, 4)
    layers = rng.randint(stages, 9)
    costs = [rng.choice([1.0, 1.0, 2.0, rng.uniform(0.5, 3)]) for _ in range(layers)]
    speeds = [rng.choice([1.0, 2.0, rng.uniform(0.3, 3)]) for _ in range(stages)]
    memory = [rng.uniform(0.5, 2) for _ in range(layers)]
    caps = [rng.uniform(1, 8) for _ in range(stages)] if rng.random() < 0.6 else [math.inf] * stages
    feasible = [c for c in compositions(layers, stages, 1) if stage_memory_fits(c, memory, caps)]
    if not feasible:
        with pytest.raises(ValueError, match="memory caps"):
            layer_split(costs, speeds, memory, caps)
        return
    counts = layer_split(costs, speeds, memory, caps)
    assert sum(counts) == layers and min(counts) >= 1 and stage_memory_fits(counts, memory, caps)
    best = min(stage_time(c, costs, speeds) for c in feasible)
    assert stage_time(counts, costs, speeds) == pytest.approx(best, rel=1e-9)


def test_the_recipe_s_stage_speeds_choose_the_pipeline_split():
    from titan.config import Parallel
    from titan.run_plan import stage_layers

    assert stage_layers(4, Parallel(pp=2, pp_stage_speeds=[1.0, 3.0])) == [[0], [1, 2, 3]]
    assert stage_layers(8, Parallel(pp=2, pp_schedule="Interleaved1F1B", pp_stage_speeds=[1, 1, 3, 3])) == [
        [0],
        [1],
        [2, 3, 4],
        [5, 6, 7],
    ]


def test_memory_caps_bound_the_recipe_s_split():
    from titan.config import Parallel
    from titan.errors import ConfigError
    from titan.run_plan import stage_layers

    fast_but_small = Parallel(pp=2, pp_stage_speeds=[1.0, 3.0], pp_stage_memory_gib=[4.0, 2.0])
    assert stage_layers(4, fast_but_small, layer_gib=[1.0] * 4) == [[0, 1], [2, 3]]  # the fast stage holds only 2
    with pytest.raises(ConfigError, match="no split of the 4 layers"):
        stage_layers(4, Parallel(pp=2, pp_stage_speeds=[1.0, 1.0], pp_stage_memory_gib=[1.0, 1.0]), layer_gib=[1.0] * 4)


@pytest.mark.parametrize("seed", range(30))
def test_memory_caps_alone_bound_an_even_split_as_brute_force_does(seed):
    """pp_stage_memory_gib without pp_stage_speeds: the fewest layers on the busiest stage among the splits
    within the caps, for layers of different sizes (a MoE's dense and routed blocks)."""
    from titan.config import Parallel
    from titan.errors import ConfigError
    from titan.run_plan import stage_layers

    rng = random.Random(seed)
    stages = rng.randint(2, 4)
    layers = rng.randint(stages, 9)
    layer_gib = [rng.uniform(0.5, 2) for _ in range(layers)]
    caps = [rng.uniform(1, 8) for _ in range(stages)]
    parallel = Parallel(pp=stages, pp_schedule="1F1B", pp_stage_memory_gib=caps)
    feasible = [c for c in compositions(layers, stages, 1) if stage_memory_fits(c, layer_gib, caps)]
    if not feasible:
        with pytest.raises(ConfigError, match="no split"):
            stage_layers(layers, parallel, layer_gib)
        return
    counts = [len(ids) for ids in stage_layers(layers, parallel, layer_gib)]
    assert sum(counts) == layers and min(counts) >= 1 and stage_memory_fits(counts, layer_gib, caps)
    assert max(counts) == min(max(c) for c in feasible)


def test_layer_split_gives_a_faster_stage_more_layers():
    assert layer_split([1.0] * 4, [1.0, 1.0]) == [2, 2]
    assert layer_split([1.0] * 4, [1.0, 3.0]) == [1, 3]
    assert layer_split([1.0] * 4, [1.0, 3.0], [1.0] * 4, [4.0, 2.0]) == [2, 2]  # the fast stage holds only 2
