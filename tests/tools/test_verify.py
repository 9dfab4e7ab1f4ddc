"""`titan verify`: the comparison's rules on hand-made records, then real runs from the command line: it passes
on correct layouts and, on layouts broken on purpose, names the module and step where they first depart."""

import dataclasses
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from conftest import DEBUG_RECIPE, ROOT, run_titan, scenarios_beyond, tiny_overrides
from helpers import LATENT_ATTENTION, TINY_MODEL
from titan.launcher import first_failure
from titan.models.moe import FLAVORS
from titan.models.moe.model import MoE
from titan.models.moe.routing import Routing
from titan.tools.verify.comparison import PHASES, Records, assemble, compare
from titan.tools.verify.recording import Recorder, add_rounding_noise


def whole(t):
    return t.reshape(-1), None, tuple(t.shape)


def records(forward, grads, updated, init=None, tokens=None, tp=1, tp_rank=0):
    """One rank's records: forward [(step, module, rows, output)], grads/updated {step: {name: tensor}}."""
    pieces = lambda tensors: {name: whole(t) for name, t in tensors.items()}  # noqa: E731
    return {
        "tp": tp,
        "tp_rank": tp_rank,
        "tokens": tokens or [],
        "forward": forward,
        "grads": {step: pieces(g) for step, g in grads.items()},
        "updated": {step: pieces(u) for step, u in updated.items()},
        "init": pieces(init or {"a.weight": torch.zeros(2), "b.weight": torch.zeros(2)}),
    }


ROWS = torch.arange(2)
NO_FLOOR = {(0, phase): 0.0 for phase in PHASES}  # one step's floor per phase


def one_step(a_out, b_out, a_grad, b_grad, **kw):
    return records(
        [(0, "a", ROWS, a_out), (0, "b", ROWS, b_out)],
        {0: {"a.weight": a_grad, "b.weight": b_grad}},
        {0: {"a.weight": torch.ones(2), "b.weight": torch.ones(2)}},
        **kw,
    )


def test_the_first_difference_follows_the_order_of_computation():
    x, g = torch.ones(2, 3), torch.ones(2)
    ref = Records([one_step(x, x, g, g)])
    # Both gradients are wrong: backward runs from the last module, so b's is the first.
    lines, ok = compare(ref, NO_FLOOR, Records([one_step(x, x, 2 * g, 3 * g)]), "fp32")
    assert not ok and "step 0, backward, gradient of b.weight" in lines[-1]
    # A forward difference comes before any gradient.
    lines, ok = compare(ref, NO_FLOOR, Records([one_step(x, x + 1, 2 * g, g)]), "fp32")
    assert not ok and "step 0, forward, output of b on rank 0:" in lines[-1]
    # Differences within tolerance pass, and the largest is shown.
    lines, ok = compare(ref, NO_FLOOR, Records([one_step(x, x * (1 + 2**-20), g, g)]), "fp32")
    assert ok and any("forward" in line and "9.54e-07" in line and " b on rank 0" in line for line in lines)


def test_the_floor_raises_the_tolerance_and_a_broken_floor_is_reported():
    x, g = torch.ones(2, 3), torch.ones(2)
    ref = Records([one_step(x, x, g, g)])
    layout = Records([one_step(x, x, g * (1 + 5e-5), g)])
    assert not compare(ref, NO_FLOOR, layout, "fp32")[1]
    assert compare(ref, {**NO_FLOOR, (0, "backward"): 1e-5}, layout, "fp32")[1]  # tolerance 10 x floor = 1e-4
    lines, ok = compare(ref, {**NO_FLOOR, (0, "backward"): 0.5}, layout, "fp32")
    assert not ok and "the reference itself depends on how the batch is split" in lines[-1]


def test_the_floor_run_moves_each_output_one_ulp_and_leaves_gradients_and_the_rng_alone():
    torch.manual_seed(0)
    linear, x = torch.nn.Linear(8, 8), torch.randn(16, 8, requires_grad=True)
    clean = linear(x)
    (clean_grad,) = torch.autograd.grad(clean.sum(), x)
    add_rounding_noise(SimpleNamespace(parts=[torch.nn.Sequential(linear)]))
    rng = torch.get_rng_state()
    noisy = linear(x)
    assert torch.equal(torch.get_rng_state(), rng)  # dropout's masks stay the reference's
    up, down = torch.nextafter(clean, clean + 1), torch.nextafter(clean, clean - 1)
    assert ((noisy == up) | (noisy == down)).all() and (noisy == up).any() and (noisy == down).any()
    assert torch.equal(torch.autograd.grad(noisy.sum(), x)[0], clean_grad)  # the nudge is a constant


