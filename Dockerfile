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
# which are built for CUDA 13.0 and bring their own cuBLAS, cuDNN and NCCL.
FROM nvidia/cuda:13.0.0-runtime-ubuntu24.04 AS base-cuda
ARG TORCH_VERSION
# Ubuntu's python3 and venv track the release's security updates; pinning them would break every rebuild.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
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
RUN pip install --no-cache-dir . && titan --help > /dev/null
COPY recipes recipes
COPY data data
COPY scripts scripts
ENTRYPOINT ["titan"]
CMD ["--help"]
