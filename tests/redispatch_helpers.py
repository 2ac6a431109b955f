"""A job re-dispatched by a gateway that never heard its first attempt: two gateways on one Redis and one worker,
gw-0 admitting and dispatching attempt 1 while gw-1 stands frozen (SIGSTOP), then the worker killed -9, gw-0
frozen and gw-1 let go to run attempt 2. Real processes (tests/durable_cluster.py)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Callable

from gateway.sdk import Job
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster
from tests.test_metrics_finals import logged_tokens


def redispatch_cluster(tmp_path: Path, model_dir: Path, **kw) -> DurableCluster:
    """Two gateways, one worker with one slot, a short lease: a killed worker's job goes out again soon."""
    return DurableCluster(tmp_path, model_dir, gateways=2, workers=1, max_running=1, lease_s=2.0, **kw)


class Frozen:
    """Gateways frozen (SIGSTOP) and let go (SIGCONT) by name; whichever is still frozen is let go on exit, so that
    neither a failing test nor the cluster's stop meets a frozen gateway. gw-1 starts frozen: gw-0 dispatches
    attempt 1."""

    def __init__(self, c: DurableCluster) -> None:
        self.c = c
        self.stopped: set[int] = set()

    def __enter__(self) -> Frozen:
        self.freeze("gw-1")
        return self

    def __exit__(self, *exc) -> None:
        for pid in self.stopped:
            os.kill(pid, signal.SIGCONT)

    def freeze(self, name: str) -> None:
        pid = self.c.procs[name].pid
        os.kill(pid, signal.SIGSTOP)
        self.stopped.add(pid)

    def thaw(self, name: str) -> None:
        pid = self.c.procs[name].pid
        os.kill(pid, signal.SIGCONT)
        self.stopped.discard(pid)


def submit_on_gw0(c: DurableCluster) -> tuple[Job, float]:
    """A long P3 job admitted through gw-0, once its first token has reached the client; the time from admission
    to that token, as the client saw it, plus 2 ms: a ceiling for the job's wait and TTFT, which Redis keeps as the
    difference of two whole-millisecond times (a 16.0 ms first token was stored as 17 ms)."""
    with c.client("batch-co", "gw-0", timeout_s=30.0) as b0:
        t0 = time.monotonic()
        job = b0.submit(prompt_token_ids=[5, 6], max_tokens=2000, ignore_eos=True, tier="P3", seed=4)
        next(iter(job.stream(timeout=60)))
        return job, time.monotonic() - t0 + 0.002


def hand_to_gw1(c: DurableCluster, frozen: Frozen, job_id: str, what: str = "gw-0 to write the token log",
                written: Callable[[], bool] = lambda: True) -> None:
    """Once gw-0 has written what the test needs (``written``), its worker is killed -9 and gw-0 frozen; gw-1 is let
    go and the worker restarted: gw-1 takes the lease over and runs attempt 2."""
    wait_for(lambda: logged_tokens(c, job_id) > 0 and written(), 30, what)
    c.kill("wk-0")
    frozen.freeze("gw-0")
    frozen.thaw("gw-1")
    c.restart("wk-0")
