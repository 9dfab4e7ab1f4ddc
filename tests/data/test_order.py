"""The on-demand document order (titan/data/order.py) against brute force: each epoch a permutation of the
training documents, samples that are the concatenation of the documents in that order, the same order however
it is read, and a rank's memory that does not grow with the corpus."""

import logging
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

import titan.data
from conftest import DEBUG_RECIPE, ROOT, tiny_overrides
from helpers import numbered_documents
from titan.balance import micro_batch_sizes
from titan.config import load_config
from titan.data import order
from titan.data.document_batches import DocumentBatchLoader, DocumentPieces, Placement
from titan.data.loader import Blend, GlobalBatchLoader, PackedSamples
from titan.data.packing import CostModel, Target
from titan.errors import ConfigError

SEQ = 15  # windows of 16 tokens


@pytest.fixture
def small_blocks(monkeypatch):
    """The order's limits scaled down, so a corpus of a few thousand documents takes the path of billions:
    at most 64 blocks of several documents, shuffled within windows of 3 blocks, validation holding out runs of 4
    documents past the first 64."""
    monkeypatch.setattr(order, "MAX_BLOCKS", 64)
    monkeypatch.setattr(order, "WINDOW_DOCUMENTS", 256)
    monkeypatch.setattr(order, "HOLD_OUT_RUN", 4)


def split(docs, fraction=0.1):
    """(training, held-out) splits as titan.data.build_loaders makes them."""
    return order.hold_out(docs, fraction)


def documents_of(docs, split) -> set[int]:
    """The documents of a split, or of every block of a list of block ids."""
    split = split if isinstance(split, order.Split) else order.whole_blocks(docs, split)
    per = docs.block_documents
    every = [d for b in split.blocks for d in range(b * per, min((b + 1) * per, docs.n_documents))]
    return set(split.keep(np.array(every, dtype=np.int64)).tolist())


