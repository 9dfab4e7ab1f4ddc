"""Consistent RNG end to end: every layout initialises and drops out exactly as one process does."""

import pytest
import torch

from conftest import DEBUG_RECIPE
from distributed import run_distributed
from helpers import GLOBAL_BATCH, assert_matches_one_process, full_weights, layout_overrides, with_local_batch
from titan.config import load_config
from titan.rng import Dropout
from titan.rng.shards import full_tensor
from titan.train.build import build_model
from titan.train.trainer import Trainer

INIT_LAYOUTS_2 = {"fsdp2": {"parallel.dp_shard": "2"}, "tp2": {"parallel.tp": "2"}, "pp2": {"parallel.pp": "2"}}
INIT_LAYOUTS_4 = {
    "fsdp2_tp2": {"parallel.dp_shard": "2", "parallel.tp": "2"},
    "hsdp2x2": {"parallel.dp_replicate": "2", "parallel.dp_shard": "2"},
    "pp2_fsdp2": {"parallel.pp": "2", "parallel.dp_shard": "2"},
}
DROPOUT = {"model.overrides.resid_dropout": "0.1", "model.overrides.attn_dropout": "0.1"}
DROPOUT_LAYOUTS = {
    "dp2": {"parallel.dp_shard": "2"},
    "dp2_accumulate2": {"parallel.dp_shard": "2", "training.local_batch_size": "2"},
    "tp2_sp": {"parallel.tp": "2"},
    "tp2_plain": {"parallel.tp": "2", "parallel.sequence_parallel": "false"},
    "pp2_microbatches4": {"parallel.pp": "2", "parallel.pp_microbatches": "4"},
    "dp2_weighted_1_3": {"parallel.dp_shard": "2", "parallel.dp_weights": "[1, 3]"},
}
DROPOUT_STEPS = 10


def initial_weights(tmp, layouts):
    out = {}
    for name, layout in layouts.items():
        trainer = Trainer(load_config(DEBUG_RECIPE, layout_overrides(tmp / name, layout)))
        out[name] = full_weights(trainer)
    return out


def assert_bitwise_init(per_rank, layouts, tmp):
    reference = build_model(
        load_config(DEBUG_RECIPE, layout_overrides(tmp, {"training.local_batch_size": "8"})), torch.device("cpu")
    )
    expected = dict(reference.named_parameters())
    for name in layouts:
        got = {}
        for result in per_rank:
            got.update(result[name])
        assert set(got) == set(expected), name
        for key, value in expected.items():
            assert torch.equal(got[key], value), f"{name}: {key} differs from the single-process initialisation"


@pytest.mark.distributed
def test_two_process_initialisation_is_bitwise_single_process(tmp_path):
    layouts = with_local_batch(INIT_LAYOUTS_2, 2)
    assert_bitwise_init(run_distributed(initial_weights, 2, tmp_path, layouts), layouts, tmp_path)


@pytest.mark.distributed
def test_four_process_initialisation_is_bitwise_single_process(tmp_path):
    layouts = with_local_batch(INIT_LAYOUTS_4, 4)
    assert_bitwise_init(run_distributed(initial_weights, 4, tmp_path, layouts), layouts, tmp_path)


def train_recording_masks(overrides, steps):
    """Train `steps` steps; return the losses and every dropout mask, keyed by (module, step, row)."""
    trainer = Trainer(load_config(DEBUG_RECIPE, overrides))
    masks = {}

    def record(module, args, output):
        mask = (full_tensor(output) != 0).cpu()
        for i, row in enumerate(args[1].tolist()):
            masks[(module.stream, trainer.step, row)] = mask[i]

    for module in (m for part in trainer.model_parts.parts for m in part.modules() if isinstance(m, Dropout)):
        module.register_forward_hook(record, prepend=True)  # before TP's hook turns the output local
    losses = trainer.train(until=trainer.step + steps)
    return losses, masks


def dropout_layouts(tmp, layouts):
    return {
        name: train_recording_masks(layout_overrides(tmp / name, {**DROPOUT, **layout}), DROPOUT_STEPS)
        for name, layout in layouts.items()
    }


