"""ts_time_to_first_token_seconds counts a first token once per job whose record holds one (first_token_ms, or a
result's ttft_s >= 0): the claim that observes it (first_token.lua) goes with the token-log flush, up to one flush
after the token came, and by then the job may have ended. The record a job ended with is final (its final message
told its readers that record's figures): a claim on a job cancelled, expired or dead-lettered since loses and records
nothing, and the gateway holding a job claims its pending first token with the cancel itself
(redis_queue.cancel_recording; on a real cluster: tests/test_cancelled_figures.py, which checks the count too);
a stored result's figures stay as stored, and a claim on a result that holds no first token loses."""

from __future__ import annotations

import time

from common import protocol as P
from common.ports import free_port
from common.redis_keys import run_pipelined
from common.tiers import Tier
from gateway import metrics
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster
from tests.test_durability import Adversary
from tests.test_metrics import scrape, total
from tests.test_token_log_stale_writer import T0, queue_and_log


def _claim(client, keys, job_id: str, gateway: str, after_ms: int) -> int:
    return run_pipelined(client, [("first_token", [keys.job(job_id)], [gateway, "tag", after_ms])])[0]


def test_a_claim_after_the_job_ended_loses_and_changes_nothing():
    with queue_and_log("c", "d") as (client, keys, queue, _):
        queue.admit(job_id="e", tenant="acme", tier_requested=Tier.P2, tier=Tier.P2, payload=b"x", now_ms=T0,
                    idempotency_key=None, quota=None, drain_rate_per_s={t: 10.0 for t in Tier})
        queue.claim(["c", "d"], worker="wk", gateway="gw", lease_ms=60_000, now_ms=T0)
        assert queue.cancel("c", now_ms=T0 + 900) is not None
        assert [r.id for r in queue.expire_records(T0 + 300_001)] == ["e"]
        assert [(s.job_id, s.state) for s in queue.requeue_expired(T0 + 60_001, max_attempts=1)] == [("d", "dead")]
        for job_id, state in (("c", b"cancelled"), ("e", b"expired"), ("d", b"dead")):
            before = client.hgetall(keys.job(job_id))
            assert before[b"state"] == state
            assert _claim(client, keys, job_id, "gw-a", 400) == 0
            assert client.hgetall(keys.job(job_id)) == before


def test_the_holders_cancel_records_its_pending_first_token_and_wins_its_claim():
    with queue_and_log("j", "k") as (client, keys, queue, _):
        queue.claim(["j", "k"], worker="wk", gateway="gw", lease_ms=60_000, now_ms=T0)
        metrics.holding("j", "P3", 100.0, False)
        metrics.first_token("j", 100.4)
        tag = metrics.claim_tag("j")
        before, won = queue.cancel_recording("j", now_ms=T0 + 900, first_prefill_ms=T0 + 100,
                                             first_token_claim="gw-a")
        assert won and before.state == "dispatched" and before.finished_at_ms == T0 + 900
        assert (int(before.result["first_token_ms"]), int(before.result["first_prefill_ms"])) == (T0 + 400, T0 + 100)
        h = client.hgetall(keys.job("j"))
        assert h[b"state"] == b"cancelled" and int(h[b"first_token_ms"]) == T0 + 400
        assert (h[b"ttft_observed_by"], h[b"ttft_claim"]) == (b"gw-a", tag.encode())
        # Its reply lost, the claim asked again under its tag wins again, changing nothing; another's loses.
        assert run_pipelined(client, [("first_token", [keys.job("j")], ["gw-a", tag, 300])]) == [1]
        assert _claim(client, keys, "j", "gw-b", 300) == 0
        assert client.hgetall(keys.job("j")) == h
        metrics.claimed("j", won)
        # Nothing pending: the cancel alone, which a job ended already does not take.
        before, won = queue.cancel_recording("k", now_ms=T0 + 900)
        assert before.state == "dispatched" and not won and "first_token_ms" not in before.result
        assert queue.cancel_recording("j", first_token_claim="gw-a") == (None, False)


