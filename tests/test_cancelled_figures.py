"""A cancelled job's figures are one set: the final message its stream ends with and a later read of the job
(through the SDK: the JobDone frame each ends with, then JobCancelled) tell the ones its record ended with: its first
token (first_token_ms: the holder's pending claim goes with the cancel, first_token.lua), its first prefill start,
its end and its reason, each after its admission. The record a job ended with is final: a claim after the cancel
records nothing. On a real cluster (gateways, a worker, Redis), the cancel sent as the job's first token reaches its
client: through the gateway holding it, before that token's claim (a token-log flush interval of 30 s) or after it;
and through the other gateway, before the holder's claim."""

from __future__ import annotations

import os
import signal
import time

import pytest
import zmq

from common import protocol as P
from common.ports import free_port
from common.sockets import make_socket
from gateway.sdk import JobCancelled
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster
from tests.test_metrics import scrape, total

FLUSH_S = 4.0  # long enough that a cancel sent on the first streamed token beats its claim


@pytest.mark.parametrize("claimed", [False, True], ids=["cancelled_before_the_claim", "cancelled_after_it"])
def test_a_cancelled_jobs_final_message_and_a_later_read_tell_the_ttft_its_record_holds(tmp_path, tiny_model_dir,
                                                                                       claimed):
    env = {"TS_GATEWAY_STREAM_FLUSH_INTERVAL_S": "0.05" if claimed else "30"}
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=1, gateway_env=env) as c:
        with c.client("lab-co", timeout_s=60.0) as client:
            job = client.submit(prompt_token_ids=[9, 10], max_tokens=2000, ignore_eos=True, tier="P3", seed=3)
            chunks = job.stream(timeout=60)
            next(chunks)
            if claimed:
                wait_for(lambda: "ttft_observed_by" in c.job(job.id), 30, "the first token's claim")
            else:  # a flush between the first token and this read is a chance of a few ms in 30 s
                assert "ttft_observed_by" not in c.job(job.id), "the first token was claimed: the case was not set up"
            assert job.cancel()
            with pytest.raises(JobCancelled):
                for _ in chunks:
                    pass
            live = job._done  # the final message the stream ended with (the SDK keeps it; JobCancelled carries none)
            # Read at once: the record holds the first token already, whichever gateway reads it.
            h = c.job(job.id)
            later = client.job(job.id)
            with pytest.raises(JobCancelled):
                later.result(timeout=30)
    assert h["state"] == b"cancelled" and "first_token_ms" in h, sorted(h)
    recorded = (int(h["first_token_ms"]) - int(h["enqueued_at_ms"])) / 1000
    assert (live.state, later._done.state) == ("cancelled", "cancelled")
    assert live.ttft_s == recorded and later._done.ttft_s == recorded, (live.ttft_s, later._done.ttft_s, recorded)
    # Its wait and total likewise: to the first prefill start recorded with the cancel, and to the cancel.
    assert "first_prefill_ms" in h, sorted(h)
    told = [(m.queued_s, m.total_s, m.reason) for m in (live, later._done)]
    assert told[0] == told[1] == ((int(h["first_prefill_ms"]) - int(h["enqueued_at_ms"])) / 1000,
                                  (int(h["finished_at_ms"]) - int(h["enqueued_at_ms"])) / 1000,
                                  h["reason"].decode()), told


