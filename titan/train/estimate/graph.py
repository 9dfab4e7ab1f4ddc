"""What the order of one block's operators costs in memory, in the spirit of ROAM (`titan plan --graph`).

One transformer block's forward and backward are traced as one functional graph of aten ops (AOTAutograd's joint
graph, the graph `torch.compile` starts from) under fake tensors, so any model size traces on a CPU. Each op's
outputs are storages (views share their base's, as the fake tensors say); a storage lives from the op that makes
it to the last op that reads it, or to the end when the graph returns it. Then, for an order of the ops:

- its peak: the most bytes alive at once, the least memory any allocator can run that order in;
- memory-aware orders: ops scheduled greedily by two rules (see `memory_aware_orders`), the lower peak kept;
- static layouts, one offset per storage, in which storages alive at the same time never share an address:
  first fit with the storages placed in allocation order (what a simple caching allocator does), long-lived
  first (ROAM's rule) or largest first. The arena over the peak is the fragmentation.

Inductor reorders its own scheduler nodes for peak memory (`torch._inductor.config.reorder_for_peak_memory`, on by
default) after fusion; it works on its IR, not on an FX graph, so the orders here are computed by titan.

`saved_by_block` counts what one block keeps for backward, eager or compiled (torch.compile's partitioner
recomputes cheap ops instead of keeping them): `titan plan` takes the difference off compiled recipes' blocks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from titan.config import Config
from titan.run_plan import run_plan
from titan.train.model import ResolvedModel, resolve_model


def one_block(model: ResolvedModel) -> nn.Module:
    """The block of a one-block model, on the meta device: named as the first block of any model is."""
    with torch.device("meta"):
        return model.spec.blocks(model.spec.build(dataclasses.replace(model.args, n_layers=1)))[0]


def trace_block(model: ResolvedModel, rows: int, seq: int, dtype: torch.dtype = torch.float32) -> fx.GraphModule:
    """The joint forward-and-backward graph of one block on `rows` x `seq` tokens, in `dtype`, traced under fake
    tensors (the block is built on the meta device: nothing is allocated). Call it as gm(primals, tangents) with
    primals = (parameters..., the block's inputs (spec.block_inputs)...) and tangents = (grad of its output,)."""
    from torch._functorch.aot_autograd import aot_export_joint_simple
    from torch._subclasses.fake_tensor import FakeTensorMode

    block = one_block(model)
    names = [name for name, _ in block.named_parameters()]

    def forward(*primals):
        params, inputs = primals[: len(names)], primals[len(names) :]
        return (torch.func.functional_call(block, dict(zip(names, params)), inputs),)

    with FakeTensorMode():
        params = [torch.empty(p.shape, dtype=dtype, requires_grad=True) for p in block.parameters()]
        primals = [*params, *model.spec.block_inputs(model.args, rows, seq, dtype)]
        return aot_export_joint_simple(forward, primals, trace_joint=True)


def saved_by_block(model: ResolvedModel, rows: int, seq: int, bf16: bool, compiled: bool) -> int:
    """Bytes one block's forward keeps for its backward beyond its inputs (parameters, the hidden states it takes,
    the other inputs), under fake tensors on this CPU: what eager autograd keeps, or, `compiled`, what a
    torch.compile'd block keeps. The compiled block is traced as torch.compile traces it and split into forward
    and backward by the partitioner Inductor uses, after Inductor's decompositions; the partitioner recomputes
    cheap ops in backward rather than keep their results. bf16: under autocast, as on one device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    block = one_block(model)
    kept: dict[StorageWeakRef, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[StorageWeakRef(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    with FakeTensorMode(allow_non_fake_inputs=True), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        block.to_empty(device="cpu")
        inputs = model.spec.block_inputs(model.args, rows, seq, torch.float32)  # autocast casts, as without FSDP
        run = _compiled_as_inductor_partitions(block) if compiled else block
        # A compiled graph keeps its tensors through autograd too (save_for_backward), so one count serves both.
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run(*inputs)
        held = {StorageWeakRef(t.untyped_storage()) for t in (*block.parameters(), *inputs)}
    return sum(n for ref, n in kept.items() if ref not in held)


def _compiled_as_inductor_partitions(block: nn.Module):
    """The block under torch.compile with Inductor's decompositions and partitioner, its graphs run as traced (on
    fake tensors, Inductor's kernels would be the same ops fused)."""
    from functools import partial

    from torch._dynamo import reset
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    def backend(gm: fx.GraphModule, example_inputs):
        partition = partial(min_cut_rematerialization_partition, compiler="inductor")
        as_traced = lambda graph, _inputs: graph.forward  # noqa: E731
        return aot_module_simplified(
            gm, example_inputs, fw_compiler=as_traced, decompositions=select_decomp_table(), partition_fn=partition
        )

    reset()  # a fresh trace: dynamo's cache would otherwise serve an earlier block's graphs
    return torch.compile(block, backend=backend)


@dataclass
class Storage:
    nbytes: int
    maker: fx.Node  # the op that allocates it
    readers: set[fx.Node]  # ops that read it or one of its views
    returned: bool  # by the graph: alive to the end


@dataclass
class Lifetimes:
    """Each storage's first and last position in an order; the peak is the most bytes alive at one position."""

    storages: list[Storage]
    start: list[int]
    end: list[int]

    @property
    def peak(self) -> int:
        delta = [0] * (max(self.end, default=0) + 2)
        for s, a, b in zip(self.storages, self.start, self.end):
            delta[a] += s.nbytes
            delta[b + 1] -= s.nbytes
        live = best = 0
        for d in delta:
            live += d
            best = max(best, live)
        return best


def ops(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def storages(gm: fx.GraphModule) -> tuple[list[Storage], int]:
    """The storages the graph's ops allocate, and the bytes of its inputs (placeholders: parameters, the block's
    input, the output's gradient), which are alive throughout whatever the order."""
    by_ref: dict[StorageWeakRef, Storage] = {}
    inputs: set[StorageWeakRef] = set()
    input_bytes = 0
    owner: dict[fx.Node, list[StorageWeakRef]] = {}
    for node in gm.graph.nodes:
        tensors = [t for t in tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)]
        refs = [StorageWeakRef(t.untyped_storage()) for t in tensors]
        owner[node] = refs
        for ref, t in zip(refs, tensors):
            if node.op == "placeholder" and ref not in inputs:
                inputs.add(ref)
                input_bytes += t.untyped_storage().nbytes()
            elif node.op == "call_function" and ref not in inputs and ref not in by_ref:
                by_ref[ref] = Storage(t.untyped_storage().nbytes(), node, set(), False)
    for node in ops(gm):
        for arg in node.all_input_nodes:
            for ref in owner[arg]:
                if ref in by_ref:
                    by_ref[ref].readers.add(node)
    for arg in gm.graph.output_node().all_input_nodes:
        for ref in owner[arg]:
            if ref in by_ref:
                by_ref[ref].returned = True
    return list(by_ref.values()), input_bytes


def lifetimes(order: list[fx.Node], stores: list[Storage]) -> Lifetimes:
    position = {n: i for i, n in enumerate(order)}
    last = len(order) - 1
    start = [position[s.maker] for s in stores]
    end = [last if s.returned else max((position[r] for r in s.readers), default=position[s.maker]) for s in stores]
    return Lifetimes(stores, start, end)


def memory_aware_orders(order: list[fx.Node], stores: list[Storage]) -> dict[str, list[fx.Node]]:
    """Topological orders built greedily from the ops ready at each point, ties going to the traced order:

    - "fewest bytes added": the op whose outputs less what it frees (as the last reader) is smallest;
    - "least peak first": among the ops that keep memory within the peak so far, the one leaving the least
      alive after it; when none does, the one whose own peak is lowest (Inductor's LPMF rule).

    AOTAutograd's traced order already runs each op just before its first reader (scheduling as late as possible
    gives it back unchanged), so these are the rules that can move ops earlier.
    """
    index = {n: i for i, n in enumerate(order)}
    made: dict[fx.Node, int] = {}
    dead_on_arrival: dict[fx.Node, int] = {}  # outputs nothing reads
    reads: dict[fx.Node, list[int]] = {n: [] for n in order}
    for k, s in enumerate(stores):
        made[s.maker] = made.get(s.maker, 0) + s.nbytes
        if not s.readers and not s.returned:
            dead_on_arrival[s.maker] = dead_on_arrival.get(s.maker, 0) + s.nbytes
        for r in s.readers:
            reads[r].append(k)
    users = {n: [u for u in n.users if u in index] for n in order}

    def schedule(rule) -> list[fx.Node]:
        readers_left = [len(s.readers) for s in stores]
        waiting = {n: len([a for a in n.all_input_nodes if a in index]) for n in order}
        ready = [n for n in order if waiting[n] == 0]
        live = peak = 0
        result = []
        while ready:
            costs = {}
            for n in ready:
                freed = dead_on_arrival.get(n, 0) + sum(
                    stores[k].nbytes for k in reads[n] if readers_left[k] == 1 and not stores[k].returned
                )
                costs[n] = (live + made.get(n, 0), live + made.get(n, 0) - freed)  # during, after
            best = rule(ready, costs, peak, index)
            ready.remove(best)
            result.append(best)
            peak, live = max(peak, costs[best][0]), costs[best][1]
            for k in reads[best]:
                readers_left[k] -= 1
            for u in users[best]:
                waiting[u] -= 1
                if waiting[u] == 0:
                    ready.append(u)
        assert len(result) == len(order), "the graph has a cycle"
        return result

    def fewest_added(ready, costs, peak, index):
        return min(ready, key=lambda n: (costs[n][1], index[n]))

    def least_peak_first(ready, costs, peak, index):
        within = [n for n in ready if costs[n][0] <= peak]
        if within:
            return min(within, key=lambda n: (costs[n][1], index[n]))
        return min(ready, key=lambda n: (costs[n][0], index[n]))

    return {"fewest bytes added": schedule(fewest_added), "least peak first": schedule(least_peak_first)}


def layout(lives: Lifetimes, placement: list[int]) -> list[int]:
    """An offset per storage, placing them in `placement` order, each at the lowest address where it overlaps
    no placed storage alive at the same time (first fit)."""
    offsets: list[int | None] = [None] * len(lives.storages)
    for k in placement:
        taken = sorted(
            (offsets[j], offsets[j] + lives.storages[j].nbytes)
            for j in range(len(offsets))
            if offsets[j] is not None and lives.start[j] <= lives.end[k] and lives.start[k] <= lives.end[j]
        )
        at = 0
        for lo, hi in taken:
            if at + lives.storages[k].nbytes <= lo:
                break
            at = max(at, hi)
        offsets[k] = at
    return offsets


def arena(lives: Lifetimes, offsets: list[int]) -> int:
    return max((o + s.nbytes for o, s in zip(offsets, lives.storages)), default=0)


def allocation_order(lives: Lifetimes) -> list[int]:
    """What an online first-fit allocator does: place each storage when it is made."""
    return sorted(range(len(lives.storages)), key=lambda k: (lives.start[k], k))


def long_lived_first(lives: Lifetimes) -> list[int]:
    """ROAM's rule: the longest-lived (activations kept for backward) are fixed obstacles the rest pack around."""
    return sorted(range(len(lives.storages)), key=lambda k: (lives.start[k] - lives.end[k], -lives.storages[k].nbytes))


def largest_first(lives: Lifetimes) -> list[int]:
    """Greedy by size: big storages first, small ones fill the gaps."""
    return sorted(range(len(lives.storages)), key=lambda k: (-lives.storages[k].nbytes, lives.start[k]))


PLACEMENTS = {
    "allocation order": allocation_order,
    "long-lived first": long_lived_first,
    "largest first": largest_first,
}


def reorder(gm: fx.GraphModule, order: list[fx.Node]) -> fx.GraphModule:
    """A copy of the graph with its ops in `order` (placeholders first, the output last)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    nodes = list(gm.graph.nodes)
    for node in [n for n in nodes if n.op == "placeholder"] + order + [n for n in nodes if n.op == "output"]:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph._codegen = gm.graph._codegen  # the (primals, tangents) calling convention
    return fx.GraphModule(gm, graph)


@dataclass
class OrderFigures:
    name: str
    peak: int
    arenas: dict[str, int]  # bytes of the static layout made by each of PLACEMENTS


@dataclass
class GraphAnalysis:
    ops: int
    input_bytes: int
    traced: OrderFigures
    memory_aware: OrderFigures

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def analyse(gm: fx.GraphModule) -> GraphAnalysis:
    stores, input_bytes = storages(gm)
    traced = ops(gm)

    def figures(name: str, order: list[fx.Node]) -> OrderFigures:
        lives = lifetimes(order, stores)
        arenas = {placement: arena(lives, layout(lives, place(lives))) for placement, place in PLACEMENTS.items()}
        return OrderFigures(name, lives.peak, arenas)

    orders = [figures(name, order) for name, order in memory_aware_orders(traced, stores).items()]
    return GraphAnalysis(len(traced), input_bytes, figures("traced", traced), min(orders, key=lambda f: f.peak))


def analyse_recipe(config: Config, world_size: int) -> tuple[GraphAnalysis, str]:
    """The analysis of one block of the recipe's model at its micro-batch and dtype, and what was traced."""
    rows, _ = run_plan(config, world_size).largest_micro_batch
    seq = config.training.seq_len
    dtype = torch.bfloat16 if config.training.mixed_precision == "bf16" else torch.float32
    what = (
        f"one {config.model.name} {config.model.flavor} block's forward and backward as one graph, on "
        f"{rows} x {seq} tokens in {'bf16' if dtype == torch.bfloat16 else 'fp32'}, on one device"
    )
    return analyse(trace_block(resolve_model(config), rows, seq, dtype)), what
