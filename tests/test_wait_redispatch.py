"""A job's wait (JobResult.queued_s) is admission until its FIRST prefill started, across re-dispatches: on real
clusters where the gateway that stores the result never heard that first start."""

from __future__ import annotations

import pytest

from gateway.waits import Waits, first_prefill_ms
from tests.cluster_helpers import wait_for
from tests.redispatch_helpers import Frozen, hand_to_gw1, redispatch_cluster, submit_on_gw0
from tests.test_result_figures import result_in_thread
from tests.test_token_log_stale_writer import T0, queue_and_log


def test_the_first_start_goes_to_the_hash_earliest_kept_and_a_gone_hash_stays_gone():
    with queue_and_log("j") as (client, keys, queue, log):
        log.append([], first_prefills={"j": T0 + 500, "gone": T0 + 1})
        log.append([], first_prefills={"j": T0 + 700})  # a later attempt's start: the wait had ended
        assert first_prefill_ms(queue.get("j")) == T0 + 500
        log.append([], ["j"], "gw-x", {"j": T0 + 400})  # a gateway that stood still tells it late
        assert first_prefill_ms(queue.get("j")) == T0 + 400
        assert not client.exists(keys.job("gone"))


def test_a_dispatch_after_a_recorded_start_keeps_it_and_learns_the_admission_from_redis():
    waits = Waits()
    # Attempt 2, sent at 50.0 here (Redis: T0 + 9000); admitted elsewhere at T0, its attempt 1 started at T0 + 1000.
    waits.dispatched("j", 50.0, attempt=2, sent_ms=T0 + 9000, enqueued_ms=T0, first_ms=T0 + 1000)
    assert waits.prefill_started("j", 0.2, attempt=2) is not None  # its hand-off is this dispatch's
    assert waits.queued_s("j", None) == pytest.approx(1.0)
    assert waits.unrecorded() == {}  # the hash has the earlier start already
    # A first attempt heard here: its start is to be written, on Redis's clock.
    waits.dispatched("k", 10.0, sent_ms=T0 + 3000, enqueued_ms=T0)
    waits.prefill_started("k", 0.25, attempt=1)
    assert waits.queued_s("k", None) == pytest.approx(3.25)
    assert waits.unrecorded() == {"k": T0 + 3250}
    waits.recorded({"k": T0 + 3250})
    assert waits.unrecorded() == {}
    # A lease taken over (told): no hand-off learnt, but the start still ends the wait.
    waits.dispatched("m", 10.0, attempt=1, sent_ms=T0 + 1000, enqueued_ms=T0, told=True)
    assert waits.prefill_started("m", 0.5, attempt=1) is None
    assert waits.queued_s("m", None) == pytest.approx(1.5)


def test_a_job_redispatched_by_another_gateway_keeps_its_first_start(tmp_path, tiny_model_dir):
    """gw-0 admits and dispatches the job, whose first token reaches the client; its worker is killed -9, gw-0
    freezes, and gw-1 (which neither admitted it nor heard attempt 1 start) runs attempt 2 and stores the result.
    The wait ended before the client's first token; it used to run to attempt 2's start (or be the total less
    attempt 2's run), so it held attempt 1's run, the lease's expiry and the worker's restart."""
    with redispatch_cluster(tmp_path, tiny_model_dir) as c:
        with Frozen(c) as frozen:
            job, bound = submit_on_gw0(c)
            hand_to_gw1(c, frozen, job.id)
            with c.client("batch-co", "gw-1", timeout_s=30.0) as b1:
                result = b1.job(job.id).result(timeout=180)
        h = c.job(job.id)  # while Redis is up
    assert (h["state"], h["attempt"], h["gateway"]) == (b"done", b"2", b"gw-1"), h.get("reason")
    assert "queued_s" in h, "the storing gateway stored no wait"
    stored = float(h["queued_s"])
    assert 0.0 <= stored <= bound, (stored, bound)
    # gw-0 wrote attempt 1's start where gw-1 read it: the stored wait is that start, give or take the clocks' ms
    assert (int(h["first_prefill_ms"]) - int(h["enqueued_at_ms"])) / 1e3 == pytest.approx(stored, abs=0.05)
    assert 0.0 <= result.queued_s <= bound, (result.queued_s, bound)


