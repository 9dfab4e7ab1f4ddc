# titan in a container: CUDA by default, or CPU-only with --build-arg VARIANT=cpu.
#
#   docker build -t titan .                                  # CUDA 13 (torch's PyPI wheels), for GPU clusters
#   docker build -t titan:cpu --build-arg VARIANT=cpu .      # CPU-only torch on python:3.11-slim, much smaller
#   docker run --rm --gpus all -v "$PWD/outputs:/opt/titan/outputs" titan train --config recipes/debug.toml
#
# The entry point is the `titan` CLI; recipes/ and data/ sit in the working directory /opt/titan.

ARG VARIANT=cuda
ARG TORCH_VERSION=2.13.0

# CUDA: NVIDIA's CUDA 13.0 runtime on Ubuntu 24.04 (its Python 3.12), torch's default wheels from PyPI,
# which are built for CUDA 13.0 and bring their own cuBLAS, cuDNN and NCCL. Triton (compiled blocks, flex attention)
# builds each kernel's launcher at run time with a C compiler against Python's headers: gcc and python3-dev, which
# the runtime base lacks (Triton brings its own ptxas). `scripts/triton_check.py` proves it on a GPU.
FROM nvidia/cuda:13.0.0-runtime-ubuntu24.04 AS base-cuda
ARG TORCH_VERSION
# Ubuntu's packages track the release's security updates; pinning them would break every rebuild.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# The toolchain Triton needs, checked at build time (no GPU needed for this part).
RUN gcc --version > /dev/null \
    && python3 -c "import os, sysconfig; assert os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h'))"
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}"

# CPU: the official Python image and torch's CPU-only wheels.
FROM python:3.11-slim-bookworm AS base-cpu
ARG TORCH_VERSION
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"

# titan itself, on whichever base VARIANT names. torch is already installed, so pip keeps that build.
# (base-cuda and base-cpu are this file's stages, each pinned above, not images that need a tag.)
# hadolint ignore=DL3006
FROM base-${VARIANT}
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/titan
COPY pyproject.toml README.md train.py ./
COPY titan titan
# Every feature's extra but the test tools: trackers, plots, hub datasets, zstd data files, Float8 (their versions
# are bounded in pyproject.toml, which hadolint does not read).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[tracking,plot,hub,zstd,float8,eval]" && titan --help > /dev/null
COPY recipes recipes
COPY data data
COPY scripts scripts
ENTRYPOINT ["titan"]
CMD ["--help"]
