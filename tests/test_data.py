"""The data pipeline: packing, resumable state, disjoint data-parallel shards, and clear errors."""

import json

import pytest
import torch

from conftest import DEBUG_RECIPE, run_titan, tiny_overrides
from titan.config import ConfigError, load_config
from titan.data import PackedLoader, Tokenizer, build_loader

DOCS = [f"document {i} " + "word " * (i % 7) for i in range(23)]


def char_encode(text: str) -> list[int]:
    return [1, *(ord(c) for c in text), 2]  # BOS, characters, EOS


def make_loader(docs=DOCS, rank=0, size=1, seq_len=16, batch=2, encode=char_encode):
    return PackedLoader(lambda: iter(docs), encode, seq_len=seq_len, batch_size=batch, dp_rank=rank, dp_size=size)


def test_sequences_are_the_concatenated_documents_cut_into_windows():
    loader = make_loader()
    stream = [t for d in DOCS for t in char_encode(d)]
    n = len(stream) // 17
    got = torch.cat([loader.next_sequence() for _ in range(n)])
    assert got.tolist() == stream[: 17 * n]


def test_inputs_and_labels_are_shifted_by_one():
    inputs, labels = next(make_loader())
    assert inputs.shape == labels.shape == (2, 16)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])


@pytest.mark.parametrize("stop_after", [0, 1, 5, 13, 40])  # 40 batches span several epochs
def test_resume_from_state_dict_yields_exactly_the_uninterrupted_sequences(stop_after):
    reference = make_loader()
    expected = [next(reference) for _ in range(stop_after + 10)]
    first = make_loader()
    for _ in range(stop_after):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # the state must survive serialisation
    resumed = make_loader()
    resumed.load_state_dict(state)
    for want in expected[stop_after:]:
        got = next(resumed)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_resume_on_the_real_corpus_and_tokenizer():
    cfg = load_config(DEBUG_RECIPE, ["--training.seq_len", "64", "--training.local_batch_size", "4"])
    tokenizer = Tokenizer(cfg.tokenizer)
    straight = build_loader(cfg, tokenizer)
    expected = [next(straight)[0] for _ in range(12)]
    first = build_loader(cfg, tokenizer)
    for _ in range(7):
        next(first)
    resumed = build_loader(cfg, tokenizer)
    resumed.load_state_dict(first.state_dict())
    assert all(torch.equal(next(resumed)[0], want) for want in expected[7:])


def test_data_parallel_ranks_read_disjoint_documents_covering_the_stream():
    seen = {0: [], 1: []}

    def recording(rank):
        return lambda text: (seen[rank].append(text), char_encode(text))[1]

    loaders = [make_loader(rank=r, size=2, encode=recording(r)) for r in (0, 1)]
    for _ in range(30):  # several epochs
        for loader in loaders:
            next(loader)
    assert loaders[0].state_dict()["epoch"] >= 2
    assert not set(seen[0]) & set(seen[1])
    assert set(seen[0]) | set(seen[1]) == set(DOCS)


def test_same_seed_same_order():
    a, b = make_loader(), make_loader()
    assert all(torch.equal(next(a)[0], next(b)[0]) for _ in range(5))


def test_empty_dataset_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg = load_config(DEBUG_RECIPE, ["--data.source", str(empty)])
    with pytest.raises(ConfigError, match="has no documents"):
        build_loader(cfg, Tokenizer(cfg.tokenizer))


def test_fewer_documents_than_ranks_is_a_clear_error():
    with pytest.raises(ConfigError, match="fewer than the data-parallel size"):
        next(make_loader(docs=["only one"], rank=1, size=2))


def test_missing_text_field_is_a_clear_error(tmp_path):
    path = tmp_path / "other.jsonl"
    path.write_text(json.dumps({"body": "hello"}) + "\n")
    cfg = load_config(DEBUG_RECIPE, ["--data.source", str(path)])
    with pytest.raises(ConfigError, match="no field 'text'; fields: body"):
        build_loader(cfg, Tokenizer(cfg.tokenizer))


@pytest.mark.parametrize("fmt", ["text", "parquet"])
def test_text_and_parquet_files_load(tmp_path, fmt):
    texts = ["the cat sat", "a dog ran far away", "birds sing"]
    if fmt == "text":
        path = tmp_path / "corpus.txt"
        path.write_text("\n".join(texts) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "corpus.parquet"
        pq.write_table(pa.table({"content": texts}), path)
    cfg = load_config(DEBUG_RECIPE, ["--data.source", str(path), "--data.text_field", "content" if fmt == "parquet" else "text"])
    tokenizer = Tokenizer(cfg.tokenizer)
    loader = build_loader(cfg, tokenizer)
    loader.seq_len = 8
    first = loader.next_sequence().tolist()
    assert first == [t for text in texts for t in tokenizer.encode(text)][:9]


def test_unreachable_hub_dataset_is_a_clear_error(tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = run_titan("train", "--config", str(DEBUG_RECIPE), *tiny_overrides(tmp_path, **{"data.source": "nobody/no-such-dataset"}), env=env, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "data.source: could not open hub dataset 'nobody/no-such-dataset'" in result.stderr
