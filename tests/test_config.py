"""The recipe schema: overrides, round trips, and a clear one-line error with exit status 2 for every mistake."""

import pytest

from conftest import DEBUG_RECIPE, run_titan, tiny_overrides
from helpers import assert_one_line_error
from titan.config import ConfigError, batch_plan, load_config, to_toml


def test_overrides_convert_to_the_field_types():
    cfg = load_config(
        DEBUG_RECIPE, ["--training.steps", "70", "--optimizer.lr=1e-3", "--job.name", "123", "--job.deterministic"]
    )
    assert cfg.training.steps == 70 and cfg.optimizer.lr == 1e-3
    assert cfg.job.name == "123"  # a str field keeps the text as typed
    assert cfg.job.deterministic is True  # a bare flag means true


def test_model_overrides_table_takes_dotted_keys():
    cfg = load_config(DEBUG_RECIPE, ["--model.overrides.n_layers", "2", "--model.overrides.resid_dropout", "0.1"])
    assert cfg.model.overrides == {"n_layers": 2, "resid_dropout": 0.1}


def test_resolved_toml_loads_back_to_the_same_config(tmp_path):
    cfg = load_config(DEBUG_RECIPE, ["--training.steps", "30", "--model.overrides.n_layers", "2"])
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg


def test_int_is_accepted_for_a_float_but_not_a_bool_for_an_int():
    assert load_config(None, ["--optimizer.lr", "1"]).optimizer.lr == 1.0
    with pytest.raises(ConfigError, match="training.steps must be int"):
        load_config(None, ["--training.steps", "true"])


def test_config_show_prints_the_resolved_recipe():
    result = run_titan("config", "show", "--config", str(DEBUG_RECIPE), "--training.steps", "42")
    assert result.returncode == 0, result.stderr
    assert "steps = 42" in result.stdout and "[parallel]" in result.stdout


BAD_CONFIGS = [
    # (overrides, environment, words the one-line message must contain)
    (["--training.step", "3"], {}, ["training.step", "did you mean training.steps"]),
    (["--trainig.steps", "3"], {}, ["trainig", "did you mean training"]),
    (["--steps", "3"], {}, ["'steps'", "did you mean training.steps"]),
    (["--training.steps", "many"], {}, ["training.steps", "int", "many"]),
    (["--training.steps", "-5"], {}, ["training.steps", "positive", "-5"]),
    (["--training.seq_len", "0"], {}, ["training.seq_len", "positive"]),
    (["--optimizer.lr", "fast"], {}, ["optimizer.lr", "float", "fast"]),
    (["--lr_scheduler.decay", "exponential"], {}, ["lr_scheduler.decay", "cosine", "exponential"]),
    (
        ["--training.global_batch_size", "3"],
        {"WORLD_SIZE": "4"},
        ["global_batch_size (3)", "4 data-parallel", "at least 1"],
    ),
    (
        ["--training.global_batch_size", "10", "--training.local_batch_size", "3", "--parallel.dp_weights", "[1, 9]"],
        {"WORLD_SIZE": "2"},
        ["weighted [1.0, 9.0]", "3 micro-batches", "only 1 rows"],
    ),
    (
        ["--parallel.dp_weights", "[1, 2, 3]"],
        {"WORLD_SIZE": "2"},
        ["parallel.dp_weights has 3 entries", "2 data-parallel"],
    ),
    (["--parallel.dp_weights", "[1, 0]"], {"WORLD_SIZE": "2"}, ["parallel.dp_weights must all be > 0"]),
    (["--straggler.threshold", "0.9"], {}, ["straggler.threshold must be >= 1"]),
    (
        ["--straggler.enable", "true", "--parallel.pp", "2", "--parallel.dp_shard", "2"],
        {"WORLD_SIZE": "4"},
        ["straggler.enable", "not supported yet"],
    ),
    (["--parallel.tp", "2"], {"WORLD_SIZE": "3"}, ["tp=2", "world size 3"]),
    (["--metrics.log_freq", "0"], {}, ["metrics.log_freq"]),
    (["--optimizer.beta2", "1.5"], {}, ["beta2", "1.5"]),
]


@pytest.mark.parametrize("overrides,env,words", BAD_CONFIGS, ids=[" ".join(c[0]) for c in BAD_CONFIGS])
def test_bad_config_gives_one_line_error_naming_the_key(overrides, env, words):
    result = run_titan("config", "show", "--config", str(DEBUG_RECIPE), *overrides, env=env)
    assert_one_line_error(result, *words)


def test_missing_recipe_file():
    assert_one_line_error(run_titan("train", "--config", "recipes/nope.toml"), "recipe file not found", "nope.toml")


def test_recipe_that_is_not_toml(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps = 3\n")
    assert_one_line_error(run_titan("train", "--config", str(bad)), "bad.toml", "not valid TOML")


# Errors found while building the run (files, model), still before any training.
@pytest.mark.parametrize(
    "extra,words",
    [
        ({"tokenizer.path": "missing/tokenizer.json"}, ["tokenizer.path", "missing/tokenizer.json"]),
        ({"data.source": "missing/corpus.jsonl"}, ["data.source", "missing/corpus.jsonl"]),
        ({"data.text_field": "body"}, ["data.text_field", "'body'", "text"]),
        ({"model.flavor": "7B"}, ["model.flavor", "7B", "debug"]),
        ({"model.overrides.n_layer": "2"}, ["model.overrides.n_layer", "n_layers"]),
        ({"model.name": "gpt5"}, ["model.name", "gpt5", "llama3"]),
    ],
    ids=["tokenizer", "data", "text_field", "flavor", "model_override", "model_name"],
)
def test_bad_files_and_model_choices_fail_before_training(tmp_path, extra, words):
    result = run_titan("train", "--config", str(DEBUG_RECIPE), *tiny_overrides(tmp_path, **extra))
    assert_one_line_error(result, *words)


@pytest.mark.parametrize(
    "world,local,weights,expected",
    [
        (1, 8, [], [[8]]),
        (2, 8, [], [[4], [4]]),
        (8, 8, [], [[1]] * 8),
        (1, 2, [], [[2, 2, 2, 2]]),
        (2, 2, [], [[2, 2], [2, 2]]),
        (1, 3, [], [[3, 3, 2]]),  # 8 rows under a cap of 3: three micro-batches of near-equal size
        (2, 4, [1, 3], [[1, 1], [3, 3]]),  # uneven shares, the same number of micro-batches on each rank
    ],
)
def test_the_global_batch_is_the_contract_and_local_batch_size_a_cap(world, local, weights, expected):
    overrides = ["--training.global_batch_size", "8", "--training.local_batch_size", str(local)]
    if weights:
        overrides += ["--parallel.dp_weights", str(weights)]
    config = load_config(DEBUG_RECIPE, overrides, world_size=world)
    plan = batch_plan(config, world)  # each data-parallel rank's micro-batch sizes
    assert plan == expected
    assert sum(map(sum, plan)) == 8 and all(max(sizes) <= local for sizes in plan)
