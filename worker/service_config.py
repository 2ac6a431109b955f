"""Worker process configuration. Defaults here, overridden by a TOML file (--config) and then by
environment variables TS_WORKER_<KEY> (e.g. TS_WORKER_MODEL, TS_WORKER_GATEWAYS='["tcp://gw:5556"]')."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

ENV_PREFIX = "TS_WORKER_"


@dataclass(frozen=True)
class WorkerConfig:
    # Unique per worker; gateways route jobs and leases by it.
    worker_id: str = field(default_factory=lambda: f"wk-{socket.gethostname()}-{os.getpid()}")
    # Worker endpoints of every gateway (ZeroMQ); the worker connects to all of them.
    gateways: list = field(default_factory=lambda: ["tcp://127.0.0.1:5556"])
    # Model directory or hub name (any Llama/Qwen/Mistral-family causal LM).
    model: str = ""
    # "cpu", "cuda" or "cuda:N": one device per worker process.
    device: str = "cpu"
    # float32, float16 or bfloat16.
    dtype: str = "float32"
    # Batch slots: most sequences in one forward step.
    max_num_seqs: int = 16
    # Token budget of one step (prefill chunks + decodes).
    max_num_batched_tokens: int = 1024
    # KV pool in blocks of 16 tokens; 0 sizes it from kv_cache_memory_mb.
    num_kv_blocks: int = 0
    # KV pool size in MiB when num_kv_blocks is 0.
    kv_cache_memory_mb: int = 512
    # Host memory for swapped-out KV blocks.
    swap_space_mb: int = 256
    # "priority" (tiers, preemption) or "fifo".
    policy: str = "priority"
    # torch intra-op threads; 0 keeps torch's default (all cores). Several workers on one host's CPUs
    # should split the cores between them, or their thread pools spin against each other.
    torch_threads: int = 0
    # Seconds between load reports; they also extend the leases of this worker's jobs.
    heartbeat_interval_s: float = 0.5
    # This worker's CURVE key pair (a .key_secret file from `python -m common.keys`); its public half must
    # be on the gateways' allow-list. "" connects without CURVE (only an --insecure-workers gateway accepts).
    curve_secret_key_file: str = ""
    # The gateways' public key: 40 z85 characters or the path of their .key file.
    gateway_public_key: str = ""
