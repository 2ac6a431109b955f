"""The SDK against real processes (issue 9, item 9): request ids, keepalives, long waits, retries, re-attach,
failover and one multiplexed asyncio connection.

Every test runs real redis-server, gateway and worker processes (scripts/up.py via tests/cluster_helpers.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import zmq

from common import protocol as P
from gateway.sdk import GatewayClient
from tests.cluster_helpers import ROOT, local_cluster, stop_process, wait_for

KEEPALIVE_ENV = {"TS_GATEWAY_KEEPALIVE_INTERVAL_S": "0.3"}


def start_worker(state: dict, model_dir: Path, worker_id: str, log: Path) -> subprocess.Popen:
    """One more real worker, connected to every gateway of the cluster."""
    cmd = [sys.executable, "-m", "worker", "--worker-id", worker_id, "--model", str(model_dir), "--max-num-seqs", "2"]
    for g in state["gateways"]:
        cmd += ["--gateway", g["worker_endpoint"]]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT), TS_WORKER_TORCH_THREADS="1"))


class RawClient:
    """A bare DEALER socket speaking the protocol, to see exactly which frames the gateway sends."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, msg) -> None:
        self.sock.send(P.encode(msg))

    def recv(self, timeout_s: float = 30.0):
        assert self.sock.poll(int(timeout_s * 1000)), f"no frame within {timeout_s}s"
        return P.decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def idle_cluster(tiny_model_dir, tmp_path_factory):
    """A gateway with no worker yet: every job stays queued until a test starts one."""
    with local_cluster(tmp_path_factory.mktemp("idle"), tiny_model_dir, workers=0, env=KEEPALIVE_ENV) as state:
        yield state


def test_every_reply_frame_echoes_its_request_id_and_a_queued_stream_gets_keepalives(idle_cluster, tiny_model_dir,
                                                                                      tmp_path):
    c = idle_cluster
    key = c["tenants"]["lab-co"]["api_key"]
    raw = RawClient(c["gateway"])
    try:
        raw.send(P.InfoRequest(key, request_id="info-1"))
        assert isinstance(info := raw.recv(), P.InfoReply) and info.request_id == "info-1"
        raw.send(P.InfoRequest("not-a-key", request_id="bad-key"))
        err = raw.recv()
        assert isinstance(err, P.ErrorReply) and err.code == "unauthorized" and err.request_id == "bad-key"
        raw.send(P.InfoRequest(key, request_id="x" * (P.MAX_REQUEST_ID_LEN + 1)))
        err = raw.recv()
        assert isinstance(err, P.ErrorReply) and err.code == "protocol" and err.field == "request_id"

        raw.send(P.SubmitRequest(key, max_tokens=5, prompt_token_ids=[3, 4, 5], ignore_eos=True, request_id="sub"))
        sub = raw.recv()
        assert isinstance(sub, P.SubmitReply) and sub.request_id == "sub"
        raw.send(P.StatusRequest(key, sub.job_id, request_id="st"))
        assert (st := raw.recv()).request_id == "st" and st.state == "queued"
        # Two streams of the same job on one connection, told apart by their request ids.
        raw.send(P.StreamRequest(key, sub.job_id, 0, request_id="s-a"))
        raw.send(P.StreamRequest(key, sub.job_id, 2, request_id="s-b"))
        # Queued, with no worker: nothing but keepalives, several for each stream, each naming its stream.
        seen = {"s-a": 0, "s-b": 0}
        while min(seen.values()) < 3:
            ka = raw.recv()
            assert isinstance(ka, P.StatusReply) and ka.job_id == sub.job_id and ka.state == "queued"
            seen[ka.request_id] += 1
        worker = start_worker(c, tiny_model_dir, "wk-echo", tmp_path / "worker.log")
        try:
            frames: dict[str, list] = {"s-a": [], "s-b": []}
            while not all(f and isinstance(f[-1], P.JobDone) for f in frames.values()):
                m = raw.recv(timeout_s=120)
                frames[m.request_id].append(m)
            for rid, start in (("s-a", 0), ("s-b", 2)):
                tokens = [m for m in frames[rid] if isinstance(m, P.TokenChunk)]
                done = frames[rid][-1]
                assert done.state == "done" and len(done.token_ids) == 5
                assert [t for m in tokens for t in m.token_ids] == done.token_ids[start:]
            raw.send(P.CancelRequest(key, sub.job_id, request_id="cx"))
            cancel = raw.recv()
            assert isinstance(cancel, P.CancelReply) and cancel.request_id == "cx" and not cancel.cancelled
        finally:
            stop_process(worker, timeout=30)
            wait_for(lambda: not GatewayClient(c["gateway"], key, timeout_s=5).info().workers, 30,
                     "the gateway to drop the stopped worker")
    finally:
        raw.close()


def test_result_without_timeout_waits_for_a_job_queued_longer_than_timeout_s(idle_cluster, tiny_model_dir,
                                                                              tmp_path):
    c = idle_cluster
    client = GatewayClient(c["gateway"], c["tenants"]["lab-co"]["api_key"], timeout_s=2.0)
    job = client.submit(prompt_token_ids=[7, 8, 9], max_tokens=6, ignore_eos=True)
    out: dict = {}

    def wait() -> None:
        try:
            out["result"] = job.result()
        except BaseException as e:  # reported to the test thread
            out["error"] = e

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    # Queued for three times the client's timeout_s: result() must still be waiting, not failed.
    waiter.join(timeout=3 * client.timeout_s)
    assert waiter.is_alive(), f"result() returned early: {out}"
    worker = start_worker(c, tiny_model_dir, "wk-late", tmp_path / "worker.log")
    try:
        waiter.join(timeout=120)
        assert not waiter.is_alive() and "error" not in out, out
        assert len(out["result"].token_ids) == 6
    finally:
        stop_process(worker, timeout=30)
        wait_for(lambda: not client.info().workers, 30, "the gateway to drop the stopped worker")
        client.close()