def test_a_cancel_through_a_gateway_not_holding_the_job_tells_its_readers_the_figures_a_later_read_tells(
        tmp_path, tiny_model_dir):
    """The first token reached the gateway holding the job (its token-log flush FLUSH_S away); the job is cancelled
    through the other, where a reader streams it. That reader's final message tells the record as the cancel ended
    it: no TTFT (the holder's claim was pending), and the record's total and wait. The holder's claim after the
    cancel took the first token into the ended record (first_token.lua): a later read told 0.009 s where the final
    message told None, and ts_time_to_first_token_seconds counted it; the final message told a total and a wait of
    0.0 (the reading gateway had not admitted the job). The record a job ended with is final: the claim loses and
    records nothing, and the count is one per record that holds a first token, exactly."""
    binds = {gw: f"127.0.0.1:{free_port()}" for gw in ("gw-0", "gw-1")}
    env = {"TS_GATEWAY_STREAM_FLUSH_INTERVAL_S": str(FLUSH_S)}
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=1, gateway_env=env,
                        process_env={gw: {"TS_GATEWAY_METRICS_BIND": b} for gw, b in binds.items()}) as c:
        def firsts() -> float:
            return sum(total(scrape(f"http://{b}/metrics"), "ts_time_to_first_token_seconds_count", tier="P3")
                       for b in binds.values())

        start = firsts()
        jobs: list[str] = []
        clients = {gw: c.client("lab-co", gw, timeout_s=60.0) for gw in binds}
        reader = make_socket(zmq.Context.instance(), zmq.DEALER)
        try:
            for seed in range(4):  # a flush between the first token and the cancel: that job is not the case
                job = clients["gw-0"].submit(prompt_token_ids=[9, 10], max_tokens=2000, ignore_eos=True, tier="P3",
                                             seed=seed)
                jobs.append(job.id)
                holder = wait_for(lambda: c.job(job.id).get("gateway"), 60, "the job's dispatch").decode()
                other = "gw-1" if holder == "gw-0" else "gw-0"
                reader.close(linger=0)
                reader = make_socket(zmq.Context.instance(), zmq.DEALER)
                reader.connect(c.endpoint(other))
                reader.send(P.encode(P.StreamRequest(c.key("lab-co"), job.id, request_id="read")))
                # Answered in order: the status reply says the subscription before it was taken.
                reader.send(P.encode(P.StatusRequest(c.key("lab-co"), job.id, request_id="sync")))
                assert reader.poll(30_000) and P.decode(reader.recv()).request_id == "sync"
                next(iter(clients[holder].job(job.id).stream(timeout=60)))
                assert clients[other].cancel(job.id)
                if "ttft_observed_by" not in c.job(job.id):
                    break
            else:
                raise AssertionError("every cancel came after its first token's claim: the case was not set up")
            final = None
            deadline = time.monotonic() + 30
            while final is None and time.monotonic() < deadline and reader.poll(1000):
                msg = P.decode(reader.recv())
                final = msg if isinstance(msg, P.JobDone) else None
            assert final is not None and final.state == "cancelled", final
            # The holder's pending claim goes with its next flush, after that flush's token-log entries, with every
            # other claim pending there: a job only it can dispatch (the other stopped), its worker stopped on its
            # first token, has entries in the log once a flush after the cancel tried the cancelled job's claim.
            os.kill(c.procs[other].pid, signal.SIGSTOP)
            try:
                probe = clients[holder].submit(prompt_token_ids=[11, 12], max_tokens=2000, ignore_eos=True,
                                               tier="P3", seed=9)
                jobs.append(probe.id)
                next(iter(probe.stream(timeout=60)))
                os.kill(c.procs["wk-0"].pid, signal.SIGSTOP)
                try:
                    wait_for(lambda: c.redis.xlen(f"ts:{{c}}:tok:{probe.id}") > 0, 3 * FLUSH_S,
                             "the holder's next flush")
                finally:
                    os.kill(c.procs["wk-0"].pid, signal.SIGCONT)
            finally:
                os.kill(c.procs[other].pid, signal.SIGCONT)
            assert c.job(probe.id).get("ttft_observed_by") == holder.encode()
            assert clients[holder].cancel(probe.id)
            h = c.job(job.id)
            later = clients[other].job(job.id)
            with pytest.raises(JobCancelled):
                later.result(timeout=30)
            records = [c.job(j) for j in jobs]
            held = sum(1 for r in records if r.get("first_token_ms") or float(r.get("ttft_s", b"-1")) >= 0)
            # Each claim is observed as its flush's reply is read, a moment after Redis shows it won.
            wait_for(lambda: firsts() - start >= held, 10, "the claims won to be counted")
            counted = firsts() - start
        finally:
            reader.close(linger=0)
            for client in clients.values():
                client.close()
    told = [(m.ttft_s, m.total_s, m.queued_s, m.reason) for m in (final, later._done)]
    assert told[0] == told[1], told
    assert h["state"] == b"cancelled" and "first_token_ms" not in h and final.ttft_s is None, (sorted(h), told)
    assert final.total_s == (int(h["finished_at_ms"]) - int(h["enqueued_at_ms"])) / 1000
    assert counted == held, (counted, held)
