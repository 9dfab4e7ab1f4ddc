"""scripts/torchft_eval.py, the torchft evaluation (docs/torchft.md): what runs without torchft, which is not a
titan dependency. The experiment itself needs torchft and is run by hand."""

import importlib.util
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "torchft_eval.py"


def test_without_torchft_it_says_so_in_one_line():
    if importlib.util.find_spec("torchft") is not None:
        pytest.skip("torchft is installed: the script would run the experiment")
    result = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines() == [
        "torchft_eval: torchft is not installed; see the top of scripts/torchft_eval.py to install it"
    ]
    assert result.stderr == ""


def test_the_groups_present_share_the_whole_global_batch():
    spec = importlib.util.spec_from_file_location("torchft_eval", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for n in range(1, script.GLOBAL_BATCH + 1):
        rows = [row for rank in range(n) for row in script.share(rank, n)]
        assert rows == list(range(script.GLOBAL_BATCH)), n
