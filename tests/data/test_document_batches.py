"""Document-level global batches (data.batching = "tokens"): which documents a step takes, and what each
data-parallel rank reads of them."""

import numpy as np
import pytest
import torch

from helpers import numbered_documents
from titan.data.document_batches import PAD_BLOCK, DocumentBatchLoader, DocumentPieces, Placement
from titan.data.loader import IGNORE
from titan.data.packing import CostModel, Target
from titan.models.decoder.rope import document_positions

COST = CostModel(a=2e-6, b=1e-4, c=1e-3)


def pieces_of(max_len=16, n=60, seed=3):
    docs = numbered_documents(n, seed=seed, min_len=1, max_len=70)
    return docs, DocumentPieces(docs, np.arange(n), max_len, seed=7, shuffle=True)


def test_an_epoch_of_pieces_covers_every_token_pair_once_in_pieces_of_at_most_max_len():
    docs, pieces = pieces_of()
    seen = []
    first = 0
    while first < pieces.tokens_per_epoch:
        step, first = pieces.step(first, budget=100)
        assert sum(length for _, _, length in step) <= 100
        for doc, start, length in step:
            assert 1 <= length <= 16
            tokens = pieces.tokens(doc, start, length)
            assert tokens.tolist() == [doc * 1000 + i for i in range(start, start + length + 1)]
            seen += [(doc, i) for i in range(start, start + length)]
    assert first == pieces.tokens_per_epoch  # the last step stops at the epoch's end
    want = [(doc, i) for doc in range(docs.n_documents) for i in range(int(docs.lengths[doc]) - 1)]
    assert sorted(seen) == want and len(seen) == pieces.tokens_per_epoch


def test_the_documents_of_a_step_depend_on_the_seed_and_step_only():
    _, a = pieces_of()
    _, b = pieces_of()
    first_a, first_b = 0, 0
    for _ in range(5):
        step_a, first_a = a.step(first_a, 100)
        step_b, first_b = b.step(first_b, 100)
        assert step_a == step_b
    other = DocumentPieces(a.documents, np.arange(60), 16, seed=8, shuffle=True)
    assert other.step(0, 100)[0] != a.step(0, 100)[0]
    # The next epoch reshuffles.
    assert a.step(a.tokens_per_epoch, 100)[0] != a.step(0, 100)[0]


def loaders(placement: Placement, ranks: int, balance="cost", capacity=64):
    _, pieces = pieces_of()
    target = Target((capacity,) * ranks, 2 if placement.pipeline_rows else 1, placement.pipeline_rows or 1,
                    padded=bool(placement.pipeline_rows))  # fmt: skip
    return [DocumentBatchLoader(pieces, 200, balance, COST, target, placement, r) for r in range(ranks)]


