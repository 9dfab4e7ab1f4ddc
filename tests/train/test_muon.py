"""Muon and the parameter groups, on one process: the Newton-Schulz iteration and the update against a float64
reference written here, expert stacks one expert at a time, a non-finite step left out, the groups' defaults and
refusals, the resume check of optimizer.no_decay, and a resume bitwise (the layouts: tests/parallel/test_muon.py)."""

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import DEBUG_RECIPE, ROOT, run_titan, tiny_overrides
from helpers import assert_one_line_error, straight_and_resumed
from titan.checkpoint.resume import check_math
from titan.checkpoint.train_state import model_shapes
from titan.config import Optimizer, load_config, math_values
from titan.errors import ConfigError
from titan.optim import build_optimizer, model_roles, parameter_roles
from titan.optim.muon import COEFFICIENTS, newton_schulz
from titan.train.model import resolve_model


def reference_newton_schulz(g: torch.Tensor) -> torch.Tensor:
    """The quintic iteration in float64 on one matrix, from its definition."""
    a, b, c = COEFFICIENTS
    x = g.double().T if g.shape[0] > g.shape[1] else g.double()
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


@pytest.mark.parametrize("shape", [(256, 704), (704, 256)])
def test_newton_schulz_is_the_float64_iteration_and_nearly_orthogonal(shape):
    """Measured: fp32 differs from float64 by 2.0e-6 relative (Frobenius) at most, bf16 by 2.6e-2 (its 8-bit
    mantissa over 15 matmuls); bounds ~5x and ~2x. The quintic's singular values land in [0.68, 1.13], its result
    at 0.987 cosine from U V^T."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    want = reference_newton_schulz(g)
    for dtype, bound in ((torch.float32, 1e-5), (torch.bfloat16, 5e-2)):
        got = newton_schulz(g, dtype=dtype).double()
        assert got.dtype == torch.float64 and ((got - want).norm() / want.norm()).item() < bound, dtype
    singular = torch.linalg.svdvals(want)
    assert 0.6 < singular.min() and singular.max() < 1.2
    u, _, v = torch.linalg.svd(g.double(), full_matrices=False)
    assert (want * (u @ v)).sum() / (want.norm() * (u @ v).norm()) > 0.98


class Tiny(nn.Module):
    """A matrix for Muon, an embedding and a norm for AdamW, and a stack of 3 experts."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(1)
        self.tok_embeddings = nn.Embedding(10, 8)
        self.wq = nn.Linear(8, 16, bias=False)
        self.norm = nn.RMSNorm(8)
        self.experts = nn.Module()
        self.experts.w1 = nn.Parameter(torch.randn(3, 12, 8, generator=generator))
        self.experts.expert_parallel = None  # titan/parallel/ep.py's mark of an expert stack


MUON = Optimizer(name="muon", lr=0.02, weight_decay=0.1, momentum=0.9)


def _steps(model: nn.Module, optimizer, grads: list[dict[str, torch.Tensor]]) -> None:
    for step in grads:
        for name, p in model.named_parameters():
            p.grad = step[name].clone()
        optimizer.step()


def test_a_muon_step_is_nesterov_momentum_orthogonalised_scaled_and_decayed_and_adamw_steps_the_rest():
    """Three steps against float64 arithmetic written from the definition; an expert stack is orthogonalised one
    expert at a time. Measured: 1.8e-7 of the weights' largest off the reference, about the fp32 rounding of three
    updates; bound ~5x. The AdamW parameters equal torch's fused AdamW's bitwise."""
    model = Tiny()
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    generator = torch.Generator().manual_seed(2)
    grads = [{name: torch.randn(p.shape, generator=generator) for name, p in model.named_parameters()} for _ in "abc"]
    _steps(model, build_optimizer([model], MUON), grads)

    for name in ("wq.weight", "experts.w1"):
        weight, momentum = start[name].double(), torch.zeros_like(start[name], dtype=torch.float64)
        for step in grads:
            g = step[name].double()
            momentum = MUON.momentum * momentum + g
            nesterov = (g + MUON.momentum * momentum).reshape(-1, *g.shape[-2:])
            orthogonal = torch.stack([reference_newton_schulz(m) for m in nesterov]).reshape(g.shape)
            scale = 0.2 * math.sqrt(max(g.shape[-2:]))
            weight = weight * (1 - MUON.lr * MUON.weight_decay) - MUON.lr * scale * orthogonal
        got = dict(model.named_parameters())[name].detach().double()
        assert (got - weight).abs().max() < 1e-6 * weight.abs().max(), name

    adamw = Tiny()
    adamw.load_state_dict(start)
    reference = torch.optim.AdamW(
        [{"params": [adamw.tok_embeddings.weight, adamw.norm.weight], "weight_decay": 0.0}],
        lr=MUON.lr, betas=(MUON.beta1, MUON.beta2), eps=MUON.eps, fused=True,
    )  # fmt: skip
    _steps(adamw, reference, grads)
    assert torch.equal(model.tok_embeddings.weight, adamw.tok_embeddings.weight)
    assert torch.equal(model.norm.weight, adamw.norm.weight)


