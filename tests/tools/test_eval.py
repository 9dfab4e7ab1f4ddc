"""`titan eval`: the perplexity of a checkpoint against the trainer's validation loss and a hand loop over the
documents, and lm-eval-harness on titan's model against log-likelihoods computed token by token, through a local
task file over a local dataset (no network).

One tiny run trains a few steps with a held-out validation source and checkpoints; every test scores its checkpoint.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, run_titan
from helpers import assert_one_line_error, trainer_for
from titan.checkpoint.hf import checkpoint_tokenizer
from titan.config import DataSource
from titan.tools.generate import generate, load_model
from titan.tools.perplexity import Limits, perplexity
from titan.train import harness

BATCH, BATCHES = 4, 3  # the run's validation: 3 global batches of 4 sequences of 32 tokens
CHOICES = [
    {"query": "Once upon a time there was a", "choices": [" little", " dog", " boxes"], "label": 0},
    {"query": "He lived on a farm near the", "choices": [" hills", " sea", " moon"], "label": 0},
    {"query": "One day, Henry and his grandma walked to the", "choices": [" park", " was", " friendly"], "label": 0},
    {"query": "The dog", "choices": [" ran", " sky blue green"], "label": 1},
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(the step-5 checkpoint, its held-out source, the trainer's validation loss on it at step 5)."""
    root = tmp_path_factory.mktemp("eval")
    held = root / "held.jsonl"
    held.write_text("".join((ROOT / "data" / "stories.jsonl").read_text().splitlines(keepends=True)[-40:]))
    trainer = trainer_for(
        root,
        **{"training.steps": "5", "lr_scheduler.warmup_steps": "0", "optimizer.lr": "1e-2",
           "checkpoint.enable": "true", "validation.source": str(held), "validation.interval": "5",
           "validation.steps": str(BATCHES), "training.local_batch_size": str(BATCH)},
    )  # fmt: skip
    trainer.train()
    return root / "debug" / "checkpoints" / "step-5", held, trainer.report.val_loss


@pytest.fixture(scope="module")
def loaded(run):
    return load_model(run[0], torch.device("cpu"))


@pytest.fixture(scope="module")
def tokenizer(run, loaded):
    return checkpoint_tokenizer(run[0], loaded.model.args.vocab_size)


def test_perplexity_is_the_trainers_validation_loss(run, tmp_path):
    checkpoint, held, val_loss = run
    out = tmp_path / "results.json"
    args = ["--batches", str(BATCHES), "--batch-size", str(BATCH), "--output", str(out)]
    result = run_titan("eval", "--checkpoint", str(checkpoint), "--data", str(held), *args)
    assert result.returncode == 0, result.stderr
    scored = json.loads(out.read_text())["perplexity"]
    assert scored["loss"] == pytest.approx(val_loss, rel=1e-5) and scored["seq_len"] == 32
    assert scored["perplexity"] == pytest.approx(math.exp(val_loss), rel=1e-5)
    assert f"perplexity {scored['perplexity']:.4f} (loss {scored['loss']:.4f})" in result.stdout


def test_perplexity_is_a_hand_loop_over_each_document(run, loaded, tokenizer):
    """The held-out documents in order, as BOS + text + EOS, cut into windows of 33 tokens; each document's piece
    of a window run through the model alone (document masking: it sees nothing else, and its positions start at
    0), every token of the piece but the first predicted."""
    _, held, _ = run
    stream = [t for line in held.read_text().splitlines() for t in tokenizer.encode(json.loads(line)["text"])]
    loss, count = 0.0, 0
    with torch.no_grad():
        for w in range(BATCH * BATCHES):
            window = torch.tensor(stream[w * 33 : (w + 1) * 33])
            starts = [0, *(i for i in range(1, 33) if window[i] == tokenizer.bos_id), 33]
            for start, stop in zip(starts[:-1], starts[1:]):
                piece = window[start:stop]
                if len(piece) > 1:
                    logits = loaded.model(piece[None, :-1])[0]
                    loss += F.cross_entropy(logits, piece[1:], reduction="sum").item()
                    count += len(piece) - 1
    scored = perplexity(loaded, DataSource(str(held)), Limits(batch_size=BATCH, batches=BATCHES))
    assert scored.tokens == count and scored.loss == pytest.approx(loss / count, rel=1e-5)


def token_by_token(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """log p(continuation | BOS + context), one forward per continuation token, each of its prefix alone."""
    whole, prefix = tokenizer.encode(context + continuation)[:-1], tokenizer.encode(context)[:-1]
    logprob, greedy = 0.0, True
    with torch.no_grad():
        for k in range(len(prefix), len(whole)):
            scores = model(torch.tensor([whole[:k]]))[0, -1].log_softmax(-1)
            logprob += scores[whole[k]].item()
            greedy &= scores.argmax().item() == whole[k]
    return logprob, greedy


def requests(kind: str, arguments: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(arguments)]


def test_loglikelihoods_are_the_models_token_by_token(loaded, tokenizer):
    lm = harness.lm_class()(
        loaded.model.eval(), tokenizer, batch_size=3
    )  # batches of contexts of several lengths, padded
    pairs = [(doc["query"], choice) for doc in CHOICES for choice in doc["choices"]]
    found = lm.loglikelihood(requests("loglikelihood", pairs))
    for pair, (logprob, greedy) in zip(pairs, found):
        expected, expected_greedy = token_by_token(loaded.model, tokenizer, *pair)
        assert logprob == pytest.approx(expected, rel=1e-5, abs=1e-4) and greedy == expected_greedy
    text = CHOICES[2]["query"]
    rolling = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(text,)]))[0]
    assert rolling == pytest.approx(token_by_token(loaded.model, tokenizer, "", text)[0], rel=1e-5)


