"""The recipe schema: overrides, round trips, the batch arithmetic. (Bad recipes: tests/test_bad_inputs.py.)"""

import pytest

from conftest import DEBUG_RECIPE, run_titan
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


def test_every_recipe_key_is_listed_with_its_type_default_and_description():
    from titan.config import _all_keys
    from titan.config_keys import recipe_keys

    keys = {k.name: k for k in recipe_keys()}
    assert set(_all_keys()) <= set(keys)  # every key a recipe can set
    assert {"data.sources[].source", "data.sources[].weight"} <= set(keys)  # and a mixture table's
    assert [name for name, k in keys.items() if len(k.description) < 8] == []
    assert keys["training.seq_len"].type == "int" and keys["training.seq_len"].default == "256"
    assert keys["data.batching"].type == "'rows' | 'tokens'" and keys["data.batching"].default == '"rows"'
    assert "peak learning rate" in keys["optimizer.lr"].description
    assert "auto: from the files' suffixes" == keys["validation.format"].description  # DataSource's meaning


def test_config_keys_prints_a_section_and_names_the_sections_when_one_is_wrong():
    listed = run_titan("config", "keys", "training")
    assert listed.returncode == 0, listed.stderr
    assert "training.seq_len: int = 256\n    tokens per sequence" in listed.stdout
    assert "optimizer.lr" not in listed.stdout
    wrong = run_titan("config", "keys", "trainig")
    assert_one_line_error(wrong, "no section 'trainig'", "training")
