"""Activation memory planned to a budget (titan/parallel/ac_choices.py, titan/parallel/ac.py): the planner is
exact, a mix of ways to run the blocks changes no number, the bytes counted are those autograd keeps, and a planned
run keeps within its budget at the slowdown it predicts."""

import itertools
import math
import random
import statistics
import time

import pytest
import torch

from conftest import DEBUG_RECIPE, tiny_overrides
from distributed import run_distributed
from helpers import SMALL, layout_overrides, trainer_for
from titan.config import Layout, load_config
from titan.errors import ConfigError
from titan.parallel import ac, ac_choices, parallelize
from titan.parallel.ac_choices import GIB, Option, fastest_choices, gib_rounded_up
from titan.train.device import device_memory
from titan.train.model import resolve_model
from titan.train.trainer import Trainer

# The tests' small model (helpers.SMALL) with four blocks and dropout on the attention probabilities too.
FOUR_BLOCKS = {"model.overrides.n_layers": "4", "model.overrides.attn_dropout": "0.1", "checkpoint.enable": "false"}


# -- the planner


def random_blocks(rng: random.Random, n: int) -> list[list[Option]]:
    """n blocks, each with keep (nothing added) and one to three ways that keep no more for some added time.
    Times are multiples of 0.5, so that sums are exact and ties between choices are common."""
    blocks = []
    for _ in range(n):
        keep = rng.randint(1000, 100_000)
        others = [Option(f"way{k}", rng.randint(0, keep), 0.5 * rng.randint(1, 12)) for k in range(rng.randint(1, 3))]
        blocks.append([Option("keep", keep, 0.0), *others])
    return blocks


def best_by_trying_every_combination(blocks: list[list[Option]], budget: int) -> tuple[float, int]:
    """(added seconds, saved bytes) of the fastest choices within the budget, the fewest bytes among equally fast."""
    fitting = []
    for combination in itertools.product(*blocks):
        saved, seconds = sum(o.saved_bytes for o in combination), sum(o.added_seconds for o in combination)
        if saved <= budget:
            fitting.append((seconds, saved))
    return min(fitting)


