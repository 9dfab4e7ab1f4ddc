"""A mixture of experts trains the same on every layout: activation checkpointing of its blocks, and expert
parallelism against one process from the command line."""

from __future__ import annotations

import pytest
import torch

from titan import models
from titan.models.moe.experts import GroupedExperts
from titan.parallel.ac import FULL, SELECTIVE, apply_choice

SAVE_OPS = ["aten.mm"]


def _moe(seed: int = 0):
    """The debug MoE, shrunk, with its balance loss on, initialised on the CPU."""
    spec = models.get_model_spec("moe")
    args = models.model_args(spec, "debug", {"dim": 64, "n_layers": 3, "vocab_size": 256, "aux_loss_coef": 0.01})
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return spec, model


def _train_step(choice: str | None):
    """One forward and backward of a batch; returns the gradients and each router's counted load and loss."""
    spec, model = _moe()
    if choice is not None:
        for block in spec.blocks(model):
            apply_choice(block, choice, SAVE_OPS)
    tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    model.routing.set_loss_scale(1 / tokens.numel())
    model(tokens).float().logsumexp(-1).mean().backward()
    routers = model.routing.routers().values()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return grads, [r.load.clone() for r in routers], [r.balance_loss.clone() for r in routers]


@pytest.mark.parametrize("choice", [FULL, SELECTIVE])
def test_activation_checkpointing_counts_each_token_once_and_gives_the_same_gradients(choice):
    """The recomputation in backward routes the tokens again: it must build the balance loss's graph as the forward
    did (checkpointing checks the saved tensors), but count neither the loads nor the loss a second time."""
    grads, loads, losses = _train_step(None)
    checkpointed = _train_step(choice)
    assert all(load.sum() == 4 * 32 * 2 for load in loads)  # every token once, to top_k = 2 experts
    for want, got in zip(loads, checkpointed[1]):
        assert torch.equal(want, got)
    for want, got in zip(losses, checkpointed[2]):
        assert torch.equal(want, got)
    for name, grad in grads.items():
        torch.testing.assert_close(checkpointed[0][name], grad, rtol=0, atol=0, msg=name)


def test_compiled_experts_compute_what_eager_ones_do_in_fp32():
    """torch 2.13 traces its grouped matmul in bf16 only (its fake kernel refuses fp32, which the CPU runs): a
    compiled block runs the experts eagerly, with the same bits."""
    experts = GroupedExperts(dim=32, hidden=16, n_experts=4)
    for w in experts.parameters():
        torch.nn.init.normal_(w, generator=torch.Generator().manual_seed(0))
    x, counts = torch.randn(24, 32, generator=torch.Generator().manual_seed(1)), torch.tensor([5, 0, 12, 7])
    assert torch.equal(torch.compile(experts)(x, counts), experts(x, counts))