def test_a_first_start_written_late_by_a_resumed_gateway_is_the_stored_wait(tmp_path, tiny_model_dir):
    """gw-0 hears attempt 1 start and freezes before its token-log flush writes that start; the worker is killed and
    gw-1 runs attempt 2 (the hash names no earlier start, so gw-1 measures the wait to attempt 2's start). gw-0
    resumes and writes attempt 1's start while attempt 2 runs. The stored wait used to be gw-1's (attempt 2's
    start, which holds attempt 1's run and the lease's expiry) beside a first_prefill_ms that says otherwise."""
    # gw-0 flushes every second: seldom between its first token and its freeze (then the job is cancelled and the
    # scenario begun again), and soon enough after it is let go to write before attempt 2 (2,000 tokens, about 2 s
    # on an idle machine) ends. At 8 s it wrote after attempt 2 had ended, when the machine was idle.
    with redispatch_cluster(tmp_path, tiny_model_dir,
                            process_env={"gw-0": {"TS_GATEWAY_STREAM_FLUSH_INTERVAL_S": "1"}}) as c:
        with Frozen(c) as frozen:
            for _ in range(5):
                with c.client("batch-co", "gw-0", timeout_s=30.0) as b0:
                    job = b0.submit(prompt_token_ids=[5, 6], max_tokens=2000, ignore_eos=True, tier="P3", seed=4)
                    next(iter(job.stream(timeout=60)))
                    frozen.freeze("gw-0")
                    if "first_prefill_ms" not in c.job(job.id):
                        break
                    frozen.thaw("gw-0")  # it flushed attempt 1's start first: nothing would be tested
                    job.cancel()
                    wait_for(lambda: c.state(job.id) == "cancelled" and not c.redis.zcard("ts:{c}:inflight"), 30,
                             "the job to be cancelled and its slot freed")
            else:
                pytest.fail("gw-0 flushed attempt 1's start before its freeze five times")
            c.kill("wk-0")
            frozen.thaw("gw-1")
            c.restart("wk-0")
            # gw-0 is let go as soon as attempt 2 is sent, not once its start is recorded: on an idle machine
            # attempt 2 (2,000 tokens) ends within 3 s, before gw-0's write, and then nothing is tested.
            wait_for(lambda: c.job(job.id)["attempt"] == b"2" and c.state(job.id) == "dispatched", 120,
                     "gw-1 to send attempt 2")
            sent = int(c.job(job.id)["dispatched_at_ms"])  # after attempt 1's start, before attempt 2's
            listener = c.client("batch-co", "gw-1", timeout_s=30.0)
            waiter, heard = result_in_thread(listener, job.id)  # its final message comes from gw-1's memory
            frozen.thaw("gw-0")

            def first_start_written() -> bool:
                h = c.job(job.id)
                return "first_prefill_ms" in h and int(h["first_prefill_ms"]) < sent

            wait_for(first_start_written, 30, "gw-0 to write attempt 1's start")
            assert c.state(job.id) == "dispatched", "attempt 2 ended first: nothing is tested"
            wait_for(lambda: c.state(job.id) == "done", 180, "attempt 2 to finish")
            waiter.join(30)
            listener.close()
        h = c.job(job.id)
        with c.client("batch-co", "gw-0", timeout_s=30.0) as b0:
            result = b0.job(job.id).result(timeout=30)
        with c.client("batch-co", "gw-1", timeout_s=30.0) as b1:
            at_gw1 = b1.job(job.id).result(timeout=30)
    assert (h["attempt"], h["gateway"]) == (b"2", b"gw-1"), h.get("reason")
    first_s = (int(h["first_prefill_ms"]) - int(h["enqueued_at_ms"])) / 1e3
    assert float(h["queued_s"]) == pytest.approx(first_s, abs=0.05), (float(h["queued_s"]), first_s)
    assert result.queued_s == pytest.approx(first_s, abs=0.05)
    # The client that waited on gw-1 was told gw-1's own figure (attempt 2's start): two waits for one job.
    assert "result" in heard, heard
    assert heard["result"].queued_s == at_gw1.queued_s == result.queued_s, (heard["result"], result)
