"""A job that ended without a result in a gateway's maintenance pass (dead-lettered when its last lease ran out,
expired in its queue) ends its stream with a final message that tells the figures a later read of the job tells: its
record's TTFT (first_token_ms), its wait (first_prefill_ms) and its total (finished_at_ms), each after its admission
on Redis's clock, and its reason. The final message told the gateway's own measures: its TTFT and total on its own
clock, its wait as the whole time; and a reason of its own ("queue timeout exceeded" where the record and every later
read said "queue timeout of 1s for tier P2 exceeded"). On a real cluster (a gateway, a worker killed -9, Redis)."""

from __future__ import annotations

import pytest

from common.errors import JobExpired, JobFailed
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster
from tests.test_metrics_finals import logged_tokens


def _told(done) -> tuple:
    return done.state, done.ttft_s, done.queued_s, done.total_s, done.reason


def _recorded(h: dict[bytes, bytes], field: str) -> float | None:
    return (int(h[field]) - int(h["enqueued_at_ms"])) / 1000 if field in h else None


def test_a_dead_lettered_and_an_expired_jobs_final_messages_tell_what_a_later_read_tells(tmp_path, tiny_model_dir):
    env = {"TS_GATEWAY_MAX_ATTEMPTS": "1", "TS_GATEWAY_TIER_TIMEOUTS_S": '{"P0": 30, "P1": 60, "P2": 1}'}
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=1, lease_s=2.0, gateway_env=env) as c:
        with c.client("batch-co", timeout_s=60.0) as client:
            dying = client.submit(prompt_token_ids=[5, 6], max_tokens=2000, ignore_eos=True, tier="P3", seed=3)
            chunks = dying.stream(timeout=60)
            next(chunks)
            # Its first token claimed and its start recorded (the token-log flush), so its record has figures to tell.
            wait_for(lambda: logged_tokens(c, dying.id) > 0 and "ttft_observed_by" in c.job(dying.id), 30,
                     "the job's first token in its record")
            c.kill("wk-0")
            with pytest.raises(JobFailed):
                for _ in chunks:
                    pass
            # No worker left (it timed out): the wait estimate refuses nothing, and the P2 job waits out its 1 s.
            wait_for(lambda: not client.info().workers, 30, "the killed worker to time out")
            expiring = client.submit(prompt_token_ids=[7], max_tokens=1, tier="P2")
            with pytest.raises(JobExpired):
                for _ in expiring.stream(timeout=60):
                    pass
            told = {j.id: _told(j._done) for j in (dying, expiring)}
            later = {}
            for job, error in ((dying, JobFailed), (expiring, JobExpired)):
                again = client.job(job.id)
                with pytest.raises(error):
                    again.result(timeout=30)
                later[job.id] = _told(again._done)
            records = {j.id: c.job(j.id) for j in (dying, expiring)}
    assert told == later, (told, later)
    h = records[dying.id]
    assert told[dying.id] == ("dead", _recorded(h, "first_token_ms"), _recorded(h, "first_prefill_ms"),
                              _recorded(h, "finished_at_ms"), h["reason"].decode()), (told, sorted(h))
    h = records[expiring.id]
    assert told[expiring.id] == ("expired", None, _recorded(h, "finished_at_ms"), _recorded(h, "finished_at_ms"),
                                 h["reason"].decode())
