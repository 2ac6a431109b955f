"""A gateway that hangs longer than the worker's ZeroMQ heartbeat timeout (SIGSTOP, a long GC, a frozen VM) and then
goes on hears its workers again.

Before, it never did: the worker's heartbeats dropped the connection and it reconnected to the stopped process's
kernel; once the gateway went on, its ROUTER socket still held the old connection's pipe under the worker's identity
when the new one said who it was, and dropped that peer as a duplicate, without a word. The worker saw its
handshake succeed and went on sending hellos, tokens and reports into nothing: the gateway timed it out, its jobs'
streams stopped, and a sole worker's cluster ran nothing it admitted. Real redis-server, gateway and worker
processes; the bench model, so that jobs last seconds.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster, settle

pytestmark = pytest.mark.faults


def test_a_gateway_that_hung_past_the_heartbeat_timeout_hears_its_worker_again(tmp_path, bench_model_dir):
    with DurableCluster(tmp_path, bench_model_dir, gateways=1, workers=1, max_running=2, lease_s=120.0) as c:
        with c.client("lab-co", timeout_s=30.0) as lab:
            jobs = [lab.submit(prompt_token_ids=[4, 5, i], max_tokens=1500, seed=i, ignore_eos=True) for i in (1, 2)]
            for job in jobs:
                next(lab.job(job.id).stream(timeout=120))  # both running on wk-0, streaming through gw-0
        gw = c.procs["gw-0"]
        os.kill(gw.pid, signal.SIGSTOP)  # the worker's heartbeats drop the connection after 5 s
        try:
            settle(7.0)
        finally:
            os.kill(gw.pid, signal.SIGCONT)
        tokens = f"ts:{{c}}:tok:{jobs[0].id}"
        streamed = c.redis.xlen(tokens)
        with c.client("lab-co", timeout_s=5.0) as lab:
            wait_for(lambda: len(lab.info().workers) == 1 and c.redis.xlen(tokens) > streamed + 10, 40,
                     f"gw-0 to hear wk-0 again; gw-0 log: {c.log_tail('gw-0')}")
            late = lab.submit(prompt_token_ids=[9, 10], max_tokens=20, seed=3, ignore_eos=True)
            assert len(late.result(timeout=120).token_ids) == 20
        assert "connecting to it anew" in c.log_tail("wk-0", 100_000)
        for job in jobs:
            h = c.job(job.id)
            assert h["attempt"] == b"1" and h["worker"] == b"wk-0", h  # never lost its lease meanwhile
