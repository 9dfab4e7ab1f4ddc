"""The recipe schema: overrides, round trips, the batch arithmetic. (Bad recipes: tests/core/test_bad_inputs.py.)"""

import dataclasses
import math
import random
import re
import tomllib
import typing
from typing import Literal

import pytest

from conftest import DEBUG_RECIPE, ROOT, run_titan, tiny_overrides
from helpers import assert_one_line_error
from titan.config import Config, load_config, read_config, to_dict, to_toml, toml_value
from titan.errors import ConfigError
from titan.run_plan import run_plan

MIXTURE = (
    DEBUG_RECIPE.read_text()
    + """
[[data.sources]]
source = "data/stories.jsonl"
weight = 3.0

[[data.sources]]
source = "titan:shakespeare"
text_field = ""
weight = 1.0
"""
)


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


# Strings TOML must escape or quote: quotes, backslashes, control characters, non-ASCII, TOML syntax.
PIECES = ["", "a", " ", "x.y", "#", '"', "'", "\\", "\n", "\r\n", "\t", "\x01", "\x7f", "é", "日本", "🙂",
          "[t]", '"""', "= 1"]  # fmt: skip


def random_string(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 4)))


SCALARS = {
    bool: lambda rng: rng.random() < 0.5,
    int: lambda rng: rng.choice([0, -1, 2**63 - 1, -(2**63), rng.randint(-(10**9), 10**9)]),
    float: lambda rng: rng.choice([0.0, -0.0, 5e-324, 1e300, math.inf, -math.inf, rng.uniform(-1, 1) * 1e9]),
    str: random_string,
}


def random_scalar(rng: random.Random):
    return SCALARS[rng.choice(list(SCALARS))](rng)


def random_table(rng: random.Random, depth: int) -> dict:
    """Nested tables as model.overrides may hold them: scalars, arrays (of tables too), tables."""
    table = {}
    for _ in range(rng.randint(0, 4)):
        kind = rng.choice(["scalar", "array", "table", "tables"] if depth else ["scalar", "array"])
        table[random_string(rng)] = {
            "scalar": lambda: random_scalar(rng),
            "array": lambda: [random_scalar(rng) for _ in range(rng.randint(0, 3))],
            "table": lambda: random_table(rng, depth - 1),
            "tables": lambda: [random_table(rng, depth - 1) for _ in range(rng.randint(1, 3))],
        }[kind]()
    return table


def random_value(rng: random.Random, tp):
    """A value of a recipe field's type: the schema's dataclasses, lists, tables, choices and scalars."""
    if dataclasses.is_dataclass(tp):
        return tp(**{name: random_value(rng, t) for name, t in typing.get_type_hints(tp).items()})
    origin = typing.get_origin(tp)
    if origin is Literal:
        return rng.choice(typing.get_args(tp))
    if origin is typing.Union:  # e.g. int | Literal["auto"]: a value of one of its types
        return random_value(rng, rng.choice(typing.get_args(tp)))
    if origin is list:
        (item,) = typing.get_args(tp)
        return [random_value(rng, item) for _ in range(rng.randint(0, 3))]
    if origin is dict:
        return random_table(rng, depth=2)
    return SCALARS[tp](rng)


@pytest.mark.parametrize("seed", range(4))
def test_every_config_loads_back_from_its_toml_as_written(tmp_path, seed):
    """Type-correct configs (validation is another matter) with mixtures, lists, nested overrides, empty and
    awkward strings: load(write(config)) == config, and each value's one-line form reads back as itself."""
    rng = random.Random(seed)
    path = tmp_path / "config.toml"
    for _ in range(100):
        config = random_value(rng, Config)
        # An empty recipe path is filled in with the file's path.
        config = dataclasses.replace(
            config, job=dataclasses.replace(config.job, recipe=config.job.recipe or "recipe.toml")
        )
        path.write_text(to_toml(config), encoding="utf-8")
        loaded = read_config(path)
        assert loaded == config and to_toml(loaded) == to_toml(config)  # the same values, of the same types
        for section in to_dict(config).values():
            for value in section.values():
                assert "\n" not in toml_value(value) and tomllib.loads(f"v = {toml_value(value)}")["v"] == value


@pytest.mark.parametrize("recipe", [*sorted(p.name for p in (ROOT / "recipes").glob("*.toml")), "mixture"])
def test_every_recipe_loads_back_from_its_resolved_toml(tmp_path, recipe):
    path = tmp_path / "recipe.toml"
    path.write_text(MIXTURE if recipe == "mixture" else (ROOT / "recipes" / recipe).read_text())
    config = read_config(path)
    path.write_text(to_toml(config))
    assert read_config(path) == config