def test_generate_until_is_titans_greedy_decoding_cut_at_the_stop(loaded, tokenizer):
    lm = harness.lm_class()(loaded.model.eval(), tokenizer, batch_size=2)
    contexts = ["Once upon a time", "The dog ran to the park and"]
    found = lm.generate_until(requests("generate_until", [(c, {"until": ["."], "max_gen_toks": 12}) for c in contexts]))
    for context, text in zip(contexts, found):
        tokens = generate(loaded.model, [tokenizer.encode(context)[:-1]], 12, eos_id=tokenizer.eos_id).tokens[0]
        assert text == tokenizer.decode([t for t in tokens if t != tokenizer.eos_id]).split(".")[0]


def test_a_local_task_file_runs_offline_and_scores_what_the_model_prefers(run, loaded, tokenizer, tmp_path):
    """A multiple-choice task of four documents in a local jsonl, named by a YAML file under --include-path; the hub
    is unreachable. Its documents pass through a `process_docs: !function` of the folder's helpers.py: refused in
    one line, before anything loads, until --allow-task-code. Its accuracy is that of the choices the
    token-by-token log-likelihoods prefer."""
    (tmp_path / "tasks").mkdir()
    docs = tmp_path / "tasks" / "tiny.jsonl"
    docs.write_text("".join(json.dumps(doc) + "\n" for doc in CHOICES))
    (tmp_path / "tasks" / "helpers.py").write_text("def process_docs(dataset):\n    return dataset\n")
    (tmp_path / "tasks" / "tiny.yaml").write_text(
        f"task: titan_tiny_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {docs}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{query}}'\ndoc_to_target: label\n"
        "doc_to_choice: choices\nmetric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "process_docs: !function helpers.process_docs\n"
    )
    args = [
        "eval",
        "--checkpoint",
        str(run[0]),
        "--tasks",
        "titan_tiny_choice",
        "--include-path",
        str(tmp_path / "tasks"),
    ]
    refused = run_titan(*args)
    assert_one_line_error(
        refused,
        "a task file is code",
        f"tiny.yaml: process_docs: !function helpers.process_docs ({tmp_path / 'tasks' / 'helpers.py'})",
        "--allow-task-code",
    )
    out = tmp_path / "results.json"
    offline = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    result = run_titan(*args, "--allow-task-code", "--output", str(out), env=offline)
    assert result.returncode == 0, result.stderr
    right = [
        max(
            range(len(doc["choices"])),
            key=lambda c: token_by_token(loaded.model, tokenizer, doc["query"], doc["choices"][c])[0],
        )
        == doc["label"]
        for doc in CHOICES
    ]
    assert json.loads(out.read_text())["tasks"]["titan_tiny_choice"]["acc,none"] == sum(right) / len(right)
    assert "titan_tiny_choice" in result.stdout  # the table


def test_the_code_of_a_task_is_found_through_its_includes_and_groups(tmp_path):
    """What a requested task would run: the `!function`s of its YAML, of the YAML it includes (found beside it,
    or anywhere Python looks: os.system), and of the tasks a requested group lists; a task not requested is not
    looked at."""
    folder = tmp_path / "tasks"
    (folder / "base").mkdir(parents=True)
    (folder / "base" / "shared.yaml").write_text("doc_to_text: !function os.system\n")
    (folder / "a.yaml").write_text("task: a\ninclude: base/shared.yaml\n")
    (folder / "b.yaml").write_text("task: b\nfilter_list:\n  - filter:\n      - function: !function b_utils.keep\n")
    (folder / "b_utils.py").write_text("def keep(x):\n    return x\n")
    (folder / "c.yaml").write_text("task: c\nprocess_docs: !function c_utils.drop\n")
    (folder / "group.yaml").write_text("group: both\ntask:\n  - a\n  - b\n")
    assert harness.task_code(["a"], folder) == [f"{folder / 'base' / 'shared.yaml'}: doc_to_text: !function os.system"]
    assert sorted(harness.task_code(["both"], folder)) == [
        f"{folder / 'b.yaml'}: filter_list[0].filter[0].function: !function b_utils.keep ({folder / 'b_utils.py'})",
        f"{folder / 'base' / 'shared.yaml'}: doc_to_text: !function os.system",
    ]
    assert harness.task_code(["hellaswag"], folder) == [] and harness.task_code(["a"], None) == []
