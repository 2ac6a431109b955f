"""A job cancelled through one gateway while another's dispatch of it is still on its way to the worker.

A worker reads its gateways' sockets in turn, so a CancelJob from one gateway can be read before the DispatchJob of
the same attempt from another: the worker ignored the cancel (no such job yet), then started the job, and nothing
ever told it again. The cancelled job ran to its end, holding a slot (and its KV blocks) that no gateway counted as
the job's any more. Real redis-server, gateways and worker; the worker and a gateway are frozen (SIGSTOP) so that
both frames wait in the worker's sockets and are read in the bad order (its gateways' sockets in their order).
"""

from __future__ import annotations

import os
import signal

import httpx

from common.ports import free_port
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster


def _finished(metrics: str) -> dict[str, float]:
    """The worker's ts_requests_finished_total by finish reason."""
    out: dict[str, float] = {}
    for line in httpx.get(f"http://{metrics}/metrics").text.splitlines():
        if line.startswith("ts_requests_finished_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0.0) + float(line.split()[-1])
    return out


def test_a_cancel_read_before_its_dispatch_still_stops_the_job(tmp_path, bench_model_dir):
    metrics = f"127.0.0.1:{free_port()}"
    with DurableCluster(tmp_path, bench_model_dir, gateways=2, workers=1, max_running=1, lease_s=30.0,
                        worker_env={"TS_WORKER_METRICS_BIND": metrics}) as c:
        worker, first, second = c.procs["wk-0"].pid, c.procs["gw-0"].pid, c.procs["gw-1"]
        lab0, lab1 = c.client("lab-co", "gw-0", timeout_s=10.0), c.client("lab-co", "gw-1", timeout_s=10.0)
        before = _finished(metrics)  # the start-up calibration's runs, if any
        stopped = []
        try:
            # gw-1 dispatches (the worker reads its socket second); the worker holds the frame unread.
            os.kill(first, signal.SIGSTOP)
            stopped.append(first)
            os.kill(worker, signal.SIGSTOP)
            stopped.append(worker)
            job = lab1.submit(prompt_token_ids=[4, 5, 6], max_tokens=1100, seed=3, ignore_eos=True)  # ~18 s of work
            wait_for(lambda: c.state(job.id) == "dispatched", 10, "gw-1 to dispatch the job")
            assert c.job(job.id)["gateway"] == b"gw-1"
            os.kill(first, signal.SIGCONT)
            stopped.remove(first)
            assert lab0.cancel(job.id) is True  # gw-0's CancelJob waits in the worker's first socket
            assert second.poll() is None
        finally:
            for pid in stopped:  # the worker last: it reads both frames at once
                os.kill(pid, signal.SIGCONT)
        # The job ends on the worker: aborted (told again), or, before, run to its end (length) ~18 s later.
        def ended() -> dict[str, float] | None:
            now = _finished(metrics)
            new = {k: v - before.get(k, 0.0) for k, v in now.items() if v > before.get(k, 0.0)}
            return new or None

        new = wait_for(ended, 120, "the cancelled job to end on the worker")
        assert c.state(job.id) == "cancelled"
        assert new == {"abort": 1.0}, f"the cancelled job ran on: {new}"
        lab0.close()
        lab1.close()