def test_config_show_of_a_mixture_is_the_recipe_it_resolves(tmp_path):
    """What a run saves as config.toml, and what `titan compare`, `generate` and `convert` parse."""
    recipe = tmp_path / "mix.toml"
    recipe.write_text(MIXTURE)
    shown = run_titan("config", "show", "--config", str(recipe))
    assert shown.returncode == 0, shown.stderr
    resolved = tmp_path / "config.toml"
    resolved.write_text(shown.stdout)
    assert load_config(resolved) == load_config(recipe)
    assert [s["weight"] for s in tomllib.loads(shown.stdout)["data"]["sources"]] == [3.0, 1.0]


def test_a_mixture_share_no_blend_can_serve_is_refused_with_the_smallest_weight_that_works():
    mixture = lambda weight: ["--data.sources", f'[{{source = "a"}}, {{source = "b", weight = {weight!r}}}]']
    with pytest.raises(ConfigError, match="data.sources.1..weight = 1e-07") as refused:
        load_config(None, mixture(1e-7))
    smallest = float(re.search(r"at least (\S+),", str(refused.value)).group(1))
    assert load_config(None, mixture(smallest)).data.sources[1].weight == smallest
    with pytest.raises(ConfigError, match="at least"):
        load_config(None, mixture(smallest / 1.02))  # the smallest to within 2%


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
    plan = [list(sizes) for sizes in run_plan(config, world).micro_batches]  # each data-parallel rank's
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
    assert listed.stdout.startswith("[training]\n")
    assert "  training.seq_len  int = 256\n      tokens per sequence" in listed.stdout
    assert "optimizer.lr" not in listed.stdout
    wrong = run_titan("config", "keys", "trainig")
    assert_one_line_error(wrong, "no section 'trainig'", "training")


