# syntax=docker/dockerfile:1
# A worker: one device, one model, connected to every gateway (python -m worker).
# Build from the repository root:
#   docker build -f docker/worker.Dockerfile -t tiered-serve-worker:gpu .                        (CUDA)
#   docker build -f docker/worker.Dockerfile --build-arg VARIANT=cpu -t tiered-serve-worker:cpu .  (CPU)
#
# VARIANT=gpu starts from the official CUDA PyTorch image, whose torch pip keeps (it is inside the
# project's range). It is 2.9.1, not the 2.5.1 image: transformers 5.24 disables PyTorch older than 2.6.
# CUDA 12.8 needs an NVIDIA driver >= 570 on the host; for an older driver pick another pinned tag
# with --build-arg CUDA_BASE_IMAGE=pytorch/pytorch:<torch>-cuda<12.x>-cudnn9-runtime (torch >= 2.6).
# VARIANT=cpu is a slim Python image with the pinned CPU wheel of torch (as in the Makefile), a few
# hundred MB instead of several GB, for machines without a GPU (the compose file's "cpu" profile).
ARG VARIANT=gpu
ARG CUDA_BASE_IMAGE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
ARG CPU_BASE_IMAGE=python:3.11.11-slim-bookworm

FROM ${CUDA_BASE_IMAGE} AS base-gpu

FROM ${CPU_BASE_IMAGE} AS base-cpu
ARG TORCH_VERSION=2.13.0
RUN PIP_NO_CACHE_DIR=1 pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu

# Only the base stage that VARIANT names is built.
FROM base-${VARIANT}
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Only what the package needs: no gateway/ (a worker must not depend on it), no tests, data or models.
# README.md is read by the build backend (project.readme).
COPY pyproject.toml README.md /src/
COPY common /src/common
COPY worker /src/worker
RUN pip install "/src[worker]" \
    && rm -rf /src \
    && python -c "import torch, transformers, worker.engine, worker.service; print('torch', torch.__version__)"

# Runs as root, unlike the gateway: the compose file mounts the Hugging Face cache volume (model weights,
# GBs) at /root/.cache/huggingface, the cache of the CUDA image's root user, and keeping one layout for
# both variants is worth more than a user here. The process holds no secret beyond HF_TOKEN.
ENV HF_HOME=/root/.cache/huggingface
WORKDIR /app
ENTRYPOINT ["python", "-m", "worker"]
CMD ["--log-level", "INFO"]
