"""Worker process configuration. Defaults here, overridden by a TOML file (--config), then by
environment variables TS_WORKER_<KEY> (e.g. TS_WORKER_MODEL, TS_WORKER_GATEWAYS='["tcp://gw:5556"]'),
then by command-line flags (--<key>).

The engine's keys are not repeated here: every field of ``EngineConfig`` (worker/config.py) is a key
at the top level too (e.g. ``max_num_seqs``, TS_WORKER_ISOLATE_P0_PREFILL, --p0-reserve-blocks), so a
key added to the engine can be set on a deployed worker without touching this file.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from common.settings import FLATTEN
from worker.config import EngineConfig

ENV_PREFIX = "TS_WORKER_"


def _engine_defaults() -> EngineConfig:
    # A worker shares its host with others more often than a library user does: fewer batch slots.
    return EngineConfig(max_num_seqs=16)


@dataclass(frozen=True)
class WorkerConfig:
    # Unique per worker; gateways route jobs and leases by it.
    worker_id: str = field(default_factory=lambda: f"wk-{socket.gethostname()}-{os.getpid()}")
    # Worker endpoints of every gateway (ZeroMQ); the worker connects to all of them.
    gateways: list = field(default_factory=lambda: ["tcp://127.0.0.1:5556"])
    # Model directory or hub name (a causal LM of a type worker/model_checks.py verifies).
    model: str = ""
    # torch intra-op threads; 0 keeps torch's default (all cores). Several workers on one host's CPUs
    # should split the cores between them, or their thread pools spin against each other.
    torch_threads: int = 0
    # Where Prometheus scrapes /metrics (host:port, e.g. 0.0.0.0:9102); "" serves none.
    metrics_bind: str = ""
    # Seconds between load reports; they also extend the leases of this worker's jobs.
    heartbeat_interval_s: float = 0.5
    # After a report offering a free slot or a victim, the step loop waits up to this long (and a quarter of a
    # step) for the gateway's dispatch before its next step, while such reports are answered (worker/linger.py);
    # 0: never.
    dispatch_linger_s: float = 0.01
    # On SIGTERM/SIGINT: seconds the running jobs get to finish before the rest are handed back to the gateways
    # (worker/drain.py); 0 hands everything back at once. Keep it under the orchestrator's grace period (compose:
    # stop_grace_period; Kubernetes: terminationGracePeriodSeconds, 30 s by default).
    drain_timeout_s: float = 20.0
    # This worker's CURVE key pair (a .key_secret file from `python -m common.keys`); its public half must
    # be on the gateways' allow-list. "" connects without CURVE (only an --insecure-workers gateway accepts).
    curve_secret_key_file: str = ""
    # The gateways' public key: 40 z85 characters or the path of their .key file.
    gateway_public_key: str = ""
    # The engine's configuration; its keys are this file's keys too (see the module docstring).
    engine: EngineConfig = field(default_factory=_engine_defaults, metadata=FLATTEN)

    def __getattr__(self, name: str):
        # config.device, config.max_num_seqs, ...: the engine's keys read as the worker's own.
        if name != "engine" and name in EngineConfig.__dataclass_fields__:
            return getattr(self.engine, name)
        raise AttributeError(name)
