# syntax=docker/dockerfile:1
# The gateway: admission, per-tier Redis queues, dispatch to workers (python -m gateway).
# Build from the repository root:  docker build -f docker/gateway.Dockerfile -t tiered-serve-gateway .
#
# Slim and CPU-only. The gateway never imports torch (it imports common, never worker; tests/test_compose.py
# checks this), but torch is a hard dependency in pyproject.toml, so the CPU wheel is installed first, pinned
# as in the Makefile: the resolver is then satisfied and never fetches a multi-GB CUDA build. transformers
# (for the tokenizer of text prompts) needs no torch.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG TORCH_VERSION=2.13.0
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu

# Only what the package needs: no worker/ (the gateway must not depend on it), no tests, data or models.
# README.md is read by the build backend (project.readme).
COPY pyproject.toml README.md /src/
COPY common /src/common
COPY gateway /src/gateway
RUN pip install /src \
    && rm -rf /src \
    && python -c "import sys, gateway.__main__, gateway.server; assert 'torch' not in sys.modules"

# Non-root. The Hugging Face cache (the tokenizer) is a named volume mounted on this directory: creating
# it here, owned by the user, makes a fresh volume start with that ownership.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin app \
    && mkdir -p /home/app/.cache/huggingface \
    && chown -R app:app /home/app/.cache
USER app
WORKDIR /home/app

# 5555: SDK clients; 5556: workers (ZeroMQ).
EXPOSE 5555 5556
ENTRYPOINT ["python", "-m", "gateway"]
CMD ["--log-level", "INFO"]