def test_a_claim_on_a_result_stored_without_a_first_token_loses_and_changes_nothing():
    with queue_and_log("f", "d") as (client, keys, queue, _):
        queue.claim(["f", "d"], worker="wk", gateway="gw", lease_ms=60_000, now_ms=T0)
        assert queue.complete("f", attempt=1, state="failed", fields={"ttft_s": -1.0}, worker="wk", now_ms=T0 + 2000)
        before = client.hgetall(keys.job("f"))
        assert _claim(client, keys, "f", "gw-a", 500) == 0
        assert client.hgetall(keys.job("f")) == before
        # A result whose TTFT was stored: counted by whichever claim comes first, its figures unchanged.
        assert queue.complete("d", attempt=1, state="done", worker="wk", now_ms=T0 + 2000,
                              fields={"ttft_s": 1.5, "num_tokens": 0, "token_ids": b"\x90"})
        assert _claim(client, keys, "d", "gw-a", 500) == 1
        h = client.hgetall(keys.job("d"))
        assert b"first_token_ms" not in h and float(h[b"ttft_s"]) == 1.5


def test_a_redispatch_to_a_worker_that_does_not_resume_counts_the_first_token_its_records_hold(tmp_path,
                                                                                                 tiny_model_dir):
    """A worker whose hello does not say ``resumes`` (an older one: tests/test_durability.Adversary speaks for it)
    runs a re-dispatched job again from its prompt. The gateway took the lost attempt's first token as counted
    already: where that attempt had produced none (handed back before its first token), the stored result held a
    TTFT that ts_time_to_first_token_seconds never counted. Where it had produced one, that one is still counted
    once."""
    bind = f"127.0.0.1:{free_port()}"
    url = f"http://{bind}/metrics"
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=0,
                        process_env={"gw-0": {"TS_GATEWAY_METRICS_BIND": bind}}) as c:
        old = Adversary(c.gateways["gw-0"][1], "wk-old", slots=1)
        try:
            old.load([], free=1)
            with c.client("lab-co", timeout_s=30.0) as client:
                wait_for(lambda: client.info().workers == ["wk-old"], 30, "the gateway to know the worker")
                start = total(scrape(url), "ts_time_to_first_token_seconds_count", tier="P3")
                jobs = []
                for first_attempt_tokens in ([], [7]):
                    job = client.submit(prompt_token_ids=[1, 2], max_tokens=2, ignore_eos=True, tier="P3", seed=1)
                    d = old.recv(P.DispatchJob, beat=[])
                    assert (d.job_id, d.attempt) == (job.id, 1)
                    if first_attempt_tokens:
                        old.send(P.JobTokens(job.id, 1, 0, first_attempt_tokens, 0.0, 0.0))
                        wait_for(lambda: "ttft_observed_by" in c.job(job.id), 30, "attempt 1's first token claimed")
                    old.send(P.JobReleased(job.id, 1))  # handed back: the gateway requeues it at once
                    d = old.recv(P.DispatchJob, beat=[])
                    assert (d.job_id, d.attempt, d.resume_token_ids) == (job.id, 2, [])
                    old.send(P.JobTokens(job.id, 2, 0, [7], 0.0, 0.0))
                    old.send(P.JobFinished(job.id, 2, "done", "length", 2, 0.01, 0.1, 0, None, [7, 8], 0.0, 0.0))
                    old.recv(P.JobFinishedAck, beat=[])
                    assert job.result(timeout=30).token_ids == [7, 8]
                    jobs.append(job.id)

                def counted() -> float:
                    return total(scrape(url), "ts_time_to_first_token_seconds_count", tier="P3") - start

                records = [c.job(j) for j in jobs]
                held = sum(1 for r in records if r.get("first_token_ms") or float(r.get("ttft_s", b"-1")) >= 0)
                assert held == len(jobs), [sorted(r) for r in records]
                # The claims go with the completions, observed before each result was sent: a count short of the
                # books does not catch up, so it is read once it has had time to, then checked exactly.
                deadline = time.monotonic() + 10
                while counted() < held and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert counted() == held, (counted(), held)
        finally:
            old.close()
