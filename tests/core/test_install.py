"""titan on an image that brings its own torch and little else: the torch versions it accepts, every torch name it
uses present on this torch, and training with the heavy optional packages unimportable."""

import ast
import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import DEBUG_RECIPE, ROOT, tiny_overrides
from helpers import assert_one_line_error
from titan.cli import check_torch
from titan.errors import UserError

# What `pip install --no-deps titan-pretrain` into a CUDA image leaves out: the extras, and what datasets brings.
HEAVY = ("datasets", "wandb", "tensorboard", "matplotlib", "torchao", "pyarrow", "pandas")


def torch_names_titan_uses() -> set[str]:
    """Every `from torch... import name`, `import torch...` and `torch.a.b` chain in titan's code, as dotted
    names."""
    names = set()
    for file in (ROOT / "titan").rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names if a.name.split(".")[0] == "torch")
            elif isinstance(node, ast.Attribute):
                chain, base = [], node
                while isinstance(base, ast.Attribute):
                    chain.append(base.attr)
                    base = base.value
                if isinstance(base, ast.Name) and base.id == "torch":
                    names.add(".".join(["torch", *reversed(chain)]))
    return names


def resolves(name: str) -> bool:
    """Whether a dotted name is a module, or an attribute reached from the longest importable module prefix."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attr in parts[split:]:
                value = getattr(value, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.smoke
def test_every_torch_name_titan_uses_exists_on_this_torch():
    """Run on each torch titan supports (2.11 on the GPU image, through scripts/gpu_check.sh): a name that a release
    lacks shows here, not in the middle of a run."""
    names = torch_names_titan_uses()
    assert len(names) > 100 and "torch.distributed.fsdp.fully_shard" in names
    missing = sorted(n for n in names if not resolves(n))
    assert missing == [], f"torch {torch.__version__} lacks {missing}"


def test_the_torch_versions_titan_accepts():
    for version in ("2.11.0", "2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.13.0a0+git1234abc"):
        assert check_torch(version) is None, version
    assert "2.14.0" in check_torch("2.14.0") and "tested on torch >= 2.11 and < 2.14" in check_torch("2.14.0")
    for version, words in (("2.10.2", ["torch 2.10.2", ">= 2.11"]), (None, ["no torch"])):
        with pytest.raises(UserError) as error:
            check_torch(version)
        assert "\n" not in str(error.value) and all(w in str(error.value) for w in words)


# A sitecustomize that hides HEAVY from every import finder in the process it starts in: they are then absent, as
# on an image without them (a finder that raised instead would break torch, which looks some of them up).
BLOCKER = """
import sys

class Hiding:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)

sys.meta_path[:] = [Hiding(finder) for finder in sys.meta_path]
"""


def run_without_heavy(tmp_path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(textwrap.dedent(BLOCKER.format(blocked=set(HEAVY))))
    path = os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])
    full_env = {**os.environ, "PYTHONPATH": path, "TITAN_CACHE": str(tmp_path / "cache"), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "titan", *args], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
@pytest.mark.smoke
def test_training_needs_none_of_the_heavy_packages(tmp_path):
    """The debug recipe on a local file, with TensorBoard on and wandb credentials set, as a default run on a
    cluster image: it prepares the data, trains, and says in one line each what it left out."""
    check = run_without_heavy(tmp_path, "train", "--help")  # the blocker itself works
    probe = subprocess.run(
        [sys.executable, "-c", "import datasets"], env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
        capture_output=True, text=True,
    )  # fmt: skip
    assert check.returncode == 0 and "No module named 'datasets'" in probe.stderr, probe.stderr
    overrides = tiny_overrides(tmp_path, **{"training.steps": "3", "metrics.tensorboard": "true",
                                            "metrics.wandb": "auto"})  # fmt: skip
    result = run_without_heavy(tmp_path, "train", "--config", str(DEBUG_RECIPE), *overrides,
                               env={"WANDB_API_KEY": "not-a-key"})  # fmt: skip
    assert result.returncode == 0, result.stderr
    steps = [json.loads(line) for line in (tmp_path / "debug" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "loss" in s] == [1, 2, 3]
    assert "tensorboard: off, metrics.tensorboard needs tensorboard" in result.stderr
    assert "wandb: off, metrics.wandb needs wandb" in result.stderr
    assert "pip install 'titan-pretrain[tracking]'" in result.stderr
    assert not (tmp_path / "debug" / "tensorboard").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "command, args, words",
    [
        ("train", ["--float8.enable", "true"], ["float8.enable needs torchao", "titan-pretrain[float8]"]),
        (
            "train",
            ["--metrics.wandb", "offline"],
            ["metrics.wandb = 'offline' needs wandb", "titan-pretrain[tracking]"],
        ),
        (
            "data",
            ["--data.source", "someone/a-hub-dataset"],
            ["a-hub-dataset", "needs datasets", "titan-pretrain[hub]"],
        ),
    ],
    ids=["float8", "wandb", "hub"],
)
def test_a_feature_whose_package_is_missing_names_the_extra(tmp_path, command, args, words):
    overrides = tiny_overrides(tmp_path, **{"training.steps": "1"})
    command = ["train"] if command == "train" else ["data", "prepare"]
    result = run_without_heavy(tmp_path, *command, "--config", str(DEBUG_RECIPE), *overrides, *args)
    assert_one_line_error(result, *words)


def test_compare_plot_without_matplotlib_names_the_extra(tmp_path):
    from titan.tools import compare

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "matplotlib", None)  # None in sys.modules: the import fails
        with pytest.raises(UserError) as error:
            compare.plot([], tmp_path / "plot.png")
    assert str(error.value) == (
        "titan compare --plot needs matplotlib, which is not installed: pip install 'titan-pretrain[plot]' "
        "(or matplotlib)"
    )