@pytest.mark.distributed
@pytest.mark.slow
def test_dropout_masks_and_losses_match_single_process(tmp_path):
    ref_losses, ref_masks = train_recording_masks(
        layout_overrides(tmp_path / "single", {**DROPOUT, "training.local_batch_size": "8"}), DROPOUT_STEPS
    )
    streams = {key[0] for key in ref_masks}
    assert any("attention.dropout" in s for s in streams) and any("ffn_dropout" in s for s in streams)
    layouts = with_local_batch(DROPOUT_LAYOUTS, 2)
    per_rank = run_distributed(dropout_layouts, 2, tmp_path, layouts)
    for name in layouts:
        masks = {}
        for result in per_rank:
            masks.update(result[name][1])
        assert masks.keys() == ref_masks.keys(), name
        for key, mask in ref_masks.items():
            assert torch.equal(masks[key], mask), f"{name}: dropout mask of {key} differs"
        assert_matches_one_process(per_rank[0][name][0], ref_losses, name=name)


def test_dropout_is_really_on_and_differs_by_step_and_row(tmp_path):
    _, masks = train_recording_masks(layout_overrides(tmp_path, {**DROPOUT, "training.local_batch_size": "8"}), 2)
    stream = "layers.0.ffn_dropout"
    kept = torch.stack([masks[(stream, 0, r)] for r in range(GLOBAL_BATCH)]).float().mean().item()
    assert abs(kept - 0.9) < 0.02
    assert not torch.equal(masks[(stream, 0, 0)], masks[(stream, 0, 1)])
    assert not torch.equal(masks[(stream, 0, 0)], masks[(stream, 1, 0)])
    assert not torch.equal(masks[(stream, 0, 0)], masks[("layers.1.ffn_dropout", 0, 0)])


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_redraws_the_same_dropout_masks(tmp_path, mode):
    trainers = [
        Trainer(
            load_config(
                DEBUG_RECIPE,
                layout_overrides(
                    tmp_path / m, {**DROPOUT, "training.local_batch_size": "8", "activation_checkpoint.mode": m}
                ),
            )
        )
        for m in ("none", mode)
    ]
    batches = next(trainers[0].loader)
    losses = [t.stepper.forward_backward(batches, t.step) for t in trainers]
    assert torch.equal(losses[0], losses[1])
    for (name, a), (_, b) in zip(
        trainers[0].model_parts.named_parameters(), trainers[1].model_parts.named_parameters()
    ):
        assert torch.equal(a.grad, b.grad), name


@pytest.mark.slow
def test_compiled_blocks_draw_the_eager_dropout_masks(tmp_path):
    """Compiled blocks call dropout eagerly, with the masks of an uncompiled run: the gradients differ only by
    Inductor's own rounding (measured: 7.1e-7 of the largest gradient with dropout, 5.6e-7 without), while one
    other mask would move them by the activations it drops, a tenth of them."""
    trainers = [
        Trainer(load_config(DEBUG_RECIPE, layout_overrides(tmp_path / c, {**DROPOUT, "compile.enable": c})))
        for c in ("false", "true")
    ]
    batches = next(trainers[0].loader)
    eager, compiled = (t.stepper.forward_backward(batches, t.step) for t in trainers)
    assert compiled.item() == pytest.approx(eager.item(), rel=1e-6)
    for (name, a), (_, b) in zip(
        trainers[0].model_parts.named_parameters(), trainers[1].model_parts.named_parameters()
    ):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=5e-6 * a.grad.abs().max().item(), msg=name)


def plain_dtensor_random_init():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    sharded = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])
    sharded.normal_()
    return sharded.to_local().clone(), sharded.full_tensor()


@pytest.mark.distributed
def test_negative_control_plain_dtensor_random_init_differs_from_one_device():
    """Why titan/rng exists: on a CPU mesh, torch draws each shard from the rank's own
    same-seeded generator, so shards repeat each other and the tensor differs from one device's."""
    (local0, full0), (local1, _) = run_distributed(plain_dtensor_random_init, 2)
    torch.manual_seed(0)
    one_device = torch.zeros(8, 4).normal_()
    assert torch.equal(local0, local1)  # identical shards on both ranks
    assert not torch.equal(full0, one_device)
