"""A dispatch pass's ``now`` is read at the top of the gateway's loop, before that pass's Redis round trips (the
token-log flush, maintenance, the plan's reads): what the gateway derives from the claim's Redis times is to the
claim's own moment, not to that ``now``. It took the job's admission, on this gateway's clock, as the claim's wait
before ``now``; a pass that stood still before its claim added that time to the job's TTFT (a stored 35 ms where
its client saw its first token 30.5 ms after submitting) and to the first start it writes for the job's wait.
A gateway built as `python -m gateway` builds it, its real redis-server stopped (SIGSTOP) within the pass, and a
worker on a real ZeroMQ socket that said hello."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

from common import protocol as P
from gateway import metrics
from tests.gateway_helpers import built_gateway
from tests.test_outage_kept_frames import welcomed_worker
from tests.test_outage_token_share import _admit, _drain_until

STALL_S = 0.5  # under the Redis client's 2 s timeout: the pass waits it out, as a slow round trip


def test_a_pass_that_stood_still_before_its_claim_adds_nothing_to_the_jobs_ttft_or_wait(tmp_path):
    job = f"job-{uuid.uuid4().hex[:8]}"
    with built_gateway(tmp_path, "clock") as (gw, _, server):
        worker = welcomed_worker(gw)
        try:
            worker.send(P.encode(P.WorkerLoad("wk-a", 1, 1024, {}, {}, [], 0.0)))
            _drain_until(gw, lambda: gw.workers.workers["wk-a"].load is not None, "the worker's report")
            before = gw.clock()
            _admit(gw, job)
            enqueued_ms = gw.queue.get(job).enqueued_at_ms
            now = gw.clock()  # the loop's, read before the pass's round trips
            os.kill(server.pid, signal.SIGSTOP)
            threading.Timer(STALL_S, os.kill, (server.pid, signal.SIGCONT)).start()
            gw._dirty = True
            gw._background(now)
            assert gw.clock() - now >= STALL_S, "the pass did not stand still"
            dispatch = P.decode(worker.recv())
            assert isinstance(dispatch, P.DispatchJob) and dispatch.job_id == job, dispatch
            # The job's prefill starts at once and its first token is sent then.
            worker.send(P.encode(P.JobTokens(job, dispatch.attempt, 0, [7], prefill_start_s=0.0,
                                             prefill_start_age_s=0.0, sent_at_s=time.monotonic())))
            _drain_until(gw, lambda: metrics.first_token_pending(job), "the first token")
            seen_s = gw.clock() - before
            redis_now_ms = gw.queue.server_ms()
            ttft_ms = metrics.claim_ttft_ms(job)
            start_ms = gw.waits.unrecorded_start_ms(job)
        finally:
            worker.close(linger=0)
    # Whole milliseconds in Redis (admission and claim, each truncated) and the claim's reply on the way: 2 ms.
    assert ttft_ms <= seen_s * 1000 + 2, (ttft_ms, seen_s)
    assert start_ms is not None and enqueued_ms <= start_ms <= redis_now_ms + 2, (start_ms, enqueued_ms, redis_now_ms)
