"""Whether this machine's toolchain lets Inductor build a Triton kernel: Triton compiles each kernel's launcher with
the system C compiler against Python's headers at run time, so an image without them fails on the first compiled
block or flex attention call. Run it inside titan's image:

    docker run --rm --gpus all --entrypoint python3 titan scripts/triton_check.py
"""

import sys

import torch


def compile_a_triton_kernel() -> float:
    """Compile and run one small kernel on the GPU; returns its largest error against eager."""
    x = torch.randn(1024, device="cuda")
    compiled = torch.compile(lambda t: torch.sin(t) * 2 + 1)
    return (compiled(x) - (torch.sin(x) * 2 + 1)).abs().max().item()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("triton_check: no CUDA GPU visible (docker run --gpus all ...)")
    error = compile_a_triton_kernel()
    print(f"triton_check: compiled and ran a Triton kernel on {torch.cuda.get_device_name(0)} (error {error:.1e})")
    sys.exit(0 if error < 1e-5 else 1)
