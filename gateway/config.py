"""Gateway configuration. Defaults here, overridden by a TOML file (--config) and then by
environment variables TS_GATEWAY_<KEY> (e.g. TS_GATEWAY_REDIS_URL)."""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, field

from common.settings import ConfigError, require
from common.tiers import ALL_TIERS

ENV_PREFIX = "TS_GATEWAY_"
# Durations and rates that must be finite and > 0: the loop divides by them, or sweeps and beats every so often.
POSITIVE = ("lease_s", "worker_timeout_s", "aging_interval_s", "maintenance_interval_s", "stream_flush_interval_s",
            "keepalive_interval_s", "default_drain_rate_per_s")
AT_LEAST = {"max_model_len": 1, "max_tokens_limit": 1, "max_attempts": 1, "idempotency_ttl_s": 1,
            "result_ttl_s": 1, "tenant_max_jobs": 0, "dead_letter_max": 1, "client_max_message_bytes": 1,
            "client_queue_bytes_per_peer": 1}  # tenant_max_jobs 0: no cap


@dataclass(frozen=True)
class GatewayConfig:
    # Where SDK clients connect (ZeroMQ ROUTER).
    client_bind: str = "tcp://127.0.0.1:5555"
    # Where workers connect (ZeroMQ ROUTER).
    worker_bind: str = "tcp://127.0.0.1:5556"
    # Unique per gateway process; workers send a job's tokens to the gateway that dispatched it.
    gateway_id: str = field(default_factory=lambda: f"gw-{socket.gethostname()}-{os.getpid()}")
    # Redis holding all queue state, shared by every gateway of the cluster.
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Key prefix (a hash tag is added so all keys share one Redis Cluster slot).
    key_prefix: str = "ts"
    # TOML file with [[tenant]] entries: name, api_key (or api_key_sha256), tiers, p0_rate_per_s, p0_burst,
    # on_quota_exhausted ("refuse" or "downgrade"). At least one entry; a file of none is refused at start.
    tenants_file: str = "tenants.toml"
    # Tokenizer (model directory or hub name) for text prompts and streamed text; "" accepts token ids only.
    tokenizer: str = ""
    # Context length used to validate prompts until a worker reports its model's.
    max_model_len: int = 2048
    # Largest max_tokens a request may ask for.
    max_tokens_limit: int = 4096
    # A dispatched job's lease; worker heartbeats extend it. Expired: re-queued (attempt + 1).
    lease_s: float = 10.0
    # Attempts before a job is dead-lettered.
    max_attempts: int = 3
    # A worker silent this long is dropped from dispatch (its leases then expire).
    worker_timeout_s: float = 5.0
    # A job waiting this long in its tier moves up one (never into P0).
    aging_interval_s: float = 60.0
    # Queue timeouts per tier in seconds (None: no timeout); past it a queued job ends as expired.
    tier_timeouts_s: dict = field(default_factory=lambda: {"P0": 30.0, "P1": 60.0, "P2": 300.0, "P3": None})
    # Scale wait estimates per tier by the ratio of actual to estimated waits learned from finished jobs
    # (gateway/wait_learning.py BiasCorrection); false: the model's estimate as it is. Off by default: the
    # ratio it learns is one wait old, so it learns a burst's onset and multiplies the estimates made
    # after it (on the replayed trace at load 0.8: 59 % median error with it, 36-44 % without; BENCHMARKS.md).
    wait_bias_correction: bool = False
    # For a job a few dispatches from a slot, the wait told hedges the one evenly spaced future of the higher tiers'
    # arrivals with the likeliest of this many drawn ones (gateway/estimate_futures.py); 0: the evenly spaced only.
    wait_futures: int = 8
    # Time the work a worker holds by replaying its engine steps at the step cost it reports
    # (gateway/estimate_steps.py); false: at its per-sequence token rates alone, as before workers reported one.
    wait_step_cost: bool = True
    # A JSON-lines file each admitted job's wait estimate inputs are appended to, for scripts/estimate_replay.py
    # (gateway/estimate_dump.py); "" writes none. A debugging aid: it costs a line written per admission. One file
    # per gateway: two appending to one may interleave their lines.
    estimate_dump: str = ""
    # A P3 job still queued at admission + promise_factor x its wait estimate - promise_lead_s moves to the P2
    # queue (keeping its place by age, as if it had aged early), so that P2s admitted after it stop overtaking
    # it: the wait it was told is one it gets (gateway/promises.py). 0 turns promises off.
    promise_factor: float = 1.0
    promise_lead_s: float = 0.5
    # The tiers given promises: P3 (to P2), and P2 (to P1: P1s admitted after a P2 whose promise fell due stop
    # overtaking it; P1 waits for those P2s in exchange, and a P3 promised into P2 is passed by P2s promised into
    # P1 after it). JSON in TS_GATEWAY_PROMISE_TIERS; ["P3"] keeps P1 strictly ahead of P2 (gateway/promises.py).
    promise_tiers: tuple[str, ...] = ("P2", "P3")
    # Drain rate (jobs/s per tier) assumed before any is measured, for wait estimates.
    default_drain_rate_per_s: float = 1.0
    # How often aging, expiry and lease recovery run.
    maintenance_interval_s: float = 0.2
    # How often running jobs' new tokens are appended to their Redis streams (and watched ones read back),
    # so that any gateway can stream any job.
    stream_flush_interval_s: float = 0.05
    # A client stream that has received nothing for this long (its job queued, or running before its first
    # token) gets a StatusReply, so the client knows its gateway is alive. Clients' timeout_s must exceed it.
    keepalive_interval_s: float = 2.0
    # Where Prometheus scrapes /metrics (host:port, e.g. 0.0.0.0:9101); "" serves none.
    metrics_bind: str = ""
    # Idempotency keys are remembered this long.
    idempotency_ttl_s: int = 86400
    # Finished and dead-lettered jobs (state, result tokens) are kept this long for status and stream requests.
    result_ttl_s: int = 3600
    # Most unfinished (queued or running) jobs one tenant may hold, over all tiers; past it, "overloaded". 0: no cap.
    tenant_max_jobs: int = 10000
    # The dead-letter set keeps the newest this many jobs.
    dead_letter_max: int = 10000
    # The gateways' CURVE key pair (a .key_secret file from `python -m common.keys`): workers (and, with
    # client_curve, clients) must know its public half.
    curve_secret_key_file: str = ""
    # Directory of worker public keys (*.key) allowed on worker_bind. Without it the gateway refuses to
    # start unless insecure_workers is set.
    authorized_workers_dir: str = ""
    # Accept workers without CURVE authentication: only allowed when worker_bind is a loopback address.
    insecure_workers: bool = False
    # Encrypt the client socket with CURVE (clients pass the gateway's public key); needs curve_secret_key_file.
    client_curve: bool = False
    # Largest frame a client may send (ZMQ_MAXMSGSIZE on the client socket; bigger: disconnected).
    client_max_message_bytes: int = 8 * 2**20
    # Bytes of unread frames one client connection may have queued in the gateway (then TCP back-pressure).
    client_queue_bytes_per_peer: int = 32 * 2**20
    # File holding the Redis password (kept out of redis_url, argv and logs); "" uses redis_url's own.
    redis_password_file: str = ""
    # At start, how long to wait for a Redis that does not answer (restarting, loading its AOF, standing still, or
    # starting beside this gateway) before exiting; a refused password exits at once. 0: exit at once.
    redis_startup_wait_s: float = 30.0

    def __post_init__(self) -> None:
        """Refuse, naming the key, a value the gateway could not run with (before anything is started)."""
        require(self, positive=POSITIVE, at_least=AT_LEAST, non_negative={"redis_startup_wait_s": "exit at once"})
        timeouts = self.tier_timeouts_s
        names = {t.value for t in ALL_TIERS}
        if not isinstance(timeouts, dict) or not set(timeouts) <= names or not all(
                v is None or (isinstance(v, (int, float)) and math.isfinite(v) and v > 0) for v in timeouts.values()):
            raise ConfigError(f"tier_timeouts_s maps tiers of {sorted(names)} to seconds > 0 (a tier left out, or "
                              f"None: no timeout), got {timeouts!r}")
