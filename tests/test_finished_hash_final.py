"""A finished job's hash is final when its result is stored: the bookkeeping a gateway writes into it at its next
token-log flush (its first prefill start, first_prefill.lua; its first-token claim, first_token.lua) is written
before the completion, not up to one flush after it. Written after, it changed a finished job's record under a
client that had read the result (a test's "a refusal changed nothing" snapshot saw it move), and, with a long flush
interval, the start was missing when the result was stored. Real parts: redis-server, a gateway, a tiny-model
worker; the gateway's flush interval is stretched to 600 s so that only the completion path can write them."""

from __future__ import annotations

from tests.durable_cluster import DurableCluster


def test_a_job_that_ends_within_a_flush_has_its_start_and_first_token_recorded_with_its_result(tmp_path,
                                                                                                tiny_model_dir):
    env = {"TS_GATEWAY_STREAM_FLUSH_INTERVAL_S": "600"}
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=1, gateway_env=env) as c:
        with c.client("batch-co", timeout_s=60.0) as client:
            jobs = [client.submit(prompt_token_ids=[5, 6, 7], max_tokens=3, ignore_eos=True, tier="P3", seed=i)
                    for i in range(3)]
            for job in jobs:
                result = job.result(timeout=60)
                assert len(result.token_ids) == 3
                h = c.job(job.id)  # read once the result is known: nothing may be written into it later
                assert h["state"] == b"done"
                assert "first_prefill_ms" in h and "ttft_observed_by" in h, sorted(h)
                assert int(h["first_prefill_ms"]) >= int(h["enqueued_at_ms"])
