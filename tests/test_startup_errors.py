"""Processes that cannot start say why in one line and exit 2, having changed nothing.

A worker that cannot start must fail before any gateway knows it: a worker that says hello and then dies
(its metrics port taken, as one did 12 times in a row in a CI run) is sent jobs in between, and each such job
loses an attempt to a lease expiry: three restarts of that loop and an innocent job is dead. Real processes:
redis-server, a gateway, a worker on the tiny model."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from tests.cluster_helpers import wait_for
from tests.durable_cluster import ROOT, DurableCluster

pytestmark = pytest.mark.faults


def test_a_worker_whose_metrics_port_is_taken_exits_before_saying_hello(tmp_path, tiny_model_dir):
    with socket.socket() as taken, DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=0) as c:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        with c.client("batch-co", timeout_s=10) as client:
            job = client.submit(prompt_token_ids=[5, 6, 7], max_tokens=2)
            c.env["TS_WORKER_METRICS_BIND"] = f"127.0.0.1:{taken.getsockname()[1]}"
            c.worker_ids.append("wk-0")
            c.start_process("wk-0")
            wait_for(lambda: not c.alive("wk-0"), 120, "the worker to exit")
            assert c.procs["wk-0"].returncode == 2, c.log_tail("wk-0")  # a start-up error, not a crash
            log = c.log_tail("wk-0")
            assert "metrics" in log and "in use" in log and "Traceback" not in log, log
            # Nobody ever saw it: no gateway lists it, and the job was never sent to it (no attempt spent).
            assert all(w != "wk-0" for w in client.info().workers)
            time.sleep(0.5)  # a dispatch to a worker the gateway had heard from would have happened by now
            assert c.state(job.id) == "queued" and c.job(job.id)["attempt"] == b"0", c.job(job.id)
            # Started where it can bind, the same worker serves the job.
            c.env["TS_WORKER_METRICS_BIND"] = ""
            c.restart("wk-0")
            assert job.result(timeout=120).token_ids


def test_a_gateway_whose_ports_are_taken_says_which_and_exits_2(tmp_path, tiny_model_dir):
    with socket.socket() as taken, DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=0) as c:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        client_ep, worker_ep = c.gateways["gw-0"]
        free_client, free_worker = "tcp://127.0.0.1:0", "tcp://127.0.0.1:0"
        cases = {  # the running gateway's own endpoints, or a port someone holds
            "client": ([client_ep, free_worker], {}, client_ep),
            "worker": ([free_client, worker_ep], {}, worker_ep),
            "metrics": ([free_client, free_worker], {"TS_GATEWAY_METRICS_BIND": f"127.0.0.1:{port}"},
                        f"127.0.0.1:{port}"),
        }
        for what, ((client_bind, worker_bind), env, named) in cases.items():
            done = subprocess.run(
                [sys.executable, "-m", "gateway", "--client-bind", client_bind, "--worker-bind", worker_bind,
                 "--redis-url", c.redis_url, "--tenants-file", str(c.tmp / "tenants.toml"), "--gateway-id", "gw-9"],
                cwd=ROOT, env=c.env | env, capture_output=True, text=True, timeout=60)
            assert done.returncode == 2, (what, done.returncode, done.stderr[-2000:])
            assert "Traceback" not in done.stderr and named in done.stderr and "in use" in done.stderr, \
                (what, done.stderr[-2000:])
        with c.client("lab-co", timeout_s=10) as client:  # the running one is untouched
            assert client.info() is not None
