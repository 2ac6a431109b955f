"""A frame a gateway took for stale while Redis did not show its attempt must not stay stale once Redis does.

Redis can lose a claim (AOF everysec and a crash, or a failover to a replica that had not received it): the job is
queued again at its previous attempt, while the worker goes on running the claimed one. A gateway that reads the job
then drops the worker's frames as stale, rightly; but once the job is claimed again, for the same attempt number on
the same worker (which keeps running it: a real worker drops the new dispatch as a copy of the one it runs), Redis
names that worker's attempt again, and the frames are the lease holder's. The gateway's memory of stale triples (kept
so a flood costs no Redis reads) dropped them for good: the job's stream stalled and its completion was confirmed as
stale and lost, so the job waited out its lease and ran again.
"""

from __future__ import annotations

import time

import pytest

from common import protocol as P
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster, wait_states
from tests.test_gateway_restart_replay import RawWorker

pytestmark = pytest.mark.faults


def lose_the_claim(c: DurableCluster, job_id: str) -> None:
    """What Redis holds of ``job_id`` if its claim was never written: queued again, an attempt less."""
    base = "ts:{c}"
    h = c.job(job_id)
    pipe = c.redis.pipeline()
    pipe.hset(f"{base}:job:{job_id}", mapping={"state": "queued"})
    pipe.hincrby(f"{base}:job:{job_id}", "attempt", -1)
    pipe.hdel(f"{base}:job:{job_id}", "worker", "gateway", "dispatched_at_ms")
    pipe.zrem(f"{base}:inflight", job_id)
    pipe.zadd(f"{base}:q:{h['tier'].decode()}", {job_id: int(h["enqueued_at_ms"])})
    pipe.execute()


def sync(wk: RawWorker) -> None:
    """Every frame ``wk`` sent before is handled: a completion of no job is answered, after them."""
    wk.send(P.JobFinished("no-such-job", 1, "failed", None, 0, None, 0.0, 0, "sync", []))
    assert wk.recv(P.JobFinishedAck, 30) is not None


def test_a_frame_taken_for_stale_while_redis_lost_its_claim_counts_once_redis_names_its_lease(
        tmp_path, tiny_model_dir):
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=0, lease_s=60.0) as c:
        wk0 = RawWorker(c.gateways["gw-0"][1])
        client = c.client("lab-co", "gw-0")
        wk1 = None
        try:
            wait_for(lambda: len(client.info().workers) == 1, 30, "gw-0 to hear the raw worker")
            job = client.submit(prompt_token_ids=[3, 4, 5], max_tokens=4, seed=1, ignore_eos=True)
            d = wk0.recv(P.DispatchJob, 30)
            assert d is not None and (d.job_id, d.attempt) == (job.id, 1)
            wk0.held = [job.id]
            # gw-0 restarts (it holds no lease of its own now) and Redis loses the claim meanwhile.
            c.kill("gw-0")
            lose_the_claim(c, job.id)
            c.restart("gw-0")
            wk0.hello()
            wait_for(lambda: len(client.info().workers) == 1, 60, "the restarted gw-0 to hear the worker")
            tokens = [10, 11, 12, 13]
            wk0.send(P.JobTokens(job.id, 1, 0, tokens[:2]))
            sync(wk0)  # dropped as stale: Redis has the job queued
            assert c.state(job.id) == "queued"
            # gw-1 claims it again: attempt 1 again, on the same worker, which goes on with the run it has.
            wk1 = RawWorker(c.gateways["gw-1"][1])
            again = wk1.recv(P.DispatchJob, 30)
            assert again is not None and (again.job_id, again.attempt) == (job.id, 1)
            wk1.held = [job.id]
            time.sleep(1.1)  # past any re-check interval of the memory of stale frames
            wk0.send(P.JobTokens(job.id, 1, 2, tokens[2:]))
            wk0.send(P.JobFinished(job.id, 1, "done", "length", 4, 0.1, 1.0, 0, None, tokens))
            assert wk0.recv(P.JobFinishedAck, 10) is not None
            # Stored from the lease holder's frame, not dropped as stale (the job would wait out its 60 s lease).
            wait_states(c, [job.id], {"done", "failed", "dead"}, 10)
            assert c.state(job.id) == "done" and c.stored_tokens(job.id) == tokens
            assert job.result(timeout=30).token_ids == tokens
        finally:
            client.close()
            wk0.close()
            if wk1 is not None:
                wk1.close()