def epoch_documents(samples: PackedSamples, epoch: int) -> tuple[list[int], np.ndarray]:
    """The documents of an epoch in the order its samples read them, recovered from the tokens alone (a
    numbered document's token is doc * 1000 + position), and the epoch's tokens."""
    n = samples.samples_per_epoch
    stream = np.concatenate([samples.sample(epoch * n + k)[0] for k in range(n)])
    starts = np.flatnonzero(stream % 1000 == 0)
    return [int(stream[i] // 1000) for i in starts], stream


def test_blocks_hold_one_document_up_to_max_blocks_and_never_number_more_than_it():
    assert order.block_documents(1) == order.block_documents(order.MAX_BLOCKS) == 1
    for n in (order.MAX_BLOCKS + 1, 10**9, 10**12):
        per = order.block_documents(n)
        assert -(-n // per) <= order.MAX_BLOCKS < -(-n // (per - 1))  # the smallest blocks that keep the bound


@pytest.mark.parametrize("blocks", ["one_document", "several_documents"])
def test_each_epoch_reads_every_training_document_once_and_no_held_out_one(blocks, request):
    if blocks == "several_documents":
        request.getfixturevalue("small_blocks")
    docs = numbered_documents(3000, max_len=12)
    assert (docs.block_documents > 1) == (blocks == "several_documents")
    train, held = split(docs)
    assert len(held.blocks) and len(train.blocks)
    samples = PackedSamples(docs, train, SEQ, seed=5, shuffle=True)
    expected = documents_of(docs, train)
    orders = []
    for epoch in range(3):
        read, stream = epoch_documents(samples, epoch)
        assert len(read) == len(set(read)) and set(read) <= expected  # a permutation, cut short by the tail only
        assert len(expected - set(read)) <= 2 and not set(read) & documents_of(docs, held)
        # The samples are the documents in that order, concatenated: each whole, one after the other.
        brute = np.concatenate([docs.tokens(d) for d in read] + [docs.tokens(d) for d in expected - set(read)])
        assert np.array_equal(stream, brute[: len(stream)])
        orders.append(read)
    assert orders[0] != orders[1] != orders[2]  # every epoch reshuffles
    assert PackedSamples(docs, train, SEQ, seed=6, shuffle=True).sample(0)[0].tolist() != samples.sample(0)[0].tolist()


def test_a_small_corpus_keeps_a_full_shuffle_of_its_documents():
    """Up to MAX_BLOCKS documents the order is a permutation of all training documents drawn at once (the order
    of data order version 1, which is why its checkpoints resume without a word)."""
    docs = numbered_documents(500)
    train, _ = split(docs)
    samples = PackedSamples(docs, train, SEQ, seed=3, shuffle=True, stream=2)
    for epoch in range(2):
        brute = train.blocks[np.random.default_rng([3, 2, epoch]).permutation(len(train.blocks))]
        read, _ = epoch_documents(samples, epoch)
        assert read == brute[: len(read)].tolist()


def test_blocks_are_mixed_within_windows_not_read_in_stored_order(small_blocks):
    docs = numbered_documents(3000, max_len=12)
    read, _ = epoch_documents(PackedSamples(docs, np.arange(64), SEQ, 0, True), 0)
    neighbours = np.mean(np.abs(np.diff(read)) == 1)  # stored neighbours that stay neighbours
    assert neighbours < 0.05, neighbours
    # Unshuffled (validation), the documents come in stored order.
    unshuffled = epoch_documents(PackedSamples(docs, np.arange(64), SEQ, 0, False), 0)[0]
    assert unshuffled == list(range(len(unshuffled))) and len(unshuffled) >= docs.n_documents - 2


def test_validation_holds_out_documents_that_training_never_reads(small_blocks):
    docs = numbered_documents(3000, max_len=12)
    train, held = split(docs, fraction=0.2)
    assert documents_of(docs, train).isdisjoint(documents_of(docs, held))
    assert len(documents_of(docs, train) | documents_of(docs, held)) == docs.n_documents
    validation = PackedSamples(docs, held, SEQ, 0, False)
    assert set(epoch_documents(validation, 0)[0]) <= documents_of(docs, held)


@pytest.mark.parametrize("n", [65, 301, 3000])
@pytest.mark.parametrize("run", [4, 5])
def test_a_splits_block_counts_are_those_of_its_documents(small_blocks, monkeypatch, n, run):
    """Each block's documents and tokens on either side, worked out from the held-out ranges' ends, against a
    count of the documents held_out picks one by one (runs of 5 straddle the first 64 documents' end)."""
    monkeypatch.setattr(order, "HOLD_OUT_RUN", run)
    docs = numbered_documents(n, max_len=12)
    held = order.held_out(n, 0.3)
    block = np.arange(n) // docs.block_documents
    for split, side in zip(order.hold_out(docs, 0.3), (False, True)):
        counts = np.bincount(block[held == side], minlength=len(docs.block_offsets) - 1)
        tokens = np.bincount(block[held == side], docs.lengths[held == side], minlength=len(counts))
        assert split.blocks.tolist() == np.flatnonzero(counts).tolist()
        assert split.counts.tolist() == counts[split.blocks].tolist()
        assert split.tokens.tolist() == tokens[split.blocks].tolist()
        assert documents_of(docs, split) == set(np.flatnonzero(held == side).tolist())


def test_samples_read_in_any_order_by_fresh_readers_are_the_same(small_blocks):
    """What a rank reads depends on (seed, epoch, sample) only, never on what it read before or how many ranks
    share the work: fresh readers jumping anywhere agree with one reading straight through."""
    docs = numbered_documents(3000, max_len=12)
    train, _ = split(docs)
    straight = PackedSamples(docs, train, SEQ, 9, True)
    n = straight.samples_per_epoch
    indices = list(range(3 * n))
    want = [straight.sample(i)[0].tolist() for i in indices]
    rng = np.random.default_rng(0)
    for workers in (2, 7):
        readers = [PackedSamples(docs, train, SEQ, 9, True) for _ in range(workers)]
        for i in rng.permutation(indices):
            assert readers[i % workers].sample(int(i))[0].tolist() == want[i]


@pytest.mark.parametrize("dp", [2, 4])
def test_data_parallel_ranks_make_up_the_single_process_global_batch(small_blocks, dp):
    docs = numbered_documents(600, max_len=12)
    train, _ = split(docs)

    def loader(rows):
        micro = micro_batch_sizes([len(rows)], 2)[0]
        return GlobalBatchLoader([PackedSamples(docs, train, SEQ, 1, True)], Blend([1.0]), 8, rows, micro, True)

    def rows_of(batches):
        return {int(r): (x.tolist(), y.tolist()) for b in batches for r, x, y in zip(b.rows, b.inputs, b.labels)}

    single = loader(range(8))
    ranks = [loader(range(r * 8 // dp, (r + 1) * 8 // dp)) for r in range(dp)]
    assert docs.block_documents > 1 and 50 * 8 > single.sources[0].samples_per_epoch  # past an epoch's end
    for _ in range(50):
        merged = {}
        for rank in ranks:
            merged.update(rows_of(next(rank)))
        assert merged == rows_of(next(single))


def test_token_batching_reads_the_documents_in_the_same_order_as_rows(small_blocks):
    docs = numbered_documents(3000, min_len=1, max_len=40)
    train, _ = split(docs)
    rows = PackedSamples(docs, train, SEQ, 4, True)
    pieces = DocumentPieces(docs, train, 16, 4, True)
    for epoch in range(2):
        first, seen, order_read = epoch * pieces.tokens_per_epoch, [], []
        while first < (epoch + 1) * pieces.tokens_per_epoch:
            step, first = pieces.step(first, budget=100)
            assert sum(length for _, _, length in step) <= 100
            for doc, start, length in step:
                assert 1 <= length <= 16 and (start % 16 == 0)
                assert pieces.tokens(doc, start, length).tolist() == [
                    doc * 1000 + i for i in range(start, start + length + 1)
                ]
                seen += [(doc, i) for i in range(start, start + length)]
                if not order_read or order_read[-1] != doc:
                    order_read.append(doc)
        assert first == (epoch + 1) * pieces.tokens_per_epoch
        # Every (input, label) pair of every training document once; documents of one token hold none.
        want = sorted((d, i) for d in documents_of(docs, train) for i in range(int(docs.lengths[d]) - 1))
        assert sorted(seen) == want
        with_pairs = [d for d in epoch_documents(rows, epoch)[0] if docs.lengths[d] > 1]
        assert order_read[: len(with_pairs)] == with_pairs


def test_a_piece_count_of_data_order_1_resumes_at_that_piece():
    """Order 1 counted token batching's position in pieces: piece n of the brute-force list of every piece of
    every epoch (documents in the order, each cut every max_len pairs) starts where position_of_piece says."""
    docs = numbered_documents(200, min_len=1, max_len=70)
    pieces = DocumentPieces(docs, np.arange(200), 16, 7, True)
    starts, at = [], 0
    for epoch in range(2):
        for doc in np.arange(200)[np.random.default_rng([7, 0, epoch]).permutation(200)]:
            for start in range(0, int(docs.lengths[doc]) - 1, 16):
                starts.append(at)
                at += min(16, int(docs.lengths[doc]) - 1 - start)
    for n in [0, 1, 17, len(starts) // 2 - 1, len(starts) // 2, len(starts) - 1]:
        assert pieces.position_of_piece(n) == starts[n]


def document_loader(docs, blocks):
    pieces = DocumentPieces(docs, blocks, 16, 7, True)
    return DocumentBatchLoader(pieces, 100, "tokens", CostModel(1e-6, 1e-4, 1e-3), Target((64,)), Placement(64), 0)


def test_a_checkpoint_of_data_order_1_resumes_and_says_so_once_where_the_order_changed(small_blocks, caplog):
    small, large = numbered_documents(40), numbered_documents(3000, max_len=12)
    rows = lambda docs: GlobalBatchLoader(  # noqa: E731
        [PackedSamples(docs, np.arange(len(docs.block_offsets) - 1), SEQ, 0, True)],
        Blend([1.0]),
        4,
        range(4),
        [4],
        True,
    )
    old = {"next_sample": 40, "global_batch": 4}  # what titan wrote before data order 2
    with caplog.at_level(logging.WARNING, logger="titan"):
        loader = rows(small)  # one document per block: the same order, nothing to say
        loader.load_state_dict(old)
        assert loader.next_sample == 40 and not caplog.records
        loader = rows(large)
        loader.load_state_dict(old)
        assert loader.next_sample == 40
        (record,) = caplog.records
        assert "data order changed" in record.getMessage() and "\n" not in record.getMessage()
        caplog.clear()
        loader.load_state_dict(loader.state_dict())  # this titan's own checkpoint
        batches = document_loader(large, np.arange(64))
        batches.load_state_dict({"next_piece": 5, "budget": 100})
        assert batches.next_token == batches.pieces.position_of_piece(5)
        assert [r.getMessage().startswith("data order changed") for r in caplog.records] == [True]
    with pytest.raises(ConfigError, match="newer than this titan"):
        loader.load_state_dict({**old, "order": order.ORDER_VERSION + 1})


@pytest.mark.slow
def test_a_ranks_memory_does_not_grow_with_the_number_of_documents(tmp_path):
    """10^7 documents (the index alone is 80 MB on disk, 240 MB for data order 1's arrays of three int64 per
    document): the memory the loader allocates stays that of 2^20 blocks, the same as for 2 * 10^6 documents."""
    peaks = {}
    for n in (2 * 10**6, 10**7):
        folder = tmp_path / f"index-{n}"
        subprocess.run(
            [sys.executable, "scripts/synthetic_index.py", "make", str(folder), "--documents", str(n)],
            cwd=ROOT, check=True, capture_output=True,
        )  # fmt: skip
        from titan.data.prepared import PreparedDocuments

        tracemalloc.start()
        documents = PreparedDocuments(folder)
        train = order.hold_out(documents, 0.01)[0]
        loader = GlobalBatchLoader(
            [PackedSamples(documents, train, 2047, 0, True)], Blend([1.0]), 64, range(8), [8], True
        )
        for sample in (0, 10**6, 10**8, 10**10):
            loader.load_state_dict({"next_sample": sample, "order": order.ORDER_VERSION})
            next(loader)
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        del loader, documents
    assert peaks[10**7] < 1.25 * peaks[2 * 10**6], peaks
    assert peaks[10**7] < 0.5 * 24 * 10**7, peaks


def split_by_build_loaders(documents, monkeypatch, tmp_path) -> tuple[set[int], set[int]]:
    """(training, validation) documents of a source as titan.data.build_loaders splits it."""
    overrides = tiny_overrides(tmp_path, **{"validation.interval": "1", "training.seq_len": "15"})
    monkeypatch.setattr(titan.data, "open_prepared", lambda config, source: documents)
    loaders = titan.data.build_loaders(load_config(DEBUG_RECIPE, overrides), 4, range(4), [4])
    read = lambda loader: {int(d) for docs, _ in loader.sources[0].order.windows(0) for d in docs}  # noqa: E731
    return read(loaders[0]), read(loaders[1])


@pytest.mark.parametrize("n", [64, 64 * 40], ids=["one_document_per_block", "several_documents_per_block"])
def test_appending_a_document_keeps_every_old_document_on_its_side_of_the_split(small_blocks, monkeypatch, tmp_path, n):
    """A source that grows by one document: at 64 (here MAX_BLOCKS) documents the blocks go from one document
    to two, at 64 x 40 from 40 to 41, and neither moves an old document between training and validation."""
    train, validation = split_by_build_loaders(numbered_documents(n, max_len=12), monkeypatch, tmp_path)
    assert validation and train | validation == set(range(n)) and not train & validation
    grown = split_by_build_loaders(numbered_documents(n + 1, max_len=12), monkeypatch, tmp_path)
    assert grown[0] - {n} == train and grown[1] - {n} == validation


def test_a_checkpoint_of_data_order_2_resumes_and_says_so_only_where_the_split_changed(small_blocks, caplog):
    """Order 3 holds validation out by document, not by block: the split of a source of more than MAX_BLOCKS
    documents changed, so its checkpoint resumes with one warning; a smaller source's did not, so silently."""
    for n, warned in ((40, False), (3000, True)):
        docs = numbered_documents(n, max_len=12)
        loader = GlobalBatchLoader(
            [PackedSamples(docs, np.arange(len(docs.block_offsets) - 1), SEQ, 0, True)], Blend([1.0]), 4, range(4),
            [4], True,
        )  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="titan"):
            loader.load_state_dict({"next_sample": 40, "global_batch": 4, "order": 2})
        assert loader.next_sample == 40
        assert [r.getMessage().startswith("data order changed") for r in caplog.records] == [True] * warned


def test_at_2_20_documents_one_more_moves_no_document_between_training_and_validation(monkeypatch, tmp_path):
    """The real sizes: 2^20 documents in blocks of one, then one more in blocks of two (synthetic indexes of the
    same lengths)."""
    from titan.data.prepared import PreparedDocuments

    splits = []
    for n in (order.MAX_BLOCKS, order.MAX_BLOCKS + 1):
        folder = tmp_path / f"index-{n}"
        subprocess.run(
            [sys.executable, "scripts/synthetic_index.py", "make", str(folder), "--documents", str(n)],
            cwd=ROOT, check=True, capture_output=True,
        )  # fmt: skip
        splits.append(split_by_build_loaders(PreparedDocuments(folder), monkeypatch, tmp_path))
    (train, validation), (grown_train, grown_validation) = splits
    assert abs(len(validation) / order.MAX_BLOCKS - 0.05) < 0.002
    assert grown_train - {order.MAX_BLOCKS} == train and grown_validation - {order.MAX_BLOCKS} == validation