def test_initial_parameters_and_tokens_must_be_bitwise_equal():
    x, g = torch.ones(2, 3), torch.ones(2)
    ref = Records([one_step(x, x, g, g, tokens=[(0, ROWS, torch.zeros(2, 4, dtype=torch.long))])])
    init = {"a.weight": torch.zeros(2), "b.weight": torch.tensor([0.0, 1e-12])}
    lines, ok = compare(ref, NO_FLOOR, Records([one_step(x, x, g, g, init=init)]), "fp32")
    assert not ok and "initial parameters differ first at b.weight" in lines[-1]
    other_tokens = [(0, torch.tensor([1]), torch.zeros(1, 4, dtype=torch.long) + 7)]
    lines, ok = compare(ref, NO_FLOOR, Records([one_step(x, x, g, g, tokens=other_tokens)]), "fp32")
    assert not ok and "step 0 data differ first at tokens of global row 1" in lines[-1]


def test_a_tensor_parallel_rank_is_compared_with_its_chunk_and_rows_with_theirs():
    full = torch.arange(2 * 4 * 6, dtype=torch.float32).view(2, 4, 6)  # (rows, sequence, hidden)
    ref = Records([one_step(full, full, torch.ones(2), torch.ones(2))])
    seq_shard = full[1:, 2:]  # global row 1, second sequence half (tp rank 1 of 2)
    hidden_shard = full[1:, :, :3]  # global row 1, first hidden half (tp rank 0 of 2)
    for output, tp_rank in ((seq_shard, 1), (hidden_shard, 0)):
        rank = records(
            [(0, "a", torch.tensor([1]), output), (0, "b", torch.tensor([1]), output)],
            {0: {"a.weight": torch.ones(2), "b.weight": torch.ones(2)}},
            {0: {"a.weight": torch.ones(2), "b.weight": torch.ones(2)}},
            tp=2,
            tp_rank=tp_rank,
        )
        assert compare(ref, NO_FLOOR, Records([rank]), "fp32")[1]
        rank["tp_rank"] = 1 - tp_rank  # the other rank's chunk
        assert not compare(ref, NO_FLOOR, Records([rank]), "fp32")[1]


def test_a_context_parallel_rank_is_compared_at_its_positions():
    full = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 3)  # (rows, sequence, hidden)
    tokens = torch.arange(16).view(2, 8)
    ref = Records([one_step(full, full, torch.ones(2), torch.ones(2), tokens=[(0, ROWS, tokens)])])
    here = torch.tensor([2, 3, 4, 5])  # cp rank 1 of 2: chunks 1 and 2 of 4
    mine = full[:, here]
    rank = one_step(mine, mine, torch.ones(2), torch.ones(2), tokens=[(0, ROWS, tokens[:, here])])
    assert compare(ref, NO_FLOOR, Records([{**rank, "positions": here}]), "fp32")[1]
    lines, ok = compare(ref, NO_FLOOR, Records([{**rank, "positions": torch.tensor([0, 1, 6, 7])}]), "fp32")
    assert not ok and "tokens of global row 0" in lines[-1]


def test_sharded_pieces_assemble_into_the_full_tensor_and_a_gap_is_an_error():
    full = torch.arange(12.0).view(3, 4)
    flat = full.reshape(-1)
    # Two ranks' shards, as (values, flat indices, shape): rows 0-1 and row 2 (an uneven Shard(0)).
    pieces = [(flat[:8], torch.arange(8), (3, 4)), (flat[8:], torch.arange(8, 12), (3, 4))]
    assert torch.equal(assemble(pieces, "w"), full)
    with pytest.raises(Exception, match="cover 8 of its 12 elements"):
        assemble(pieces[:1], "w")


