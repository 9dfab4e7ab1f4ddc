"""The data plane from the user's side: prepared sources, mixtures, validation, resume, and one-line errors."""

import json
import math
import time

import pytest
import torch
import torch.nn.functional as F

from conftest import DEBUG_RECIPE, run_titan, tiny_overrides
from helpers import assert_one_line_error
from titan.config import load_config
from titan.data import IGNORE, build_loaders
from titan.data.order import EpochOrder
from titan.data.prepared.read import PreparedDocuments
from titan.tools.compare import load_run
from titan.train.build import build_model
from titan.train.trainer import Trainer


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_training_logs_validation_loss_and_perplexity(tmp_path):
    overrides = tiny_overrides(
        tmp_path,
        **{
            "training.steps": "4",
            "validation.interval": "2",
            "validation.fraction": "0.1",
            "validation.steps": "2",
            "model.overrides.n_layers": "1",
        },
    )
    result = run_titan("train", "--config", str(DEBUG_RECIPE), *overrides)
    assert result.returncode == 0, result.stderr
    validation = [r for r in records(tmp_path / "debug") if "val_loss" in r]
    assert [r["step"] for r in validation] == [2, 4]
    assert all(r["val_perplexity"] == pytest.approx(math.exp(r["val_loss"])) for r in validation)
    assert validation[1]["val_loss"] < validation[0]["val_loss"]  # it learns
    assert "step 4 validation: loss" in result.stderr


def test_validation_loss_is_the_mean_token_loss_over_the_held_out_documents(tmp_path):
    overrides = tiny_overrides(
        tmp_path,
        **{
            "validation.interval": "5",
            "validation.fraction": "0.1",
            "validation.steps": "3",
            "model.overrides.n_layers": "1",
        },
    )
    config = load_config(DEBUG_RECIPE, overrides)
    trainer = Trainer(config)
    # Reference: the plain model on the validation batches, summing token losses by hand.
    model = build_model(config, torch.device("cpu")).eval()
    loader = build_loaders(config, 4, range(4), [4])[1]
    total, count = 0.0, 0
    with torch.no_grad():
        for step in range(3):
            (batch,) = loader.batches_at(step * 4)
            logits = model(batch.inputs, batch.rows, batch.document_ids)
            keep = batch.labels != IGNORE
            total += F.cross_entropy(logits[keep], batch.labels[keep], reduction="sum").item()
            count += int(keep.sum())
    assert trainer.evaluate() == pytest.approx(total / count, rel=1e-6)
    # The held-out documents are never trained on: no validation window appears in the training epoch.
    train_loader = trainer.loader
    train_windows = {
        tuple(train_loader.sources[0].sample(k)[0]) for k in range(train_loader.sources[0].samples_per_epoch)
    }
    held = loader.sources[0]
    assert not any(tuple(held.sample(k)[0]) in train_windows for k in range(held.samples_per_epoch))


def test_a_mixture_blends_sources_by_weight_and_logs_the_realised_shares(tmp_path):
    other = tmp_path / "other.txt"
    other.write_text("\n".join(f"line {i} of another source, with words of its own." for i in range(400)) + "\n")
    recipe = tmp_path / "mix.toml"
    recipe.write_text(
        DEBUG_RECIPE.read_text()
        + f"""
[[data.sources]]
source = "data/stories.jsonl"
weight = 3.0

[[data.sources]]
source = "{other}"
weight = 1.0
text_unit = "line"
"""
    )
    result = run_titan(
        "train",
        "--config",
        str(recipe),
        *tiny_overrides(tmp_path, **{"training.steps": "2", "model.overrides.n_layers": "1"}),
    )
    assert result.returncode == 0, result.stderr
    assert "data data/stories.jsonl:" in result.stderr and "weight 0.750, realised 0.750" in result.stderr
    assert f"data {other}:" in result.stderr and "weight 0.250, realised 0.250" in result.stderr
    # The run's saved recipe is TOML that loads back, and what `titan compare` reads.
    saved = load_config(tmp_path / "debug" / "config.toml").data.sources
    assert [(s.source, s.weight) for s in saved] == [("data/stories.jsonl", 3.0), (str(other), 1.0)]
    assert load_run(tmp_path / "debug").config["data.sources"][1]["source"] == str(other)


