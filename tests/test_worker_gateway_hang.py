"""A gateway that hangs longer than the worker's ZeroMQ heartbeat timeout (SIGSTOP, a long GC, a frozen VM) and then
goes on hears its workers again.

Before, it never did: the worker's heartbeats dropped the connection and it reconnected to the stopped process's
kernel; once the gateway went on, its ROUTER socket still held the old connection's pipe under the worker's identity
when the new one said who it was, and dropped that peer as a duplicate, without a word. The worker saw its
handshake succeed and went on sending hellos, tokens and reports into nothing: the gateway timed it out, its jobs'
streams stopped, and a sole worker's cluster ran nothing it admitted. Real redis-server, gateway and worker
processes; the bench model, so that jobs last seconds.

A gateway that only waits out a frozen Redis keeps the connection (its I/O thread answers the heartbeats) and must
not be connected to anew: that is what would strand the worker there.
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


def test_a_worker_keeps_its_connection_to_a_gateway_waiting_out_a_frozen_redis(tmp_path, bench_model_dir):
    """A gateway whose Redis stands still longer than the worker's silence limit reads no worker frame meanwhile
    (they wait in its socket, gateway/frames.py) and so answers no hello, but its connection never drops: ZeroMQ's
    heartbeats are answered by its I/O thread. Connecting anew to it is what strands the worker: the old pipe, full
    of unread frames, holds the worker's identity until the gateway reads them, so the new connection is refused as
    a duplicate and everything the worker sends goes into nothing until its next silence limit (15 s more): the
    gateway times it out, a job dispatched after Redis came back waits out its lease."""
    with DurableCluster(tmp_path, bench_model_dir, gateways=1, workers=1, max_running=2, lease_s=120.0) as c:
        with c.client("lab-co", timeout_s=30.0) as lab:
            job = lab.submit(prompt_token_ids=[4, 5, 6], max_tokens=3000, seed=1, ignore_eos=True)
            next(lab.job(job.id).stream(timeout=120))  # running on wk-0, streaming through gw-0
        redis_pid = c.procs["redis"].pid
        os.kill(redis_pid, signal.SIGSTOP)  # past the worker's 15 s silence limit
        try:
            settle(20.0)
        finally:
            os.kill(redis_pid, signal.SIGCONT)
        resumed = time.monotonic()
        with c.client("lab-co", timeout_s=5.0) as lab:
            late = lab.submit(prompt_token_ids=[9, 10], max_tokens=5, seed=3, ignore_eos=True)
            try:
                done = late.result(timeout=10)
            except TimeoutError:
                raise AssertionError(f"wk-0 log: {c.log_tail('wk-0')}\ngw-0 log: {c.log_tail('gw-0')}") from None
            assert len(done.token_ids) == 5
        assert time.monotonic() - resumed < 10.0
        assert "connecting to it anew" not in c.log_tail("wk-0", 100_000)
        for j in (job, late):
            h = c.job(j.id)
            assert h["attempt"] == b"1" and h["worker"] == b"wk-0", h  # the running one never lost its lease