def test_a_moe_is_recorded_per_token_whichever_rows_a_rank_holds():
    """The MoE's modules take the rows' tokens flattened, the router returns a tuple and the experts' pairs come sorted
    by expert: each is recorded per (row, position), so a rank's half of the batch matches the whole batch's rows."""
    args = dataclasses.replace(FLAVORS["debug"], dim=32, n_experts=4, expert_hidden_dim=16, n_shared_experts=1)
    moe = MoE(args, Routing(torch.nn.Module(), 0.0))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(0))
    part = torch.nn.ModuleDict({"moe": moe})
    part.forward = lambda x, rows: moe(x)
    model_parts = SimpleNamespace(parts=[part], named_parameters=part.named_parameters)
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1))

    def recorded(*halves):
        recorder = Recorder(model_parts, torch.optim.SGD(moe.parameters()))
        for rows in halves:
            part(x[rows], rows)
        return records(recorder.forward, {}, {})

    whole = Records([recorded(torch.arange(4))])
    for _, module, rows, output in recorded(torch.arange(2), torch.arange(2, 4))["forward"]:
        assert torch.allclose(output, whole.rows(0, module, rows), atol=1e-6), module
    assert whole.rows(0, "moe.router", ROWS).shape == (2, 8, 4)  # each token's weight for each expert
    assert whole.rows(0, "moe.experts", ROWS).shape == (2, 8, 2, 32)  # each token's top_k results


def test_a_module_a_forward_calls_twice_is_recorded_per_call():
    """As a multi-token prediction calls the shared head again: each call is compared with the same call of the
    reference, whichever rows a rank holds (the last call alone was kept, and the first compared with it)."""
    head = torch.nn.Linear(6, 6)
    part = torch.nn.ModuleDict({"head": head})
    part.forward = lambda x, rows: head(head(x).tanh())
    model_parts = SimpleNamespace(parts=[part], named_parameters=part.named_parameters)
    x = torch.randn(4, 3, 6, generator=torch.Generator().manual_seed(1))

    def recorded(*halves):
        recorder = Recorder(model_parts, torch.optim.SGD(head.parameters()))
        for rows in halves:
            part(x[rows], rows)
        return records(recorder.forward, {}, {})

    whole = Records([recorded(torch.arange(4))])
    assert list(whole.forward) == [(0, "head"), (0, "head (call 2)")]
    assert torch.allclose(whole.rows(0, "head (call 2)", torch.arange(4)), head(head(x).tanh()), atol=1e-6)
    for _, module, rows, output in recorded(torch.arange(2), torch.arange(2, 4))["forward"]:
        assert torch.allclose(output, whole.rows(0, module, rows), atol=1e-6), module


# ---------------------------------------------------------------------------------------------------------------
# From the command line
# ---------------------------------------------------------------------------------------------------------------

# Dropout on residuals and attention probabilities: its masks are compared on every layout too.
RECIPE = {
    **TINY_MODEL,
    "model.overrides.resid_dropout": "0.1",
    "model.overrides.attn_dropout": "0.1",
    "training.seq_len": "32",
    "training.global_batch_size": "4",
    "training.local_batch_size": "2",  # one process: 2 micro-batches (the floor run: 4); FSDP2: 1 per rank
}
# Broken on purpose through sitecustomize, which the processes' server imports: in the layout's processes only, as
# the one-process runs use neither FSDP nor the rows' order.
BREAKS = {
    "fsdp_averages": (
        "from torch.distributed.fsdp import FSDPModule\n"
        "FSDPModule.set_gradient_divide_factor = lambda self, factor: None  # FSDP's default: the mean\n"
    ),
    "dropout_by_local_row": (
        "import torch\n"
        "from titan.rng import fills\n"
        "forward = fills.Dropout.forward\n"
        "def by_local_row(self, x, rows):\n"
        "    several = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1\n"
        "    return forward(self, x, torch.arange(len(rows)) if several else rows)\n"
        "fills.Dropout.forward = by_local_row\n"
    ),
    # Each rank's ring leaves out one block below the diagonal: the first pair it would attend whole.
    "ring_drops_a_block": (
        "from titan.parallel import cp\n"
        "plan = cp.ContextParallel.mask\n"
        "def dropped(self, ids):\n"
        "    pairs = dict(plan(self, ids).pairs)\n"
        "    del pairs[min(ab for ab in pairs if ab[0] != ab[1])]\n"
        "    return cp.RingMask(pairs)\n"
        "cp.ContextParallel.mask = dropped\n"
    ),
    # Expert parallelism's rank 1 returns the first pairs of its first two experts with tokens each the other's result,
    # so the combine weighs them with the wrong expert's output.
    "ep_swaps_two_experts": (
        "import torch\n"
        "from titan.parallel import ep\n"
        "call = ep.ExpertParallel.__call__\n"
        "def swapped(self, compute, x, counts, *weights):\n"
        "    out = call(self, compute, x, counts, *weights)\n"
        "    if torch.distributed.get_rank(self.group) != 1:\n"
        "        return out\n"
        "    a, b = (counts.cumsum(0) - counts)[counts > 0][:2].tolist()\n"
        "    order = torch.arange(len(out))\n"
        "    order[a], order[b] = b, a\n"
        "    return out[order]\n"
        "ep.ExpertParallel.__call__ = swapped\n"
    ),
    # The clipping norm of each rank's own shards, not summed over the ranks: each rank clips by its own factor.
    "norm_of_local_shards": (
        "from titan import optim\n"
        "whole = optim._sum_of_squares\n"
        "def local(grads):\n"
        "    return whole([g.to_local() if hasattr(g, 'to_local') else g for g in grads])\n"
        "optim._sum_of_squares = local\n"
    ),
    # A user's error on rank 1 alone: rank 0 waits in the step's first collective, for rank 1.
    "rank_1_fails": (
        "import torch.distributed as dist\n"
        "from titan.errors import ConfigError\n"
        "from titan.train import trainer\n"
        "train = trainer.Trainer.train\n"
        "def failing(self, *args, **kwargs):\n"
        "    if dist.is_initialized() and dist.get_rank() == 1:\n"
        "        raise ConfigError('planted on rank 1')\n"
        "    return train(self, *args, **kwargs)\n"
        "trainer.Trainer.train = failing\n"
    ),
}


