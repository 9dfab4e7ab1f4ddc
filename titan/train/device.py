"""The device a run trains on, and its memory: what `titan config show` needs of torch, without the trainer's
imports."""

from __future__ import annotations

import os

import torch

from titan.errors import ConfigError
from titan.launcher import Launch


def pick_device(name: str) -> tuple[torch.device, str]:
    """The device training.device names, and why it is the one (the run's first log line says both)."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"training.device = 'cuda' but {_no_cuda()}; use 'auto' or 'cpu'")
    if name == "auto":
        usable = torch.cuda.is_available()
        why = "a CUDA GPU is visible" if usable else f"on the CPU, as {_no_cuda()}"
        name, why = ("cuda" if usable else "cpu"), f"training.device = 'auto': {why}"
    else:
        why = f"training.device = {name!r}"
    if name == "cuda":
        device = torch.device("cuda", Launch.from_env().local_rank)
        return device, f"{why} ({torch.cuda.get_device_name(device)}, torch {torch.__version__})"
    return torch.device("cpu"), why


def _no_cuda() -> str:
    """Why torch sees no usable CUDA GPU."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hidden = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU{hidden}: check nvidia-smi"


def device_memory(device: torch.device) -> int:
    """Bytes of memory the rank's device has: a GPU's own, or on a CPU the host's, shared by the node's ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // Launch.from_env().local_world
