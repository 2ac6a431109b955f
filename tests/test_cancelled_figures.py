"""A cancelled job's time to first token is one figure: the final message its stream ends with and a later read of
the job (through the SDK: the JobDone frame each ends with, then JobCancelled) tell the one its record holds, its
first token after its admission (first_token_ms, taken into the record with the first token's claim:
first_token.lua). The final message told the gateway's own measure and a later read told none. On a real cluster
(gateway, worker, Redis), the cancel sent as the job's first token reaches its client: before that token's claim
(a token-log flush interval of 30 s) or after it."""

from __future__ import annotations

import time

import pytest
import zmq

from common import protocol as P
from common.sockets import make_socket
from gateway.sdk import JobCancelled
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster


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


@pytest.mark.xfail(strict=True, reason="a cancel through a gateway that does not hold the job ends its readers there "
                   "with no TTFT, and the holder's later claim records one (first_token.lua): reported, not fixed")
def test_a_cancel_through_a_gateway_not_holding_the_job_tells_its_readers_the_ttft_a_later_read_tells(
        tmp_path, tiny_model_dir):
    """The first token reached the gateway holding the job (gw A, its token-log flush 4 s away); the job is cancelled
    through the other (gw B), where a reader streams it. B's final message tells the TTFT of the record as the cancel
    found it: none (A's claim is pending on A). A's flush then claims the token, and first_token.lua takes it into the
    cancelled job's record: a later read tells 0.009 s where the final message told None."""
    env = {"TS_GATEWAY_STREAM_FLUSH_INTERVAL_S": "4.0"}
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=1, gateway_env=env) as c:
        clients = {gw: c.client("lab-co", gw, timeout_s=60.0) for gw in ("gw-0", "gw-1")}
        reader = make_socket(zmq.Context.instance(), zmq.DEALER)
        try:
            for seed in range(4):  # a flush between the first token and the cancel: that job is not the case
                job = clients["gw-0"].submit(prompt_token_ids=[9, 10], max_tokens=2000, ignore_eos=True, tier="P3",
                                             seed=seed)
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
            wait_for(lambda: "first_token_ms" in c.job(job.id), 15, "the holder's claim")
            h = c.job(job.id)
            later = clients[other].job(job.id)
            with pytest.raises(JobCancelled):
                later.result(timeout=30)
        finally:
            reader.close(linger=0)
            for client in clients.values():
                client.close()
    recorded = (int(h["first_token_ms"]) - int(h["enqueued_at_ms"])) / 1000
    assert later._done.ttft_s == recorded
    assert final.ttft_s == recorded, (final.ttft_s, later._done.ttft_s, recorded)