def test_resuming_a_prepared_corpus_far_into_training_orders_one_epoch_and_reads_one_batch(tmp_path, monkeypatch):
    """Thousands of epochs of the prepared corpus in, a resumed loader orders only the epoch its batch lies in
    and reads only the batch's tokens from the memory map."""
    ordered, read = [], []
    order_epoch, read_tokens = EpochOrder._epoch, PreparedDocuments.tokens
    monkeypatch.setattr(EpochOrder, "_epoch", lambda self, epoch: ordered.append(epoch) or order_epoch(self, epoch))
    monkeypatch.setattr(PreparedDocuments, "tokens", lambda *args: read.append(read_tokens(*args)) or read[-1])
    config = load_config(DEBUG_RECIPE, tiny_overrides(tmp_path))
    loader, _ = build_loaders(config, 8, range(8), [4, 4])
    ordered.clear()
    loader.load_state_dict({"next_sample": 10_000_000})
    next(loader)
    (samples,) = loader.sources
    assert len(set(ordered)) == 1 and ordered[0] == 10_000_000 // samples.samples_per_epoch > 1000
    assert sum(map(len, read)) == 8 * (config.training.seq_len + 1)


@pytest.mark.benchmark
def test_resuming_a_prepared_corpus_far_into_training_takes_well_under_a_second(tmp_path):
    config = load_config(DEBUG_RECIPE, tiny_overrides(tmp_path))
    loader, _ = build_loaders(config, 8, range(8), [4, 4])
    start = time.perf_counter()
    loader.load_state_dict({"next_sample": 10_000_000})  # thousands of epochs of this corpus in
    next(loader)
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize(
    "extra,content,words",
    [
        ({"data.sources": '[{source = "data/stories.jsonl", weight = 0.0}]'}, None, ["data.sources[0].weight", "> 0"]),
        ({"data.sources": '[{source = "data/stories.jsonl", weight = -1.0}]'}, None, ["data.sources[0].weight"]),
        (
            {"validation.interval": "2", "validation.fraction": "0.9999"},
            None,
            ["validation.fraction = 0.9999", "data source"],
        ),
        (
            {"validation.interval": "2", "validation.fraction": "0.0"},
            None,
            ["validation.fraction = 0.0", "validation.source"],
        ),
        ({"validation.fraction": "1.0"}, None, ["validation.fraction", "[0, 1)"]),
        ({}, "", ["has no documents"]),
        ({}, '{"text": ""}\n{"text": "   "}\n', ["empty"]),
        ({}, '{"text": "fine"}\n{"text": "also fine"}\n{"text": broken\n', ["corpus.jsonl", "line 3"]),
        ({}, b'{"text": "a\x00b"}\n\xff\xfe\x00\x01', ["corpus.jsonl"]),
    ],
    ids=[
        "weight_zero",
        "weight_negative",
        "split_leaves_no_training_data",
        "validation_without_held_out_data",
        "fraction_one",
        "empty_source",
        "only_empty_texts",
        "malformed_record",
        "binary_data",
    ],
)
def test_bad_data_gives_one_line_error(tmp_path, extra, content, words):
    if content is not None:
        path = tmp_path / "corpus.jsonl"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        extra = {"data.source": str(path), **extra}
    result = run_titan("train", "--config", str(DEBUG_RECIPE), *tiny_overrides(tmp_path, **extra))
    assert_one_line_error(result, *words)


def test_a_hub_dataset_shows_its_records_against_the_total_its_card_declares(tmp_path, monkeypatch, capsys):
    """A dataset in the hub's layout (data files and a README card), read as a hub dataset: the progress counts
    records, against the split's size where the card has one."""
    from titan import progress
    from titan.config import DataSource
    from titan.data.dataset import iter_texts, open_documents

    monkeypatch.setattr(progress, "LOG_EVERY_S", 0.0)  # a line at every record
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(40)))
    card = (
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train.jsonl\n"
        "dataset_info:\n  features:\n  - name: text\n    dtype: string\n  splits:\n  - name: train\n"
        "    num_examples: 40\n    num_bytes: 400\n---\n"
    )
    for declared in (True, False):
        (tmp_path / "README.md").write_text(card if declared else card[: card.index("dataset_info")] + "---\n")
        texts = list(iter_texts(open_documents(DataSource(source=str(tmp_path), format="hub"))))
        assert texts == [f"doc {i}" for i in range(40)]
        what = f"{tmp_path} (train): "
        lines = [line.split(" ", 1)[1] for line in capsys.readouterr().err.splitlines() if what in line]
        assert lines[0].startswith(what + ("1 of 40 records (2%)" if declared else "1 records, "))
        assert lines[-2].startswith(what + ("40 of 40 records (100%)" if declared else "40 records, "))
        assert lines[-1].startswith(what + "done") and len(lines) == 41
