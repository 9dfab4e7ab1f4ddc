"""The global sample order: one global batch per step whatever the layout, shuffled per epoch, resumable
anywhere at once, blended across sources, with document boundaries and loss-bearing tokens exact."""

import random
import time

import numpy as np
import pytest
import torch

from helpers import numbered_documents
from titan.balance import micro_batch_sizes
from titan.data.loader import IGNORE, Blend, GlobalBatchLoader, PackedSamples
from titan.data.order import EpochOrder, held_out

SEQ = 15  # windows of 16 tokens


def samples(docs, seed=0, shuffle=True, stream=0, subset=None):
    subset = np.arange(docs.n_documents) if subset is None else subset
    return PackedSamples(docs, subset, SEQ, seed, shuffle, stream)


def loader(docs, global_batch=8, rows=None, micro=8, mask=True, seed=0):
    rows = rows or range(global_batch)
    return GlobalBatchLoader(
        [samples(docs, seed)], Blend([1.0]), global_batch, rows, micro_batch_sizes([len(rows)], micro)[0], mask
    )


def tokens_of(batches):
    """The full windows (inputs plus the last label) of a rank's micro-batches, with their global rows."""
    out = {}
    for b in batches:
        labels = b.labels.clone()
        # restore masked labels: they are the inputs shifted by one
        labels[labels == IGNORE] = torch.cat([b.inputs[:, 1:], labels[:, -1:]], dim=1)[labels == IGNORE]
        for row, inp, last in zip(b.rows.tolist(), b.inputs, labels[:, -1]):
            out[row] = inp.tolist() + [int(last)]
    return out


