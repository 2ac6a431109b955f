"""A job's wait (JobResult.queued_s) ends when its first prefill starts on the worker, not when a busy gateway gets
round to reading the frame that says so: the time that frame sat in the gateway's socket is no wait."""

from __future__ import annotations

import os
import signal
import time

import pytest

from gateway.sdk import GatewayClient
from gateway.waits import WorkerClocks
from tests.cluster_helpers import job_hash, local_cluster, state_pids, wait_for

FROZEN_S = 3.0


def test_a_start_heard_late_by_a_stalled_gateway_is_not_counted_as_wait(tmp_path, tiny_model_dir):
    """The worker stands still while the job is dispatched, goes on (the prefill starts at once) while the gateway
    stands still, and the gateway reads the start FROZEN_S later. The wait was put at the reading, less the age the
    worker told: it held the gateway's stall."""
    with local_cluster(tmp_path, tiny_model_dir, workers=1, max_running=2, lease_s=30.0, http=False) as c:
        key = c["tenants"]["lab-co"]["api_key"]
        pids = state_pids(c)
        gw, worker = pids["gw-0"], pids["wk-0"]
        with GatewayClient(c["gateway"], key, timeout_s=30.0) as lab:
            lab.submit(prompt_token_ids=[3, 4], max_tokens=2, seed=1).result(timeout=60)  # warm, with credit
            time.sleep(1.0)  # a load report after it: the slots are free again
            os.kill(worker, signal.SIGSTOP)
            try:
                job = lab.submit(prompt_token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True, seed=2)
                wait_for(lambda: job_hash(c, job.id).get("state") == "dispatched", 30, "the dispatch")
                time.sleep(0.5)  # the DispatchJob is in the worker's socket
                os.kill(gw, signal.SIGSTOP)
            finally:
                os.kill(worker, signal.SIGCONT)
            resumed_ms = c["redis_client"].time()
            resumed_ms = resumed_ms[0] * 1000 + resumed_ms[1] // 1000
            try:
                time.sleep(FROZEN_S)  # the worker prefills and reports the start; the frame waits unread
            finally:
                os.kill(gw, signal.SIGCONT)
            result = job.result(timeout=60)
        h = job_hash(c, job.id)
    # The prefill started right after the worker went on (a tiny model, nothing else running).
    true_wait = (resumed_ms - int(h["enqueued_at_ms"])) / 1e3
    assert result.queued_s < true_wait + 1.0, (result.queued_s, true_wait)
    assert (int(h["first_prefill_ms"]) - resumed_ms) / 1e3 < 1.0, (h["first_prefill_ms"], resumed_ms)


def test_worker_clocks_place_a_late_frame_at_its_send_and_never_after_its_reading():
    clocks = WorkerClocks()
    assert clocks.sent("w", None, 5.0) == 5.0  # an older worker: its reading
    clocks.heard("w", 1000.0, 10.0)  # offset -990 (plus the quickest delivery)
    clocks.heard("w", 1001.0, 11.3)  # read late: the offset stays
    assert clocks.sent("w", 1002.0, 15.0) == pytest.approx(12.0)  # sat 3 s unread
    assert clocks.sent("w", 1003.0, 12.9) == pytest.approx(12.9)  # came quicker than ever: its reading
    assert clocks.sent("w", float("nan"), 14.0) == 14.0
    # A window later the least lag of the last two windows holds; the earlier one is let go (drift).
    clocks.heard("w", 1040.0, 50.5)
    clocks.heard("w", 1080.0, 91.0)
    assert clocks.sent("w", 1081.0, 95.0) == pytest.approx(91.5)
    # The worker's clock went back (another process, another host): what was learnt of the old one is dropped.
    assert clocks.sent("v", 500.0, 100.0) == 100.0
    clocks.heard("w", 10.0, 100.0)
    assert clocks.sent("w", 11.0, 104.0) == pytest.approx(101.0)
