"""The planners against brute force: rows per data-parallel rank, micro-batches, layers per stage."""

import itertools
import math
import random

import pytest

from titan.parallel.balance import data_shares, layer_split, micro_batch_sizes


def compositions(total: int, parts: int, least: int):
    """Every way to write `total` as `parts` ordered integers of at least `least`."""
    for cuts in itertools.combinations(range(total - parts * least + parts - 1), parts - 1):
        bounds = (-1, *cuts, total - parts * least + parts - 1)
        yield [bounds[k + 1] - bounds[k] - 1 + least for k in range(parts)]


@pytest.mark.parametrize("seed", range(40))
def test_data_shares_minimise_the_slowest_rank_as_brute_force_does(seed):
    rng = random.Random(seed)
    ranks, least = rng.randint(1, 4), rng.randint(0, 2)
    rows = rng.randint(ranks * least, 14)
    weights = [rng.choice([0.5, 1.0, 1.5, 2.0, 3.0, rng.uniform(0.2, 4)]) for _ in range(ranks)]
    shares = data_shares(rows, weights, least)
    assert sum(shares) == rows and min(shares) >= least
    best = min(max(r / w for r, w in zip(c, weights)) for c in compositions(rows, ranks, least))
    assert max(r / w for r, w in zip(shares, weights)) == pytest.approx(best, rel=1e-12)


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
    with pytest.raises(ValueError, match="only 1 rows"):
        micro_batch_sizes([1, 9], cap=3)


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
    from titan.parallel.pp import stage_layers

    assert stage_layers(4, Parallel(pp=2, pp_stage_speeds=[1.0, 3.0])) == [[0], [1, 2, 3]]
    assert stage_layers(8, Parallel(pp=2, pp_schedule="Interleaved1F1B", pp_stage_speeds=[1, 1, 3, 3])) == [
        [0],
        [1],
        [2, 3, 4],
        [5, 6, 7],
    ]


def test_memory_caps_bound_the_recipe_s_split():
    from titan.config import ConfigError, Parallel
    from titan.parallel.pp import stage_layers

    fast_but_small = Parallel(pp=2, pp_stage_speeds=[1.0, 3.0], pp_stage_memory_gib=[4.0, 2.0])
    assert stage_layers(4, fast_but_small, layer_gib=1.0) == [[0, 1], [2, 3]]  # the fast stage holds only 2
    with pytest.raises(ConfigError, match="no split of the 4 layers"):
        stage_layers(4, Parallel(pp=2, pp_stage_speeds=[1.0, 1.0], pp_stage_memory_gib=[1.0, 1.0]), layer_gib=1.0)


@pytest.mark.parametrize("seed", range(30))
def test_memory_caps_alone_bound_an_even_split_as_brute_force_does(seed):
    """pp_stage_memory_gib without pp_stage_speeds: the fewest layers on the busiest stage among the splits
    within the caps."""
    from titan.config import ConfigError, Parallel
    from titan.parallel.pp import stage_layers

    rng = random.Random(seed)
    stages = rng.randint(2, 4)
    layers, layer_gib = rng.randint(stages, 9), rng.uniform(0.5, 2)
    caps = [rng.uniform(1, 8) for _ in range(stages)]
    parallel = Parallel(pp=stages, pp_schedule="1F1B", pp_stage_memory_gib=caps)
    feasible = [c for c in compositions(layers, stages, 1) if stage_memory_fits(c, [layer_gib] * layers, caps)]
    if not feasible:
        with pytest.raises(ConfigError, match="no split"):
            stage_layers(layers, parallel, layer_gib)
        return
    counts = [len(ids) for ids in stage_layers(layers, parallel, layer_gib)]
    assert sum(counts) == layers and min(counts) >= 1 and stage_memory_fits(counts, [layer_gib] * layers, caps)
    assert max(counts) == min(max(c) for c in feasible)


def test_layer_split_gives_a_faster_stage_more_layers():
    assert layer_split([1.0] * 4, [1.0, 1.0]) == [2, 2]
    assert layer_split([1.0] * 4, [1.0, 3.0]) == [1, 3]
    assert layer_split([1.0] * 4, [1.0, 3.0], [1.0] * 4, [4.0, 2.0]) == [2, 2]  # the fast stage holds only 2