@pytest.fixture(scope="module")
def verify_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("verify")


def verify(folder, layout: dict, break_name: str | None = None, recipe=DEBUG_RECIPE, settings=RECIPE):
    env = {"OMP_NUM_THREADS": "1"}
    if break_name:
        site = folder / break_name
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(BREAKS[break_name])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    overrides = tiny_overrides(folder, **settings, **layout)
    # Forked as the other runs are: the broken code is for the server that verify starts for its runs.
    return run_titan(
        "verify", "--config", str(recipe), *overrides, "--steps", "2", "--reuse-reference", env=env, fresh=False
    )


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    # FSDP2 x TP2 and PP2 in the default run (the broken layouts below are FSDP2's and CP2's); the rest scenarios.
    scenarios_beyond(
        [{"parallel.pp": "2"}, {"parallel.dp_shard": "2", "parallel.tp": "2"}],
        [
            {"parallel.dp_shard": "2"},
            {"parallel.tp": "2"},
            {"parallel.pp": "2"},
            {"parallel.dp_shard": "2", "parallel.tp": "2"},
            {"parallel.cp": "2"},
        ],
    ),
    ids=["fsdp2", "tp2", "pp2", "fsdp2_tp2", "cp2"],
)
def test_verify_passes_on_correct_layouts(verify_folder, layout):
    result = verify(verify_folder, layout)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "equivalent: every tensor within tolerance" in result.stdout
    assert "bitwise equal" in result.stdout


# The debug recipe's model, 2 of its layers, clipping at every step.
CLIPPING = {
    "training.seq_len": "64",
    "model.overrides.n_layers": "2",
    "training.max_grad_norm": "0.25",
    "training.global_batch_size": "8",
    "training.local_batch_size": "8",
}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "layout", scenarios_beyond(["parallel.tp"], ["parallel.dp_shard", "parallel.tp", "parallel.pp"])
)
def test_verify_passes_on_the_debug_model_with_clipping_active(tmp_path_factory, layout):
    """The debug recipe's own model (2 of its layers) clips every step. Its attention's output projections have
    gradients near zero that Adam's first update divides by eps, so their weights move by up to 1e-4 of their
    magnitude with rounding alone: the floor run, its modules' outputs moved by one ulp, shows as much on every CPU
    (splitting the micro-batch alone left them bitwise equal on an Intel host, and TP2 failed there)."""
    folder = tmp_path_factory.getbasetemp() / "verify_debug_model"
    folder.mkdir(exist_ok=True)
    result = verify(folder, {layout: "2"}, settings=CLIPPING)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "equivalent: every tensor within tolerance" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[1:2] in ([p] for p in PHASES)]
    assert len(rows) == 2 * len(PHASES) and all(float(row[4]) > 0 for row in rows), result.stdout  # the floors


