# syntax=docker/dockerfile:1
# The gateway: admission, per-tier Redis queues, dispatch to workers (python -m gateway); the same image runs
# the OpenAI-compatible HTTP front door (python -m gateway.http, the compose `http` service).
# Build from the repository root:  docker build -f docker/gateway.Dockerfile -t tiered-serve-gateway .
#
# Slim, and without torch: the gateway and the front door never import it (they import common, never worker;
# tests/test_compose.py checks this), and the extras installed here ([gateway,http]) do not depend on it.
# transformers (for the tokenizer) runs without torch.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Only what the package needs: no worker/ (the gateway must not depend on it), no tests, data or models.
# README.md is read by the build backend (project.readme).
COPY pyproject.toml README.md /src/
COPY common /src/common
COPY gateway /src/gateway
RUN pip install "/src[gateway,http]" \
    && rm -rf /src \
    && python -c "import importlib.util as u; assert u.find_spec('torch') is None, 'torch installed'" \
    && python -c "import sys, gateway.__main__, gateway.server, gateway.http.app; assert 'torch' not in sys.modules"

# Non-root. The Hugging Face cache (the tokenizer) is a named volume mounted on this directory: creating
# it here, owned by the user, makes a fresh volume start with that ownership.
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin app \
    && mkdir -p /home/app/.cache/huggingface \
    && chown -R app:app /home/app/.cache
USER app
WORKDIR /home/app

# 5555: SDK clients; 5556: workers (ZeroMQ); 9101: the gateway's /metrics; 8000: the HTTP front door.
EXPOSE 5555 5556 8000 9101
ENTRYPOINT ["python", "-m", "gateway"]
CMD ["--log-level", "INFO"]