def test_every_document_appears_exactly_once_per_epoch_in_order_of_a_permutation():
    docs = numbered_documents(50)
    s = samples(docs)
    for epoch in range(3):
        stream = np.concatenate([s.sample(epoch * s.samples_per_epoch + k)[0] for k in range(s.samples_per_epoch)])
        # Reassemble the document order from the stream: a document starts where a token's position is 0.
        starts = np.flatnonzero(stream % 1000 == 0)
        order = [int(stream[i] // 1000) for i in starts]
        assert len(order) == len(set(order))  # no document twice
        tail = docs.n_documents - len(order)
        assert 0 <= tail <= 2  # only the tail that fills no window is missing
        for doc, start in zip(order, starts):  # each document whole and in order
            want = docs.tokens(doc)
            got = stream[start : start + len(want)]
            assert np.array_equal(got, want[: len(got)])
        assert len(stream) == s.samples_per_epoch * (SEQ + 1) <= docs.lengths.sum()


def test_two_seeds_give_different_orders_and_one_seed_the_same():
    docs = numbered_documents(50)
    first = lambda seed: samples(docs, seed).sample(0)[0].tolist()  # noqa: E731
    assert first(0) == first(0)
    assert first(0) != first(1)
    s = samples(docs)
    assert s.sample(0)[0].tolist() != s.sample(s.samples_per_epoch)[0].tolist()  # epochs reshuffle


@pytest.mark.parametrize("dp,micro", [(2, 4), (2, 2), (4, 1), (4, 2), (8, 1)])
def test_ranks_read_disjoint_rows_that_make_up_the_single_process_global_batch(dp, micro):
    docs = numbered_documents(80)
    single = loader(docs)
    reference = [tokens_of(next(single)) for _ in range(6)]
    share = 8 // dp
    ranks = [loader(docs, rows=range(r * share, (r + 1) * share), micro=micro) for r in range(dp)]
    for step in range(6):
        merged = {}
        for rank in ranks:
            batches = next(rank)
            assert len(batches) == share // micro and all(len(b.rows) == micro for b in batches)
            assert all(b.step_loss_tokens == batches[0].step_loss_tokens for b in batches)
            merged.update(tokens_of(batches))
        assert merged == reference[step]


def test_step_loss_tokens_is_the_sum_over_every_rank_of_the_tokens_that_carry_a_loss():
    docs = numbered_documents(80, max_len=12)  # many boundaries per window
    ranks = [loader(docs, rows=range(r * 2, r * 2 + 2), micro=1) for r in range(4)]
    for _ in range(5):
        batches = [b for rank in ranks for b in next(rank)]
        brute = sum(int((b.labels != IGNORE).sum()) for b in batches)
        assert all(b.step_loss_tokens == brute for b in batches)
        assert brute < 8 * SEQ


def test_document_ids_and_labels_follow_the_document_boundaries():
    docs = numbered_documents(40, max_len=10)
    (batch,) = next(loader(docs))
    for inputs, labels, ids in zip(batch.inputs, batch.labels, batch.document_ids):
        for i in range(SEQ):
            # a new id exactly where a new document starts (position 0 in its token's name)
            assert bool(i and ids[i] != ids[i - 1]) == bool(i and int(inputs[i]) // 1000 != int(inputs[i - 1]) // 1000)
            if i < SEQ - 1:
                same_document = int(inputs[i + 1]) // 1000 == int(inputs[i]) // 1000
                assert (labels[i] != IGNORE) == same_document
                if same_document:
                    assert labels[i] == inputs[i + 1]
    unmasked = next(loader(docs, mask=False))[0]
    assert unmasked.document_ids is None and (unmasked.labels != IGNORE).all()
    assert unmasked.step_loss_tokens == 8 * SEQ


@pytest.mark.parametrize("stop_after", [0, 1, 7, 23])  # 23 steps span several epochs
@pytest.mark.parametrize("dp_after", [1, 2, 4])
def test_resume_continues_with_the_global_batches_of_an_uninterrupted_run_on_any_data_parallel_size(
    stop_after, dp_after
):
    docs = numbered_documents(30)
    straight = loader(docs)
    expected = [tokens_of(next(straight)) for _ in range(stop_after + 6)]
    first = loader(docs, rows=range(0, 4), micro=2)  # rank 0 of two
    for _ in range(stop_after):
        next(first)
    state = first.state_dict()
    share = 8 // dp_after
    resumed = [loader(docs, rows=range(r * share, (r + 1) * share), micro=share) for r in range(dp_after)]
    for rank in resumed:
        rank.load_state_dict(state)
    for want in expected[stop_after:]:
        merged = {}
        for rank in resumed:
            merged.update(tokens_of(next(rank)))
        assert merged == want


def test_resume_far_into_training_reads_only_its_batch_and_orders_only_its_epoch(monkeypatch):
    """Resuming at sample 10^7 (hundreds of epochs in) costs what one batch costs: the loader orders only the
    epoch the batch lies in, reads only the batch's tokens, and they are the samples at that position."""
    docs = numbered_documents(2_000, max_len=400)
    ordered, read = [], []
    order_epoch, read_tokens = EpochOrder._epoch, docs.tokens
    monkeypatch.setattr(EpochOrder, "_epoch", lambda self, epoch: ordered.append(epoch) or order_epoch(self, epoch))
    monkeypatch.setattr(docs, "tokens", lambda *args: read.append(read_tokens(*args)) or read[-1])
    far = loader(docs, global_batch=512, micro=64)
    far.load_state_dict({"next_sample": 10_000_000})
    batches = next(far)
    reference = samples(docs)
    epochs = {(10_000_000 + row) // reference.samples_per_epoch for row in range(512)}
    assert set(ordered) == epochs and 10_000_000 // reference.samples_per_epoch > 100
    assert sum(map(len, read)) == 512 * (SEQ + 1)
    inputs = {row: x.tolist() for b in batches for row, x in zip(b.rows.tolist(), b.inputs)}
    assert inputs == {row: reference.sample(10_000_000 + row)[0][:-1].tolist() for row in range(512)}


@pytest.mark.benchmark
def test_resume_far_into_training_takes_well_under_a_second():
    docs = numbered_documents(200_000, max_len=400)  # about 40M tokens
    far = loader(docs, global_batch=512, micro=64)
    start = time.perf_counter()
    far.load_state_dict({"next_sample": 10_000_000})
    next(far)
    assert time.perf_counter() - start < 1.0


def test_blend_serves_each_source_in_proportion_and_in_order():
    blend = Blend([0.7, 0.2, 0.1])
    n = 25_000
    located = [blend.locate(g) for g in range(n)]
    counts = np.bincount([s for s, _ in located], minlength=3)
    assert np.abs(counts / n - [0.7, 0.2, 0.1]).max() < 1e-3
    assert np.array_equal(counts, blend.counts(n))
    for source in range(3):  # each source's samples are used once each, in order
        assert [j for s, j in located if s == source] == list(range(counts[source]))


@pytest.mark.parametrize("seed", range(40))
def test_blend_gives_every_source_its_share_of_each_period_to_within_one_sample(seed):
    """Counted sample by sample over a period: every source within one sample of weight / sum x period, even a
    share far below 1/4096 (the period grows for it), and the next periods the same."""
    rng = random.Random(seed)
    weights = [
        rng.choice([1.0, 3.0, rng.uniform(0.01, 10), 10 ** rng.uniform(-4, 0)]) for _ in range(rng.randint(1, 5))
    ]
    blend = Blend(weights)
    counts = [0] * len(weights)
    for g in range(blend.period):
        source, index = blend.locate(g)
        assert index == counts[source]  # each source's samples in order, each once
        counts[source] += 1
    exact = np.array(weights) / sum(weights) * blend.period
    assert np.abs(np.array(counts) - exact).max() < 1 and min(counts) >= 1
    assert blend.period == 4096 or min(exact) < 2  # a longer period only when a share needs it
    for g in rng.sample(range(blend.period), 20):
        source, index = blend.locate(g)
        assert blend.locate(g + 3 * blend.period) == (source, index + 3 * counts[source])


def test_a_share_below_one_sample_in_4096_still_gets_its_samples():
    blend = Blend([1.0, 1e-4])  # once [4096, 0] per 4096 samples: none ever
    assert blend.period == 16384 and blend.per_period.tolist() == [16382, 2]  # 1.64 due per period


def test_a_mixture_reads_each_source_by_its_own_order():
    a, b = numbered_documents(40, seed=1), numbered_documents(40, seed=2)
    mixed = GlobalBatchLoader([samples(a), samples(b, stream=1)], Blend([3.0, 1.0]), 8, range(8), [8], True)
    alone = [samples(a), samples(b, stream=1)]
    (batch,) = next(mixed)
    blend, used = Blend([3.0, 1.0]), [0, 0]
    for row in range(8):
        source, index = blend.locate(row)
        assert index == used[source]
        used[source] += 1
        assert batch.inputs[row].tolist() == alone[source].sample(index)[0][:-1].tolist()
    assert used == [6, 2]


def test_validation_split_is_a_fixed_fraction_of_documents_whatever_the_seed():
    split = held_out(100_000, 0.05)
    assert abs(split.mean() - 0.05) < 0.003
    assert np.array_equal(split, held_out(100_000, 0.05))
    assert np.array_equal(split[:1000], held_out(1000, 0.05))  # a document's side never depends on the others
    assert not held_out(100, 0.0).any()