def test_the_planner_finds_the_best_choices_that_trying_every_combination_finds():
    rng = random.Random(0)
    for n in range(1, 8):
        for _ in range(4):
            blocks = random_blocks(rng, n)
            least = sum(min(o.saved_bytes for o in options) for options in blocks)
            most = sum(options[0].saved_bytes for options in blocks)
            slowest = math.inf
            for budget in sorted({least, least + (most - least) // 3, (least + most) // 2, most - 1, most}):
                best = fastest_choices(blocks, budget)
                assert (best.added_seconds, best.saved_bytes) == best_by_trying_every_combination(blocks, budget)
                chosen = [next(o for o in options if o.name == c) for options, c in zip(blocks, best.choices)]
                assert best.saved_bytes == sum(o.saved_bytes for o in chosen) <= budget
                assert best.added_seconds == sum(o.added_seconds for o in chosen) <= slowest  # more budget: no slower
                slowest = best.added_seconds
            assert fastest_choices(blocks, 10**15).choices == ("keep",) * n  # no budget to speak of: nothing recomputed


def test_a_budget_no_choices_meet_names_the_least_that_does():
    blocks = random_blocks(random.Random(1), 5)
    least = sum(min(o.saved_bytes for o in options) for options in blocks)
    with pytest.raises(ConfigError, match=f"activation_checkpoint.budget_gib .* at least {gib_rounded_up(least)} "):
        fastest_choices(blocks, least - 1)
    shown = fastest_choices(blocks, int(float(gib_rounded_up(least)) * GIB))
    assert shown.saved_bytes >= least  # the figure shown fits


def test_choosing_for_405b_sized_blocks_keeps_fewer_partial_choices_than_blocks(monkeypatch):
    # 126 alike blocks with four ways each (4^126 combinations): the kept partial choices stay few, as they differ
    # only in their counts, so the choice takes milliseconds.
    ways = [Option("keep", 40 << 20, 0.0), Option("selective", 20 << 20, 0.05), Option("full", 2 << 20, 0.06),
            Option("offload", 1 << 20, 0.03)]  # fmt: skip
    kept, unbeaten = [], ac_choices._unbeaten
    monkeypatch.setattr(ac_choices, "_unbeaten", lambda partial: kept.append(unbeaten(partial)) or kept[-1])
    chosen = fastest_choices([ways] * 126, 126 * (20 << 20))
    assert len(kept) == 126 and max(map(len, kept)) < 126
    assert chosen.saved_bytes <= 126 * (20 << 20) and set(chosen.choices) == {"keep", "offload"}


@pytest.mark.parametrize(
    "overrides,words",
    [
        ({"activation_checkpoint.budget_gib": "-1"}, "activation_checkpoint.budget_gib must be"),
        ({"activation_checkpoint.budget_gib": "nan"}, "activation_checkpoint.budget_gib must be"),
        ({"activation_checkpoint.every": "0"}, "activation_checkpoint.every must be >= 1"),
        ({"activation_checkpoint.mode": "auto", "activation_checkpoint.budget_gib": "1", "compile.enable": "true"},
         "compile.enable"),
    ],
)  # fmt: skip
def test_recipe_mistakes_name_the_key(overrides, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        load_config(DEBUG_RECIPE, [item for k, v in overrides.items() for item in (f"--{k}", v)], world_size=2)


# -- applying the choices


def stack_inputs(trainer, batch):
    """The trainer's blocks and what its model gives the first one for this batch: (blocks, hidden states as a
    leaf, the other arguments)."""
    model = trainer.model_parts.parts[0]
    blocks = trainer.model.spec.blocks(model)
    inputs = []
    hook = blocks[0].register_forward_pre_hook(lambda module, args: inputs.append(args))
    with torch.no_grad():
        model(batch.inputs, batch.rows, batch.document_ids)
    hook.remove()
    x, *rest = inputs[0]
    return blocks, x.detach().requires_grad_(), rest


def run_blocks(blocks, x, rest):
    out = x.clone()  # not a leaf, like the embedding's output: it stays only if the first block keeps it
    for block in blocks:
        out = block(out, *rest)
    return out


def kept_by_blocks(trainer, batch) -> int:
    """Device bytes the trainer's blocks (as their choices wrapped them) keep for backward on a real batch."""
    blocks, x, rest = stack_inputs(trainer, batch)
    with ac.Allocations(trainer.device) as allocations:
        out = run_blocks(blocks, x, rest)
    return allocations.live_bytes(besides=out)


def saved_by_hooks(trainer, batch) -> int:
    """Bytes of the distinct storages autograd saves in the blocks' forward, as saved_tensors_hooks see them, but
    for the model's parameters and buffers and the inputs all blocks share (RoPE's rotations): those are there
    whatever the blocks keep. Without checkpointing, that is all the blocks keep."""
    blocks, x, rest = stack_inputs(trainer, batch)
    model = trainer.model_parts.parts[0]
    shared = [*model.parameters(), *model.buffers(), *(t for t in rest if isinstance(t, torch.Tensor))]
    there_anyway = {t.untyped_storage().data_ptr() for t in shared}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in there_anyway:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_blocks(blocks, x, rest)
    return sum(saved.values())


def test_measured_bytes_are_what_autograd_keeps_and_a_cpu_is_never_offered_offload(tmp_path):
    plain = trainer_for(tmp_path / "plain", **FOUR_BLOCKS)
    full = trainer_for(tmp_path / "full", **FOUR_BLOCKS, **{"activation_checkpoint.mode": "full"})
    with torch.device("meta"):
        model = plain.model.spec.build(plain.model.args)
    options = {o.name: o for o in ac.measure_options(model, plain.model.spec, plain.config, Layout(), 4, plain.device)}
    assert list(options) == ["keep", "selective", "full"]  # no offload on a CPU: host memory is its memory
    assert options["full"].saved_bytes < options["selective"].saved_bytes < options["keep"].saved_bytes
    batch = next(plain.loader)[0]
    hidden_state = 4 * 32 * 64 * 4  # rows x seq x dim, fp32: all a fully recomputed block keeps
    assert options["full"].saved_bytes == hidden_state and kept_by_blocks(full, batch) == 4 * hidden_state
    # The one block of one document per row that was measured keeps what each block keeps on real batches.
    assert saved_by_hooks(plain, batch) == kept_by_blocks(plain, batch) == 4 * options["keep"].saved_bytes


MIXES = [
    ("keep", "selective", "full", "offload"),  # offload by hand: the planner never offers it on a CPU
    ("offload", "full", "keep", "selective"),
    ("full",) * 4,
]


@pytest.mark.parametrize("choices", MIXES, ids="-".join)
def test_any_mix_of_ways_gives_bitwise_the_losses_and_gradients_of_no_checkpointing(tmp_path, monkeypatch, choices):
    plain = trainer_for(tmp_path / "plain", **FOUR_BLOCKS)
    monkeypatch.setattr(parallelize, "block_choices", lambda *args: list(choices))
    mixed = trainer_for(tmp_path / "mixed", **FOUR_BLOCKS)
    # Full checkpointing and offload hook the block; selective wraps its forward (titan.parallel.ac.apply_choice).
    blocks = mixed.model.spec.blocks(mixed.model_parts.parts[0])
    wrapped = [bool(block._forward_pre_hooks) or "forward" in vars(block) for block in blocks]
    assert wrapped == [c != "keep" for c in choices]
    batches = next(plain.loader)
    for step in range(2):  # dropout masks change with the step
        assert torch.equal(
            plain.stepper.forward_backward(batches, plain.step), mixed.stepper.forward_backward(batches, mixed.step)
        ), step
        for (name, a), (_, b) in zip(plain.model_parts.named_parameters(), mixed.model_parts.named_parameters()):
            assert torch.equal(a.grad, b.grad), (step, name)
        plain.step = mixed.step = step + 1


def test_a_budget_below_what_the_blocks_need_stops_at_start_up(tmp_path):
    need = gib_rounded_up(4 * 4 * 32 * 64 * 4)  # every block fully recomputed, keeping only its input
    with pytest.raises(ConfigError, match=f"below the {need} GiB .* at least {need} or lower"):
        trainer_for(tmp_path, **FOUR_BLOCKS, **{"activation_checkpoint.mode": "auto",
                                               "activation_checkpoint.budget_gib": "1e-6"})  # fmt: skip


@pytest.mark.slow
def test_budget_0_is_what_the_device_leaves_as_titan_plan_works_it_out(tmp_path):
    """budget_gib = 0: `titan train` gives the trainer the budget that `titan plan` shows for a device of the
    same memory (one function decides both)."""
    from titan.train.estimate.estimate import estimate_step, with_activation_budget

    auto = {**FOUR_BLOCKS, "activation_checkpoint.mode": "auto"}
    config = load_config(DEBUG_RECIPE, layout_overrides(tmp_path, auto), world_size=1)
    device_bytes = 3 * 2**30
    resolved = with_activation_budget(config, 1, device_bytes)
    on_such_a_device = load_config(
        DEBUG_RECIPE, layout_overrides(tmp_path, {**auto, "plan.memory_gib": "3"}), world_size=1
    )
    (rank,) = estimate_step(on_such_a_device, 1).ranks
    assert resolved.activation_checkpoint.budget_gib * GIB == pytest.approx(rank.budget, abs=1)
    assert 0 < rank.budget < device_bytes
    with pytest.raises(ConfigError, match="budget_gib = 0: the step needs more than"):
        with_activation_budget(config, 1, 2**20)


def test_a_trainer_built_without_the_cli_gets_the_budget_the_device_leaves(tmp_path, capsys):
    """budget_gib = 0 is resolved in the trainer's pre-flight, which `titan train` builds too, so a program that
    builds its own Trainer gets the budget `titan train` gets, says so, and the recipe the run records holds it."""
    from titan.train.estimate.estimate import with_activation_budget

    auto = {**FOUR_BLOCKS, "activation_checkpoint.mode": "auto"}
    trainer = trainer_for(tmp_path, **auto)
    assert "activation_checkpoint.budget_gib = 0: the blocks may keep" in capsys.readouterr().err
    config = load_config(DEBUG_RECIPE, tiny_overrides(tmp_path, **{**SMALL, **auto}), world_size=1)
    resolved = with_activation_budget(config, 1, device_memory(torch.device("cpu")))
    budget = resolved.activation_checkpoint.budget_gib
    assert budget > 0 and trainer.config == resolved
    assert f"budget_gib = {budget!r}" in (trainer.run_dir / "config.toml").read_text()


# -- a planned run


def planned_run(tmp_path, monkeypatch, steps: int):
    """A 4-block run planned to half of what its blocks keep, beside the same run without checkpointing; runs
    `steps` steps of each in pairs and returns (the choices, the median CPU seconds auto's steps took over plain's)."""
    # This machine is shared, and its load makes wall times swing tenfold within seconds. A process's CPU time on
    # one thread does not swing with it, and on a machine of its own is its wall time: the profile and the steps
    # below are both timed that way.
    monkeypatch.setattr(ac, "perf_counter", time.process_time)
    # Even CPU time drifts with the neighbours' load over seconds: the planner's 2 s of measurement caught a slow
    # spell in a full suite run (predicted 0.0169 s, where alone it predicts and measures 0.0075 to 0.0087 s), so
    # the planner measures here for about as long as the 100 steps of the benchmark take.
    monkeypatch.setattr(ac, "MEASURE_SECONDS", 8.0 if steps >= 100 else 1.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain = trainer_for(tmp_path / "plain", **FOUR_BLOCKS)
        batches = next(plain.loader)
        budget = kept_by_blocks(plain, batches[0]) // 2  # half of what the blocks keep without checkpointing
        chosen_sets = []

        def recorded_choices(*args):
            chosen_sets.append(fastest_choices(*args))
            return chosen_sets[-1]

        monkeypatch.setattr(ac, "fastest_choices", recorded_choices)
        planned = {"activation_checkpoint.mode": "auto", "activation_checkpoint.budget_gib": str(budget / GIB)}
        auto = trainer_for(tmp_path / "auto", **FOUR_BLOCKS, **planned)
        (chosen,) = chosen_sets
        assert chosen.saved_bytes <= budget and "keep" in chosen.choices and set(chosen.choices) != {"keep"}
        assert kept_by_blocks(auto, batches[0]) == chosen.saved_bytes  # measured on the real blocks and batch
        assert torch.equal(
            plain.stepper.forward_backward(batches, plain.step), auto.stepper.forward_backward(batches, auto.step)
        )  # the math is the same
        slowdowns = []
        for _ in range(steps):  # steps in pairs, so that both sides of a difference meet the same machine
            start = time.process_time()
            plain.stepper(batches, plain.step)
            middle = time.process_time()
            auto.stepper(batches, auto.step)
            slowdowns.append((time.process_time() - middle) - (middle - start))
    finally:
        torch.set_num_threads(threads)
    return chosen, statistics.median(slowdowns)


@pytest.mark.slow
def test_a_planned_run_keeps_within_its_budget_and_computes_the_same(tmp_path, monkeypatch):
    planned_run(tmp_path, monkeypatch, steps=2)  # the choices fit, keep the bytes chosen, and change no number


@pytest.mark.benchmark
def test_a_planned_run_slows_down_as_predicted(tmp_path, monkeypatch):
    """A timing, so a benchmark: run it on a quiet machine (`python -m pytest -m benchmark`). On the CI's 2-core
    AMD EPYC host, at 8fe8ebd as now, the measured slowdown came out 20-27% above the prediction in 2 of 3 runs
    (e.g. 5.9 ms measured, 4.7 ms predicted), where earlier hosts met the bound; why is not known yet."""
    chosen, measured = planned_run(tmp_path, monkeypatch, steps=100)
    assert abs(measured - chosen.added_seconds) <= 0.2 * chosen.added_seconds, (measured, chosen)


def fsdp_losses(tmp, extra: dict) -> list[float]:
    overrides = layout_overrides(tmp, {"parallel.dp_shard": "2", "training.local_batch_size": "4", **extra})
    trainer = Trainer(load_config(DEBUG_RECIPE, overrides))
    return trainer.train(until=trainer.step + 3)


def planned_and_plain_fsdp(tmp, budget_gib: float):
    """On each of two FSDP ranks: the choices, how often this rank measured a block, and the losses of 3 steps with
    the choices and without checkpointing."""
    measured, chosen_sets = [], []
    measure, choose = ac.measure_options, ac.fastest_choices  # recorded in this worker process only

    def recorded_measure(*args):
        measured.append(args)
        return measure(*args)

    def recorded_choices(*args):
        chosen_sets.append(choose(*args))
        return chosen_sets[-1]

    ac.measure_options, ac.fastest_choices = recorded_measure, recorded_choices
    planned = {"activation_checkpoint.mode": "auto", "activation_checkpoint.budget_gib": str(budget_gib)}
    losses = fsdp_losses(tmp / "auto", planned), fsdp_losses(tmp / "plain", {})
    return chosen_sets, len(measured), *losses


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_ranks_choose_from_rank_0s_measurement_and_train_as_without_checkpointing(tmp_path):
    config = load_config(DEBUG_RECIPE, layout_overrides(tmp_path, {"training.local_batch_size": "4"}))
    resolved = resolve_model(config)
    spec, args = resolved.spec, resolved.args
    with torch.device("meta"):
        model = spec.build(args)
    keep = ac.measure_options(model, spec, config, Layout(), 4, torch.device("cpu"))[0].saved_bytes
    results = run_distributed(planned_and_plain_fsdp, 2, tmp_path, 2 * keep / GIB)  # 2 of the 4 blocks' worth
    (chosen_0, measured_0, planned_0, plain_0), (chosen_1, measured_1, planned_1, plain_1) = results
    assert (measured_0, measured_1) == (1, 0)  # rank 0 measured, rank 1 received its numbers
    assert chosen_0 == chosen_1 and len(chosen_0) == 1 and set(chosen_0[0].choices) != {"keep"}
    assert planned_0 == planned_1 == plain_0 == plain_1  # bitwise: checkpointing changes no number


def planned_and_plain_pipeline(tmp, budget_gib: float):
    """On each of two pipeline ranks (one stage each, 2 blocks): the choices, how often this rank measured a block,
    and the losses of 3 steps with the choices and without checkpointing."""
    measured, chosen_sets = [], []
    measure, choose = ac.measure_options, ac.fastest_choices

    def recorded_measure(*args):
        measured.append(args[4])  # the rows measured: one pipeline micro-batch's
        return measure(*args)

    def recorded_choices(*args):
        chosen_sets.append(choose(*args))
        return chosen_sets[-1]

    ac.measure_options, ac.fastest_choices = recorded_measure, recorded_choices
    layout = {"parallel.pp": "2", "training.local_batch_size": "8", "parallel.pp_microbatches": "4"}
    planned = {"activation_checkpoint.mode": "auto", "activation_checkpoint.budget_gib": str(budget_gib)}
    losses = []
    for name, extra in (("auto", planned), ("plain", {})):
        trainer = Trainer(load_config(DEBUG_RECIPE, layout_overrides(tmp / name, {**layout, **extra})))
        losses.append(trainer.train(until=trainer.step + 3))
    return chosen_sets, measured, *losses


@pytest.mark.distributed
@pytest.mark.slow
def test_pipeline_ranks_plan_per_micro_batch_and_train_as_without_checkpointing(tmp_path):
    """Under a pipeline the budget is per micro-batch (a rank holds several at once): the block is measured at one
    pipeline micro-batch (8 rows in 4 micro-batches: 2), and the choices change no number."""
    config = load_config(DEBUG_RECIPE, layout_overrides(tmp_path, {"training.local_batch_size": "8"}))
    resolved = resolve_model(config)
    spec, args = resolved.spec, resolved.args
    with torch.device("meta"):
        model = spec.build(args)
    keep = ac.measure_options(model, spec, config, Layout(), 2, torch.device("cpu"))[0].saved_bytes
    results = run_distributed(planned_and_plain_pipeline, 2, tmp_path, 1.5 * keep / GIB)  # 1.5 of a stage's 2 blocks
    (chosen_0, measured_0, planned_0, plain_0), (chosen_1, measured_1, planned_1, plain_1) = results
    assert (measured_0, measured_1) == ([2], [])  # rank 0 measured a 2-row micro-batch, rank 1 received its numbers
    (chosen,) = chosen_0
    assert chosen_1 == [chosen] and "keep" in chosen.choices and set(chosen.choices) != {"keep"}
    assert planned_0 == planned_1 == plain_0 == plain_1  # bitwise: checkpointing changes no number
