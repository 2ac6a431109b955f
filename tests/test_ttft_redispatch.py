"""A job's time to first token (JobResult.ttft_s) is admission until its FIRST token, across re-dispatches: on real
clusters where the gateway that stores the result never heard that first token."""

from __future__ import annotations

import pytest

from gateway import metrics
from tests.cluster_helpers import wait_for
from tests.redispatch_helpers import Frozen, hand_to_gw1, redispatch_cluster, submit_on_gw0
from tests.test_result_figures import result_in_thread
from tests.test_token_log_stale_writer import T0, queue_and_log


def _first_token_seen(job_id: str, after_s: float) -> None:
    """This process, as a gateway holding ``job_id`` (admitted at its clock's 100.0), saw its first token."""
    metrics.holding(job_id, "P3", 100.0, False)
    metrics.first_token(job_id, 100.0 + after_s)


def test_the_first_tokens_time_goes_to_the_hash_with_its_claim_earliest_kept():
    with queue_and_log("j", "done") as (client, keys, queue, log):
        _first_token_seen("j", 0.7)
        assert log.append([], ["j"], "gw-a").claimed == [True]
        metrics.claimed("j", True)
        assert int(client.hget(keys.job("j"), "first_token_ms")) == T0 + 700
        _first_token_seen("j", 0.9)  # a later attempt's first token, heard elsewhere
        assert log.append([], ["j"], "gw-b").claimed == [False]
        metrics.claimed("j", False)
        assert int(client.hget(keys.job("j"), "first_token_ms")) == T0 + 700
        _first_token_seen("j", 0.3)  # a gateway that stood still tells it late
        log.append([], ["j"], "gw-c")
        metrics.claimed("j", False)
        assert int(client.hget(keys.job("j"), "first_token_ms")) == T0 + 300
        assert client.hget(keys.job("j"), "ttft_observed_by") == b"gw-a"  # the claim is the first claimant's still
        # A finished job's record keeps the first token its stored TTFT was measured to.
        queue.claim(["done"], worker="wk", gateway="gw", lease_ms=60_000, now_ms=T0)
        stored = queue.complete("done", attempt=1, state="failed", fields={"ttft_s": -1.0}, worker="wk",
                                now_ms=T0 + 2000)
        assert stored
        _first_token_seen("done", 0.5)
        log.append([], ["done"], "gw-a")
        metrics.claimed("done", False)
        assert client.hget(keys.job("done"), "first_token_ms") is None


def test_the_stored_ttft_is_to_the_earliest_first_token_recorded():
    with queue_and_log("j", "k", "m") as (client, keys, queue, log):
        queue.claim(["j", "k", "m"], worker="wk", gateway="gw", lease_ms=60_000, now_ms=T0 + 100)
        for job_id in ("j", "k"):
            _first_token_seen(job_id, 0.4)
            log.append([], [job_id], "gw-a")
            metrics.claimed(job_id, False)
        # The storing gateway heard a later attempt's first token (12 s), or none (-1): the hash's is the TTFT.
        stored, _ = queue.complete_recording("j", attempt=1, state="done", worker="wk", now_ms=T0 + 20_000,
                                             fields={"ttft_s": 12.0, "num_tokens": 0, "token_ids": b"\x90"})
        assert stored.ttft_s == pytest.approx(0.4)
        assert float(queue.get("j").result["ttft_s"]) == pytest.approx(0.4)
        stored, _ = queue.complete_recording("k", attempt=1, state="failed", worker="wk", now_ms=T0 + 20_000,
                                             fields={"ttft_s": -1.0})
        assert stored.ttft_s == pytest.approx(0.4)
        # None recorded: the gateway's own figure stays, as does "none measured".
        stored, _ = queue.complete_recording("m", attempt=1, state="failed", worker="wk", now_ms=T0 + 20_000,
                                             fields={"ttft_s": 0.25})
        assert stored.ttft_s == pytest.approx(0.25)


def test_a_first_token_heard_by_a_frozen_gateway_is_the_stored_ttft(tmp_path, tiny_model_dir):
    """gw-0 admits and dispatches the job, its first token reaches the client and gw-0 writes the token log; the
    worker is killed -9, gw-0 freezes, and gw-1 runs attempt 2 (resuming from the log) and stores the result. gw-1
    never heard the first token: the stored TTFT (and the one gw-1's listener was told) was gw-1's or its worker's
    figure for attempt 2, later than the first token the client saw (0.18 s against 0.013 s; 12.8 s elsewhere)."""
    with redispatch_cluster(tmp_path, tiny_model_dir) as c:
        with Frozen(c) as frozen:
            job, bound = submit_on_gw0(c)
            hand_to_gw1(c, frozen, job.id, "gw-0 to write the token log and claim the first token",
                        lambda: "ttft_observed_by" in c.job(job.id))
            listener = c.client("batch-co", "gw-1", timeout_s=30.0)
            waiter, heard = result_in_thread(listener, job.id)  # its final message comes from gw-1's memory
            wait_for(lambda: c.state(job.id) == "done", 180, "attempt 2 to finish")
            waiter.join(30)
            listener.close()
            with c.client("batch-co", "gw-1", timeout_s=30.0) as b1:
                result = b1.job(job.id).result(timeout=30)
        h = c.job(job.id)
    assert (h["state"], h["attempt"], h["gateway"]) == (b"done", b"2", b"gw-1"), h.get("reason")
    assert 0.0 <= float(h["ttft_s"]) <= bound, (float(h["ttft_s"]), bound)
    assert result.ttft_s is not None and 0.0 <= result.ttft_s <= bound, (result.ttft_s, bound)
    assert result.ttft_s >= result.queued_s - 0.01, result
    assert "result" in heard, heard
    assert heard["result"].ttft_s == result.ttft_s, (heard["result"], result)
