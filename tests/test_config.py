"""The recipe schema: overrides, round trips, the batch arithmetic. (Bad recipes: tests/test_bad_inputs.py.)"""

import pytest

from conftest import DEBUG_RECIPE, run_titan
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