@pytest.mark.parametrize(
    "placement", [Placement(64), Placement(64, pad_multiple=4), Placement(64, pipeline_rows=2)],
    ids=["rows_of_their_length", "padded_for_sequence_parallel", "pipeline_rows_padded_to_capacity"],
)  # fmt: skip
@pytest.mark.parametrize("balance", ["cost", "tokens"])
def test_the_ranks_micro_batches_hold_the_steps_pieces_exactly_once(placement, balance):
    ranks = loaders(placement, 2, balance)
    _, pieces = pieces_of()
    first = 0
    for _ in range(4):
        step, first = pieces.step(first, 200)
        want = sorted((doc, start + i) for doc, start, length in step for i in range(length))
        got, counts = [], set()
        for loader in ranks:
            batches = next(loader)
            counts.add(sum(b.inputs.shape[0] for b in batches))
            for b in batches:
                rows, width = b.inputs.shape
                assert b.step_loss_tokens == len(want)
                assert b.loss_tokens == int((b.labels != IGNORE).sum())
                if placement.pipeline_rows:
                    assert (rows, width) == (placement.pipeline_rows, placement.capacity)
                else:
                    assert rows == 1 and width % placement.pad_multiple == 0 and width <= 64 + placement.pad_multiple
                for x, y, ids in zip(b.inputs, b.labels, b.document_ids):
                    real = y != IGNORE
                    assert (ids[real] >= 0).all() and (ids[~real] < 0).all()
                    assert real[: int(real.sum())].all()  # documents first, then padding
                    # Padding comes in "documents" of at most PAD_BLOCK tokens, each position within the RoPE
                    # table the model holds for the longest piece (max_len 16; the rows hold 64).
                    assert all(
                        n <= PAD_BLOCK for n in torch.unique_consecutive(ids[~real], return_counts=True)[1].tolist()
                    )
                    assert document_positions(ids[None]).max() < pieces.max_len
                    for token, label in zip(x[real].tolist(), y[real].tolist()):
                        assert label == token + 1  # the next token of the same document
                        got.append((token // 1000, token % 1000))
        assert len(counts) == 1  # every rank runs as many micro-batches (FSDP's collectives)
        assert sorted(got) == want


def test_under_cp_a_group_reads_its_rings_whole_and_each_rank_its_own_local_rows():
    """Documents on the dp x cp plane: a ring's row is the group's, the same on each of its ranks and as long as the
    ring (cp x a rank's capacity); a local row is one rank's own, at most its capacity. Each piece is read once."""
    dp, cp, capacity = 2, 2, 8
    _, pieces = pieces_of()
    target, placement = Target((capacity,) * dp * cp, cp=cp), Placement(capacity, cp=cp)
    ranks = {
        (g, c): DocumentBatchLoader(pieces, 200, "cost", COST, target, placement, g, c)
        for g in range(dp)
        for c in range(cp)
    }
    first, kinds = 0, set()
    for _ in range(4):
        step, first = pieces.step(first, 200)
        want = sorted((doc, start + i) for doc, start, length in step for i in range(length))
        batches = {rank: next(loader) for rank, loader in ranks.items()}
        assert len({len(mine) for mine in batches.values()}) == 1  # every rank runs as many micro-batches
        got = []
        for (g, c), mine in batches.items():
            for m, b in enumerate(mine):
                assert b.step_loss_tokens == len(want)
                if b.local:
                    assert b.inputs.shape[0] == 1 and b.inputs.shape[1] <= capacity
                else:
                    assert b.inputs.shape == (1, cp * capacity)
                    group = [batches[g, other][m] for other in range(cp)]
                    assert all(not x.local and torch.equal(x.inputs, b.inputs) for x in group)
                    if c > 0:  # the group's row: counted once
                        continue
                kinds.add(b.local)
                real = b.labels != IGNORE
                got += [(token // 1000, token % 1000) for token in b.inputs[real].tolist()]
        assert sorted(got) == want
    assert kinds == {True, False}  # rings and local rows both occurred


def test_a_resumed_loader_reads_the_batches_it_would_have_read():
    straight = loaders(Placement(64), 2)[1]
    for _ in range(3):
        next(straight)
    state = straight.state_dict()
    want = [b.inputs for b in next(straight)]
    resumed = loaders(Placement(64), 2)[1]
    resumed.load_state_dict(state)
    assert [torch.equal(a, b) for a, b in zip((b.inputs for b in next(resumed)), want)] == [True] * len(want)


def test_speeds_move_work_to_the_faster_rank():
    fast, slow = loaders(Placement(64), 2)
    for loader in (fast, slow):
        loader.speeds = [1.0, 0.25]
    next(fast)
    assignment = fast.last_assignment
    tokens = [sum(int(b.loss_tokens) for b in next(loader)) for loader in (fast, slow)]
    assert assignment.times[0] == pytest.approx(assignment.times[1], rel=0.5)
    assert tokens[0] > 2 * tokens[1]


@pytest.mark.benchmark
def test_the_measured_cost_model_fits_a_tiny_llama_on_this_cpu():
    """c + a·Σs² + b·Σs against forward and backward times of micro-batches of 32 to 2048 tokens: real timings, so
    a benchmark (a loaded machine's noise leaves R² anywhere from 0.2 to 0.99); the fit itself is tested on given
    times below."""
    from titan import models
    from titan.train.cost_fit import measure
    from titan.train.model import ResolvedModel

    spec = models.get_model_spec("llama3")
    # dim 128: big enough that compute, not per-call overhead, sets the times (dim 64 fits with R² ~0.8-0.96).
    overrides = {"n_layers": 2, "dim": 128, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 2048, "max_seq_len": 2048}
    args = models.model_args(spec.name, "debug", overrides)
    cost, r2, samples = measure(ResolvedModel(spec, args), 2, 2048, 2048, torch.device("cpu"), torch.float32, seed=0)
    assert r2 > 0.9, samples
    assert cost.a > 0 and cost.b > 0
    # The quadratic term is real: one 2048-token document takes longer than 32 documents of 64 tokens.
    alone = dict((len(lengths), t) for lengths, t in samples if sum(lengths) == 2048)
    assert alone[1] > alone[32]


def test_a_deep_stage_is_fitted_from_one_and_two_layers(monkeypatch):
    """The cost fit times one and two layers (a stage too large for one device unsharded is measured all the same)
    and extrapolates each micro-batch's time to the stage's depth: with times that are a head's cost plus a cost
    per layer, the fit of a six-layer stage is six layers' a and b plus the head's, by hand. (Real timings of a
    deep model against the extrapolation: tests/cuda, where a GPU's times are steady enough to compare.)"""
    from titan.train import cost_fit

    a, b, c, head = 2e-9, 3e-6, 1e-3, 5e-6  # per layer: a·Σs² + b·Σs; the head: head·Σs; c per micro-batch
    timed = []

    def fake_times(model, n_layers, max_len, capacity, device, dtype, seed):
        timed.append(n_layers)
        batches = cost_fit.micro_batches_to_time(max_len, capacity)
        return [c + n_layers * sum(a * s * s + b * s for s in lengths) + head * sum(lengths) for lengths in batches]

    monkeypatch.setattr(cost_fit, "_time_depth", fake_times)
    cost, r2, _ = cost_fit.measure(None, 6, 1024, 4096, torch.device("cpu"), torch.float32, seed=0)
    assert timed == [1, 2]
    assert (cost.a, cost.b, cost.c) == pytest.approx((6 * a, 6 * b + head, c), rel=1e-6)
    assert r2 == pytest.approx(1.0)
