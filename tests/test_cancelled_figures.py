"""A cancelled job's time to first token is one figure: the final message its stream ends with and a later read of
the job (through the SDK: the JobDone frame each ends with, then JobCancelled) tell the one its record holds, its
first token after its admission (first_token_ms, taken into the record with the first token's claim:
first_token.lua). The final message told the gateway's own measure and a later read told none. On a real cluster
(gateway, worker, Redis), the cancel sent as the job's first token reaches its client: before that token's claim
(a token-log flush interval of 30 s) or after it."""

from __future__ import annotations

import pytest

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