def test_a_non_finite_step_leaves_weights_and_state_as_they_were():
    """As fused AdamW does with found_inf: the step's gradients hold a NaN, and nothing moves."""
    model = Tiny()
    optimizer = build_optimizer([model], MUON)
    g = torch.Generator().manual_seed(3)
    _steps(model, optimizer, [{name: torch.randn(p.shape, generator=g) for name, p in model.named_parameters()}])
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    state = {name: {k: v.clone() for k, v in optimizer.state[p].items()} for name, p in model.named_parameters()}
    optimizer.found_inf = torch.ones(())
    _steps(model, optimizer, [{name: torch.full(p.shape, math.nan) for name, p in model.named_parameters()}])
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
        assert all(torch.equal(optimizer.state[p][k], v) for k, v in state[name].items()), name


def test_the_default_groups_leave_embeddings_norms_and_routers_to_adamw_and_embeddings_and_norms_undecayed():
    config = load_config(ROOT / "recipes" / "debug_moe.toml", ["--optimizer.name", "muon"])
    model = resolve_model(config)
    roles = model_roles(model.spec, model.args, config.optimizer)
    assert not roles["tok_embeddings.weight"].muon and not roles["tok_embeddings.weight"].decay
    assert not roles["norm.weight"].muon and not roles["norm.weight"].decay
    assert not roles["output.weight"].muon and roles["output.weight"].decay
    assert not roles["layers.1.feed_forward.router.gate.weight"].muon
    assert roles["layers.1.feed_forward.experts.w1"].muon and roles["layers.0.attention.wq.weight"].decay


def test_muon_refuses_a_parameter_of_more_than_two_dims_that_is_not_an_expert_stack():
    model = Tiny()
    model.conv = nn.Parameter(torch.zeros(4, 4, 3))
    with pytest.raises(ConfigError, match=r"conv has shape \[4, 4, 3\], not a matrix nor a stack of experts"):
        parameter_roles(model, MUON)


def test_a_no_decay_pattern_that_matches_nothing_is_a_one_line_error(tmp_path):
    result = run_titan(
        "train", "--config", str(DEBUG_RECIPE), *tiny_overrides(tmp_path, **{"optimizer.no_decay": '["*nrom*"]'})
    )
    assert_one_line_error(result, "optimizer.no_decay: '*nrom*' matches no parameter", "tok_embeddings.weight")


def test_a_checkpoint_saved_before_no_decay_was_recorded_is_resumed_only_as_it_decayed_or_by_an_allowed_change():
    """Such a checkpoint decayed embeddings: the default (which does not) is a change a resume states."""
    config = load_config(DEBUG_RECIPE, [])
    current = math_values(config, 8)
    older = {k: v for k, v in current.items() if not k.startswith("optimizer.")} | {"optimizer.lr": config.optimizer.lr}
    with pytest.raises(ConfigError, match=r"optimizer.no_decay \['\*norm\*', '\*bias\*'\] -> .*allow_changes"):
        check_math(Path("step-5"), {"math": older}, current, [])
    check_math(Path("step-5"), {"math": older}, current, ["optimizer.no_decay"])  # logged, accepted
    as_before = math_values(load_config(DEBUG_RECIPE, ["--optimizer.no_decay", '["*norm*", "*bias*"]']), 8)
    check_math(Path("step-5"), {"math": older}, as_before, [])


def test_a_muon_run_resumes_bitwise(tmp_path):
    straight, resumed, weights_straight, weights_resumed = straight_and_resumed(tmp_path, {"optimizer.name": "muon"})
    assert straight == resumed
    assert all(torch.equal(weights_resumed[name], value) for name, value in weights_straight.items())


def test_titan_plan_counts_one_momentum_per_muon_parameter_and_two_moments_per_adamw_one():
    from titan.train.estimate.estimate import estimate_step

    config = load_config(DEBUG_RECIPE, ["--optimizer.name", "muon"])
    model = resolve_model(config)
    roles, shapes = model_roles(model.spec, model.args, config.optimizer), model_shapes(model.spec, model.args)
    elements = {
        muon: sum(math.prod(shapes[n]) for n, role in roles.items() if role.muon == muon) for muon in (True, False)
    }
    assert estimate_step(config, 1).ranks[0].trace.optimizer_bytes == 4 * elements[True] + 8 * elements[False]
