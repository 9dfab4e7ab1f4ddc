"""`titan plan --graph`: one block's traced forward-and-backward graph, its peak, reorderings and static layouts."""

import dataclasses
import itertools
import json

import pytest
import torch
from torch import fx

from conftest import DEBUG_RECIPE, run_titan, scenarios_beyond
from titan import models
from titan.models.decoder.rope import rope_table
from titan.models.llama.flavors import FLAVORS
from titan.models.llama.model import llama_block
from titan.train.estimate.graph import (
    PLACEMENTS,
    analyse,
    layout,
    lifetimes,
    memory_aware_orders,
    ops,
    reorder,
    storages,
    trace_block,
)
from titan.train.model import ResolvedModel

ROWS, SEQ = 2, 32
SPEC = models.get_model_spec("llama3")
ARGS = dataclasses.replace(FLAVORS["debug"], n_layers=1, resid_dropout=0.1)


@pytest.fixture(scope="module")
def block_graph():
    return trace_block(ResolvedModel(SPEC, ARGS), ROWS, SEQ)


def _eager_block_step():
    """One block's output and gradients in eager mode (the C dropout kernels, not the traced torch ops)."""
    torch.manual_seed(0)
    block = llama_block(0, ARGS)
    # Named as the traced block is: the first of a model.
    block.attention_dropout.stream, block.ffn_dropout.stream = "layers.0.attention_dropout", "layers.0.ffn_dropout"
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.05)
    x = torch.randn(ROWS, SEQ, ARGS.dim, requires_grad=True)
    rope, rows = rope_table(ARGS)[:SEQ].unsqueeze(0), torch.arange(ROWS)
    grad_out = torch.randn(ROWS, SEQ, ARGS.dim)
    out = block(x, rope, rows, None)
    params = list(block.parameters())
    grads = torch.autograd.grad(out, [*params, x], grad_out)
    primals = [p.detach() for p in params] + [x.detach(), rope, rows]
    return primals, grad_out, out.detach(), grads


def _valid_order(order: list[fx.Node], graph_ops: list[fx.Node]) -> bool:
    position = {n: i for i, n in enumerate(order)}
    if sorted(position, key=graph_ops.index) != graph_ops:
        return False  # not every op exactly once
    return all(position[a] < position[n] for n in order for a in n.all_input_nodes if a in position)


def test_every_reordering_is_topological_and_computes_the_same_bits(block_graph):
    primals, grad_out, out, grads = _eager_block_step()
    traced_out, traced_grads = block_graph(primals, [grad_out])
    # The traced graph is the eager block: its forward bit for bit (dropout through the torch-op Philox), its
    # backward to rounding, as AOTAutograd decomposes RMSNorm's backward into other ops (measured: 1e-6 at most).
    assert torch.equal(traced_out[0], out)
    torch.testing.assert_close(traced_grads[: len(grads)], list(grads))
    graph_ops = ops(block_graph)
    stores, _ = storages(block_graph)
    for name, order in memory_aware_orders(graph_ops, stores).items():
        assert order != graph_ops, name  # each rule does move ops
        assert _valid_order(order, graph_ops), name
        new_out, new_grads = reorder(block_graph, order)(primals, [grad_out])
        assert torch.equal(new_out[0], out), name
        assert all(torch.equal(a, b) for a, b in zip(new_grads[: len(grads)], traced_grads)), name


def _live_bytes_brute_force(order, stores) -> int:
    """The peak by listing, at each op, every storage made at or before it and read at or after it."""
    position = {n: i for i, n in enumerate(order)}
    peak = 0
    for i in range(len(order)):
        alive = 0
        for s in stores:
            last = len(order) if s.returned else max([position[r] for r in s.readers] + [position[s.maker]])
            if position[s.maker] <= i <= last:
                alive += s.nbytes
        peak = max(peak, alive)
    return peak


def test_peaks_and_layouts_on_the_block(block_graph):
    graph_ops = ops(block_graph)
    stores, input_bytes = storages(block_graph)
    # The inputs: the block's parameters, its input and its output's gradient, the rows, and the model's whole
    # rope table (cos and sin per position and head-dim pair), of which the block reads a slice.
    params = sum(p.numel() for p in llama_block(0, ARGS).parameters())
    rope = ARGS.max_seq_len * ARGS.dim // ARGS.n_heads
    assert input_bytes == 4 * (params + 2 * ROWS * SEQ * ARGS.dim + rope) + 8 * ROWS
    analysis = analyse(block_graph)
    orders = {"traced": graph_ops, **memory_aware_orders(graph_ops, stores)}
    for name, order in orders.items():
        lives = lifetimes(order, stores)
        assert lives.peak == _live_bytes_brute_force(order, stores), name
        for placement, place in PLACEMENTS.items():
            offsets = layout(lives, place(lives))
            for j, k in itertools.combinations(range(len(stores)), 2):
                alive_together = lives.start[j] <= lives.end[k] and lives.start[k] <= lives.end[j]
                apart = offsets[j] + stores[j].nbytes <= offsets[k] or offsets[k] + stores[k].nbytes <= offsets[j]
                assert apart or not alive_together, (name, placement, j, k)
            arena = max(o + s.nbytes for o, s in zip(offsets, stores))
            assert arena >= lives.peak  # no layout beats the live bytes
    assert analysis.traced.peak == lifetimes(graph_ops, stores).peak
    assert analysis.memory_aware.peak == min(lifetimes(o, stores).peak for o in orders.values() if o is not graph_ops)
    assert analysis.memory_aware.peak < analysis.traced.peak  # dropout's masks can be made later than traced


