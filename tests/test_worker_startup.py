"""A worker that cannot start must fail before any gateway knows it: a worker that says hello and then dies
(its metrics port taken, as one did 12 times in a row in a CI run) is sent jobs in between, and each such job
loses an attempt to a lease expiry: three restarts of that loop and an innocent job is dead. Real processes:
redis-server, a gateway, a worker on the tiny model."""

from __future__ import annotations

import socket
import time

import pytest

from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster

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