def test_titan_version_prints_the_package_version():
    from titan import __version__

    result = run_titan("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"titan {__version__}"


def test_a_tensor_parallel_degree_the_world_cannot_hold_names_the_launch():
    """dp_shard = -1 already: the error says what to launch instead of asking for -1 again, and names the key the
    user set, not the default it clashes with."""
    result = run_titan("train", "--config", str(DEBUG_RECIPE), "--parallel.tp", "3")
    assert_one_line_error(
        result,
        "--parallel.tp 3 on the command line",
        "parallel.dp_shard = -1 (the default)",
        "dp_replicate=1 x tp=3 x pp=1 = 3",
        "world size 1",
        "launch a multiple of 3",
    )


def test_a_degree_from_the_command_line_against_the_recipes_names_both_and_the_degree_that_fits(tmp_path):
    recipe = tmp_path / "fsdp4.toml"
    recipe.write_text("[parallel]\ndp_shard = 4\n")
    result = run_titan("config", "show", "--config", str(recipe), "--parallel.tp", "2", env={"WORLD_SIZE": "4"})
    assert_one_line_error(
        result,
        "--parallel.tp 2 on the command line",
        f"parallel.dp_shard = 4 ({recipe})",
        "8 processes, not the world size 4",
        "add --parallel.dp_shard 2",
    )


def help_keys(text: str) -> dict[str, tuple[str, str]]:
    """The keys a help text lists: --name -> (section heading above it, `type = default`)."""
    keys, section = {}, None
    for line in text.splitlines():
        if re.fullmatch(r"\[\[?[a-z0-9_.]+\]\]?", line):
            section = line
        elif section and (m := re.fullmatch(r"  (--[a-z0-9_.]+)  (.+)", line)):
            keys[m.group(1)] = (section, m.group(2))
    return keys


@pytest.mark.parametrize("command", [["train"], ["plan"], ["verify"], ["config", "show"]])
def test_the_help_of_a_command_that_takes_overrides_lists_every_key_by_section(command):
    """Against the schema itself: every field of every section, under its [section], with its default."""
    result = run_titan(*command, "--help")
    assert result.returncode == 0, result.stderr
    listed = help_keys(result.stdout)
    defaults = to_dict(Config())
    for section, fields in defaults.items():
        for name, value in fields.items():
            if section == "data" and name == "sources":  # and the keys of its tables, set in the recipe file
                assert "[[data.sources]]\n  data.sources[].source  str = " in result.stdout
            heading, type_default = listed.pop(f"--{section}.{name}")
            assert heading == f"[{section}]" and type_default.endswith(f" = {toml_value(value)}")
    assert listed == {}  # nothing that is not a key
    assert "  --optimizer.lr  float = 0.0003\n      the peak learning rate" in result.stdout  # its meaning under it
    # The first screen: how to override, the recipe option and its alias, the most used keys.
    first_screen = "\n".join(result.stdout.splitlines()[:30])
    for words in ("--section.key VALUE", "--config", "--job.config_file", "--training.steps", "--parallel.tp"):
        assert words in first_screen


def test_the_recipe_option_has_torchtitans_name_and_a_short_one():
    for option in ("--job.config_file", "-c"):
        result = run_titan("config", "show", option, str(DEBUG_RECIPE), "--training.steps", "7")
        assert result.returncode == 0 and "steps = 7" in result.stdout, result.stderr


def test_a_dtype_takes_titans_and_torchs_names():
    """fp32/float32 and bf16/bfloat16 name the same dtype in a recipe, as in --dtype of generate and convert."""
    for given, resolved in (("bfloat16", "bf16"), ("float32", "fp32"), ("bf16", "bf16")):
        config = load_config(DEBUG_RECIPE, ["--training.mixed_precision", given])
        assert config.training.mixed_precision == resolved
    assert 'mixed_precision = "bf16"' in to_toml(load_config(DEBUG_RECIPE, ["--training.mixed_precision", "bfloat16"]))


def test_torchtitans_names_lead_to_titans_keys():
    from titan.config.load import _all_keys
    from titan.config.torchtitan import TORCHTITAN_KEYS, TORCHTITAN_WITHOUT

    keys = set(_all_keys())
    assert not keys & (TORCHTITAN_KEYS.keys() | TORCHTITAN_WITHOUT.keys())  # a name titan shares needs no entry
    assert {ours.split()[0] for ours in TORCHTITAN_KEYS.values()} <= keys


@pytest.mark.parametrize("group", [[], ["config"], ["convert"], ["data"], ["simulate"]], ids=lambda g: g or "titan")
def test_every_command_summary_in_the_help_is_a_whole_sentence(group):
    """On an 80-column terminal, each command's line in its group's --help is its help's first paragraph, whole: one
    sentence, not cut short."""
    import typer.main

    from titan.cli.common import app

    result = run_titan(*group, "--help", env={"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    summaries = dict(re.findall(r"^  (\S+) +(.+)$", result.stdout.split("Commands:\n")[1], flags=re.M))
    commands = typer.main.get_command(app)
    for name in group:
        commands = commands.commands[name]
    for name, command in commands.commands.items():
        first = " ".join(command.help.split("\n\n")[0].split())
        assert summaries[name] == first and first.endswith(".") and first.count(". ") == 0, (name, summaries[name])


# The everyday commands, each as a newcomer runs it (on the project's local corpus), with what makes each noisy if
# anything does: for data prepare, a run shorter than the recipe's warmup (no concern of preparing data).
QUIET_COMMANDS = {
    "config show": (["config", "show"], []),
    "data prepare": (["data", "prepare"], ["--training.steps", "5", "--lr_scheduler.warmup_steps", "20"]),
    "plan --cp": (["plan"], ["--cp", "1,2", "--world-size", "2"]),
    "train, wandb offline": (["train"], ["--training.steps", "1", "--metrics.wandb", "offline"]),
}


@pytest.mark.parametrize("name", QUIET_COMMANDS)
def test_the_everyday_commands_print_no_warning(name, tmp_path):
    words, extra = QUIET_COMMANDS[name]
    result = run_titan(*words, "--config", str(DEBUG_RECIPE), *tiny_overrides(tmp_path), *extra)
    assert result.returncode == 0, result.stderr
    noise = [line for line in result.stderr.splitlines() if re.search(r"warn|warmup_steps", line, re.IGNORECASE)]
    assert not noise, noise


# A recipe as a TorchTitan user writes one for the debug model: TorchTitan's sections, key names and values.
TORCHTITAN_STYLE = """
[job]
dump_folder = "OUT"
description = "Llama 3 debug training"

[metrics]
log_freq = 1
enable_tensorboard = false
enable_wandb = false

[model]
name = "llama3"
flavor = "debugmodel"
hf_assets_path = "data"

[optimizer]
name = "AdamW"
lr = 8e-4

[lr_scheduler]
warmup_steps = 2
decay_type = "linear"
min_lr_factor = 0.0

[training]
local_batch_size = 4
seq_len = 64
max_norm = 1.0
steps = 2
dataset = "data/stories.jsonl"

[parallelism]
data_parallel_shard_degree = -1
tensor_parallel_degree = 1
enable_async_tensor_parallel = false

[activation_checkpoint]
mode = "selective"
selective_ac_option = "op"

[validation]
enable = false
freq = 5
"""

# Each mistake's line names titan's key (or says the key can go), in the recipe's order, then what the defaults
# left unset and the model's flavor.
TORCHTITAN_MISTAKES = [
    "'job.dump_folder' (TorchTitan's name; titan's is job.output_dir",
    "'job.description' (TorchTitan's; a run is named by job.name",
    "'metrics.enable_tensorboard' (TorchTitan's name; titan's is metrics.tensorboard)",
    "'metrics.enable_wandb' (TorchTitan's name; titan's is metrics.wandb",
    "'model.hf_assets_path' (TorchTitan's name; titan's is tokenizer.path",
    "optimizer.name must be one of 'adamw' | 'muon', got 'AdamW': write 'adamw'",
    "'lr_scheduler.decay_type' (TorchTitan's name; titan's is lr_scheduler.decay)",
    "'lr_scheduler.min_lr_factor' (TorchTitan's name; titan's is lr_scheduler.min_lr_ratio)",
    "'training.max_norm' (TorchTitan's name; titan's is training.max_grad_norm)",
    "'training.dataset' (TorchTitan's name; titan's is data.source)",
    "'parallelism.data_parallel_shard_degree' (TorchTitan's name; titan's is parallel.dp_shard)",
    "'parallelism.tensor_parallel_degree' (TorchTitan's name; titan's is parallel.tp)",
    "'parallelism.enable_async_tensor_parallel' (TorchTitan's; titan has no asynchronous tensor parallelism",
    "'activation_checkpoint.selective_ac_option' (TorchTitan's name; titan's is activation_checkpoint.mode",
    "'validation.enable' (TorchTitan's name; titan's is validation.interval",
    "'validation.freq' (TorchTitan's name; titan's is validation.interval",
    "the recipe names no tokenizer",
    "the recipe names no data",
    "unknown model.flavor 'debugmodel' for llama3 (did you mean debug?)",
]

# The same recipe in titan's keys, as the report says to write it.
PORTED = """
[job]
output_dir = "OUT"

[metrics]
log_freq = 1
tensorboard = false
wandb = "disabled"

[model]
name = "llama3"
flavor = "debug"
overrides = { dim = 64, n_layers = 2, n_heads = 4, n_kv_heads = 2 }

[tokenizer]
path = "data/tokenizer.json"

[optimizer]
name = "adamw"
lr = 8e-4

[lr_scheduler]
warmup_steps = 2
decay = "linear"
min_lr_ratio = 0.0

[training]
local_batch_size = 4
seq_len = 64
max_grad_norm = 1.0
steps = 2

[data]
source = "data/stories.jsonl"

[parallel]
dp_shard = -1

[activation_checkpoint]
mode = "selective"

[validation]
interval = 0
"""


def test_a_recipe_ported_from_torchtitan_is_fixed_from_one_report(tmp_path):
    """Every mistake of a TorchTitan-style recipe in one run's report, one line each with titan's name for the key
    (or why it can go), the wrong value's spelling, the inputs the recipe then lacks and the model's flavor; the
    recipe written as the report says trains."""
    recipe = tmp_path / "torchtitan_debug.toml"
    recipe.write_text(TORCHTITAN_STYLE.replace("OUT", str(tmp_path)))
    result = run_titan("train", "--config", str(recipe))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    report = result.stderr[result.stderr.index("error: ") :].splitlines()
    assert report[0] == f"error: {len(TORCHTITAN_MISTAKES)} mistakes in the recipe:"
    assert len(report) == 1 + len(TORCHTITAN_MISTAKES)
    for line, mistake in zip(report[1:], TORCHTITAN_MISTAKES):
        assert line.startswith("  - ") and mistake in line, (line, mistake)
    ported = tmp_path / "ported.toml"
    ported.write_text(PORTED.replace("OUT", str(tmp_path)))
    result = run_titan("train", "--config", str(ported))
    assert result.returncode == 0, result.stderr
    assert "step 2/2" in result.stdout + result.stderr