def test_a_hand_computed_graph():
    """f(x) = sum_i (x * i).sum(): traced, all four products are made before the sums (4 x 4 KiB alive at once); a
    memory-aware order reduces each product as soon as it is made (one 4 KiB product and the small sums)."""

    def f(x):
        products = [torch.mul(x, i) for i in range(1, 5)]
        return sum(torch.sum(p) for p in products)

    gm = fx.symbolic_trace(f)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    with FakeTensorMode() as mode:
        FakeTensorProp(gm, mode).propagate(torch.empty(1024))
    stores, input_bytes = storages(gm)
    assert input_bytes == 4096
    graph_ops = ops(gm)
    # Traced: the 4 products (16 KiB) are alive when the first sum (4 bytes) is made.
    assert lifetimes(graph_ops, stores).peak == 4 * 4096 + 4
    best = min(lifetimes(o, stores).peak for o in memory_aware_orders(graph_ops, stores).values())
    # Reordered: one product, its sum, and the running total: 4096 + 4 + 4 (+ the sum being added up).
    assert best <= 4096 + 3 * 4


def test_titan_plan_graph_prints_the_table(tmp_path):
    result = run_titan(
        "plan", "--config", DEBUG_RECIPE, "--world-size", "1", "--graph", "--json", str(tmp_path / "graph.json")
    )
    assert result.returncode == 0, result.stderr
    assert "one llama3 debug block's forward and backward as one graph, on 8 x 256 tokens in fp32" in result.stdout
    figures = json.loads((tmp_path / "graph.json").read_text())
    assert figures["traced"]["peak"] == analyse(trace_block(ResolvedModel(SPEC, FLAVORS["debug"]), 8, 256)).traced.peak
    assert set(figures["traced"]["arenas"]) == set(PLACEMENTS)
    lowers = figures["memory_aware"]["peak"] < figures["traced"]["peak"]
    assert ("the best reordering lowers the peak" in result.stdout) == lowers


def _measured_saved_bytes(args, bf16: bool, compiled: bool) -> int:
    """What a real block (eager, or compiled by Inductor) keeps for backward beyond its parameters and inputs,
    counted by storage as autograd packs each saved tensor."""
    from torch.multiprocessing.reductions import StorageWeakRef

    torch.manual_seed(0)
    block = llama_block(0, args)
    block.attention_dropout.stream, block.ffn_dropout.stream = "attention_dropout", "ffn_dropout"
    inputs = (torch.randn(ROWS, SEQ, args.dim, requires_grad=True), rope_table(args)[:SEQ][None], torch.arange(ROWS))
    run = torch.compile(block) if compiled else block
    kept = {}

    def pack(t):
        kept[StorageWeakRef(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        run(*inputs, None)  # compiles, outside the count
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run(*inputs, None)
    inputs_and_weights = {StorageWeakRef(t.untyped_storage()) for t in (*block.parameters(), *inputs)}
    return sum(n for ref, n in kept.items() if ref not in inputs_and_weights)


@pytest.mark.slow
@pytest.mark.parametrize(
    "bf16,dropout", scenarios_beyond([(True, 0.1)], [(False, 0.0), (True, 0.1)]), ids=["fp32", "bf16_dropout"]
)
def test_the_plan_knows_what_a_compiled_block_keeps_for_backward(bf16, dropout):
    """`titan plan` with compile.enable counts a compiled block's activations as torch.compile keeps them: fewer
    than eager autograd, since its partitioner recomputes cheap ops in backward. Traced under fake tensors, the
    bytes equal a real block's on this CPU, eager and compiled."""
    from titan.train.estimate.graph import saved_by_block

    args = dataclasses.replace(ARGS, attn_dropout=dropout, resid_dropout=dropout)
    planned = {c: saved_by_block(ResolvedModel(SPEC, args), ROWS, SEQ, bf16, compiled=c) for c in (False, True)}
    measured = {c: _measured_saved_bytes(args, bf16, compiled=c) for c in (False, True)}
    assert planned == measured
    assert planned[True] < planned[False]
