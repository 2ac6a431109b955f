"""The gateway's processes (``python -m gateway``, ``python -m gateway.http``) run transformers for a tokenizer
only, as their image has them (docker/gateway.Dockerfile installs no torch). Where torch is installed beside them
(one environment for the whole cluster, as scripts/up.py runs it), transformers imports it all the same: ~2 s more
of start-up a process and ~300 MiB resident against ~70, for nothing the gateway runs."""

from __future__ import annotations

import os
import sys


def keep_torch_out() -> None:
    """Make ``import torch`` fail in this process as where it is not installed (transformers tokenizes as in the
    image), unless something imported it already. For a process's entry point, never an import: a process that
    imports the gateway's modules beside a model (a test, a notebook) keeps its torch."""
    sys.modules.setdefault("torch", None)
    # transformers' "PyTorch was not found. Models won't be available" in every gateway's log reads as a fault.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