@pytest.mark.distributed
@pytest.mark.slow
def test_verify_catches_a_clipping_norm_that_leaves_out_the_other_ranks_shards(tmp_path_factory):
    """Clipping is where a layout's norm acts: a norm of each rank's own shards scales each rank's gradients by its
    own factor, and the first gradient backward computes departs."""
    folder = tmp_path_factory.getbasetemp() / "verify_debug_model"
    folder.mkdir(exist_ok=True)
    result = verify(folder, {"parallel.tp": "2"}, "norm_of_local_shards", settings=CLIPPING)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert "step 0, backward, gradient of output.weight:" in result.stdout.splitlines()[-1], result.stdout


@pytest.mark.distributed
@pytest.mark.slow
def test_verify_passes_on_qwen3_under_tp_with_its_qk_norms_split_by_head(tmp_path_factory):
    """Qwen3's q and k norms are whole on each tp rank and applied to its heads: their gradients are shares the step
    sums over tp. Before the decoder's plan marked them, k_norm's gradient was 0.66 of its magnitude off."""
    folder = tmp_path_factory.getbasetemp() / "verify_qwen3"
    folder.mkdir(exist_ok=True)
    overrides = {"model.name": "qwen3", "model.flavor": "debug", "model.overrides.n_layers": "2"}
    overrides |= {"training.seq_len": "64", "training.global_batch_size": "8", "training.local_batch_size": "8"}
    args = tiny_overrides(folder, **overrides, **{"parallel.tp": "2"})
    result = run_titan("verify", "--config", str(DEBUG_RECIPE), *args, "--steps", "2", "--reuse-reference")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "equivalent: every tensor within tolerance" in result.stdout


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "break_name,first",
    [
        # Every gradient is halved; the output head's is the first backward computes.
        ("fsdp_averages", "step 0, backward, gradient of output.weight"),
        # The first dropout in the forward is the attention probabilities' of the first block.
        ("dropout_by_local_row", "step 0, forward, output of layers.0.attention.dropout on rank 1"),
    ],
)
def test_verify_names_where_a_broken_layout_departs(verify_folder, break_name, first):
    result = verify(verify_folder, {"parallel.dp_shard": "2"}, break_name)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert first in result.stdout.splitlines()[-1], result.stdout


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_s_error_ends_the_layout_run_and_is_reported_in_one_line(verify_folder):
    """The other rank, waiting for it in a collective, is stopped as torchrun stops a failed rank's peers."""
    result = verify(verify_folder, {"parallel.dp_shard": "2"}, "rank_1_fails")
    assert result.returncode == 2, result.stdout + result.stderr[-3000:]
    assert "the layout-dp_shard2 run failed (error: planted on rank 1); see " in result.stderr
    assert "Traceback" not in result.stderr


def test_a_rank_s_status_lost_by_the_forkserver_is_read_from_the_rank_s_own_file(tmp_path):
    """multiprocessing reads 255 where its forkserver lost a status, which happens under load (CPython issue
    140867): a rank writes the status it ends with, and a rank killed before writing one keeps the signal's."""
    ranks = [SimpleNamespace(exitcode=255), SimpleNamespace(exitcode=None)]
    (tmp_path / "0").write_text("0")
    assert first_failure(ranks, str(tmp_path)) == 0
    (tmp_path / "0").write_text("2")
    assert first_failure(ranks, str(tmp_path)) == 2
    (tmp_path / "0").write_text("0")
    ranks[1].exitcode = -9
    assert first_failure(ranks, str(tmp_path)) == -9


@pytest.mark.distributed
@pytest.mark.slow
def test_verify_catches_a_context_parallel_ring_that_drops_a_block(verify_folder):
    """The ring's output feeds the attention's output projection: the first module whose output departs."""
    result = verify(verify_folder, {"parallel.cp": "2"}, "ring_drops_a_block")
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert "step 0, forward, output of layers.0.attention.wo on rank 0" in result.stdout.splitlines()[-1], result.stdout


# The debug MoE's first two layers (the second routes), its experts split over 2 ranks: 8 rows of 32 tokens in one
# micro-batch on one process (the floor: 2), 4 rows on each rank.
MOE_RECIPE = ROOT / "recipes" / "debug_moe.toml"
MOE = {
    "model.overrides.n_layers": "2",
    "training.seq_len": "32",
    "training.global_batch_size": "8",
    "training.local_batch_size": "8",
}
EP2 = {"parallel.ep": "2"}


