"""ts_time_to_first_token_seconds counts a first token once per job whose record holds one (first_token_ms, or a
result's ttft_s >= 0): the claim that observes it (first_token.lua) goes with the token-log flush, up to one flush
after the token came, and by then the job may have ended. A job cancelled (expired, dead-lettered) between its first
token and that flush had the token counted while its record held none: its claim won on the ended job but recorded
nothing. Such a record now takes the first token with the claim (a cancelled job has no result: its first token is
the TTFT its final message and later reads tell, tests/test_cancelled_figures.py);
a stored result's figures stay as stored, and a claim on a result that holds no first token loses."""

from __future__ import annotations

import time

from common import protocol as P
from common.ports import free_port
from common.redis_keys import run_pipelined
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster
from tests.test_durability import Adversary
from tests.test_metrics import scrape, total
from tests.test_token_log_stale_writer import T0, queue_and_log

FLUSH_S = 4.0  # long enough that a cancel sent on the first streamed token beats the claim


def _claim(client, keys, job_id: str, gateway: str, after_ms: int) -> int:
    return run_pipelined(client, [("first_token", [keys.job(job_id)], [gateway, "tag", after_ms])])[0]


def test_a_claim_after_the_job_was_cancelled_records_the_first_token_it_counts():
    with queue_and_log("j") as (client, keys, queue, _):
        queue.claim(["j"], worker="wk", gateway="gw", lease_ms=60_000, now_ms=T0)
        assert queue.cancel("j", now_ms=T0 + 900) is not None
        assert _claim(client, keys, "j", "gw-a", 400) == 1
        h = client.hgetall(keys.job("j"))
        assert h[b"state"] == b"cancelled" and int(h[b"first_token_ms"]) == T0 + 400
        assert h[b"ttft_observed_by"] == b"gw-a"
        assert _claim(client, keys, "j", "gw-b", 300) == 0  # counted once; the earliest kept
        assert int(client.hget(keys.job("j"), "first_token_ms")) == T0 + 300


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


def test_a_job_cancelled_on_its_first_token_counts_it_once_and_its_record_holds_it(tmp_path, tiny_model_dir):
    """Real gateways whose token-log flush comes every FLUSH_S: a job is cancelled through the gateway that does not
    hold it as its first token reaches a client of the one that does, before that one's flush claims the token (the
    gateway holding a job claims a pending first token with the cancel itself: tests/test_cancelled_figures.py); the
    flush after the cancel claims it. The count must match the records, exactly."""
    binds = {gw: f"127.0.0.1:{free_port()}" for gw in ("gw-0", "gw-1")}
    env = {"TS_GATEWAY_STREAM_FLUSH_INTERVAL_S": str(FLUSH_S)}
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=1, gateway_env=env,
                        process_env={gw: {"TS_GATEWAY_METRICS_BIND": b} for gw, b in binds.items()}) as c:
        def firsts() -> float:
            return sum(total(scrape(f"http://{b}/metrics"), "ts_time_to_first_token_seconds_count", tier="P3")
                       for b in binds.values())

        start = firsts()
        cancelled = []
        clients = {gw: c.client("lab-co", gw, timeout_s=60.0) for gw in binds}
        try:
            # A flush may fall between the first token and the cancel (a few ms of FLUSH_S): then that job is not
            # the case under test, and the next one is.
            for seed in range(4):
                job = clients["gw-0"].submit(prompt_token_ids=[9, 10], max_tokens=2000, ignore_eos=True, tier="P3",
                                             seed=seed)
                holder = wait_for(lambda: c.job(job.id).get("gateway"), 60, "the job's dispatch").decode()
                next(iter(clients[holder].job(job.id).stream(timeout=60)))
                assert clients["gw-1" if holder == "gw-0" else "gw-0"].cancel(job.id)
                cancelled.append(job.id)
                if "ttft_observed_by" not in c.job(job.id):
                    break
            else:
                raise AssertionError("every cancel came after its first token's claim: the case was not set up")
        finally:
            for client in clients.values():
                client.close()
        assert c.job(cancelled[-1])["state"] == b"cancelled"
        # Each job's first token reached its client, so its holder saw it: the flush after the cancel claims the
        # last one's. Counted once each, no more.
        wait_for(lambda: firsts() - start >= len(cancelled), 3 * FLUSH_S, "every first token counted")
        records = [c.job(j) for j in cancelled]
        assert firsts() - start == len(cancelled)
    held = sum(1 for r in records if r.get("first_token_ms") or float(r.get("ttft_s", b"-1")) >= 0)
    assert held == len(cancelled), [sorted(r) for r in records]


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