@pytest.mark.distributed
@pytest.mark.slow
def test_verify_passes_on_expert_parallelism(verify_folder):
    """The experts' weights, gradients and moments gathered from their ep shards; the router's and the experts'
    outputs per token."""
    result = verify(verify_folder, EP2, recipe=MOE_RECIPE, settings=MOE)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "layout dp_shard2-ep2 (2 processes)" in result.stdout
    assert "equivalent: every tensor within tolerance" in result.stdout


@pytest.mark.distributed
@pytest.mark.slow
def test_verify_names_the_experts_when_the_dispatch_returns_results_to_the_wrong_pairs(verify_folder):
    """The experts' output on the rank whose results were swapped is the first tensor that departs, before the MoE
    combines them."""
    result = verify(verify_folder, EP2, "ep_swaps_two_experts", recipe=MOE_RECIPE, settings=MOE)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    last = result.stdout.splitlines()[-1]
    assert "step 0, forward, output of layers.1.feed_forward.experts on rank 1:" in last, result.stdout


# DeepSeek's latent attention in the debug MoE's first layer (dense) alone, 8 rows in one micro-batch (the
# floor: 2). Before the floor nudged every output by an ulp, its split in two missed how Adam's first update
# magnifies the rounding of near-zero gradients, and TP2 failed at step 0 (wo.weight, 4.2e-4 against 8.3e-5).
LATENT = {
    **LATENT_ATTENTION,
    "model.overrides.n_layers": "1",
    "training.seq_len": "32",
    "training.global_batch_size": "8",
    "training.local_batch_size": "8",
}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "layout", scenarios_beyond([], [{"parallel.tp": "2"}, {"parallel.cp": "2"}]), ids=["tp2", "cp2"]
)
def test_verify_passes_on_latent_attention(tmp_path_factory, layout):
    """TP2: its heads split, its latent projections and norms whole on each rank with their gradients each rank's
    heads' share, summed over tp (without that sum, the clipped gradients depart at step 0, 1.2e-4 against 6.6e-5).
    CP2: the ring with values narrower than keys."""
    folder = tmp_path_factory.getbasetemp() / "verify_latent_attention"
    folder.mkdir(exist_ok=True)
    result = verify(folder, layout, recipe=MOE_RECIPE, settings=LATENT)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "equivalent: every tensor within tolerance" in result.stdout


def test_verify_of_one_process_or_packed_documents_is_a_clear_error(tmp_path):
    for extra, message in (
        ({}, "nothing to verify"),
        ({"parallel.dp_shard": "2", "data.batching": "tokens"}, "verify with data.batching = 'rows'"),
    ):
        result = run_titan("verify", "--config", str(DEBUG_RECIPE), *tiny_overrides(tmp_path, **extra))
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    shutil.rmtree(tmp_path, ignore_errors=True)


# DeepSeek-V3's form (latent attention, sigmoid routing in groups, a shared expert) in its first two layers, the
# second routing: each tp rank routes its share of the sequence, the experts split over the ep group of its tp index.
DEEPSEEK = {**MOE, "model.flavor": "deepseek_v3_debug", "training.local_batch_size": "4"}


@pytest.mark.distributed
@pytest.mark.slow
def test_verify_passes_on_deepseek_v3_under_ep2_tp2(verify_folder):
    """The routers' and experts' outputs compared per token under tp, each rank's share of every row's positions
    against that chunk of the reference's."""
    result = verify(verify_folder, {"parallel.ep": "2", "parallel.tp": "2"}, recipe=MOE_RECIPE, settings=DEEPSEEK)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "layout dp_shard2-tp2-ep2 (4 processes)" in result.stdout
    assert "equivalent: every tensor within tolerance" in result.stdout


@pytest.mark.distributed
@pytest.mark.scenario
def test_verify_passes_with_muon_under_tp2(tmp_path):
    """Muon on TP2: its sharded orthogonalisation's updates and momentum buffers, tensor by tensor, against one
    process's (a folder of its own: the reference reused by the others trains with AdamW)."""
    result = verify(tmp_path, {"parallel.tp": "2", "optimizer.name": "muon"})
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "equivalent: every tensor within tolerance" in result.stdout
