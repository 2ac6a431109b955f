"""A gateway that stood still (SIGSTOP) while the job it held finished through another gateway must not write that
job's token log when it resumes: the log was deleted with the result, and a write recreates it for an hour."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid

from common.redis_keys import KeySpace
from common.redis_server import RedisServer
from common.tiers import Tier
from gateway.redis_queue import DEFAULT_TIER_TIMEOUTS_S, RedisQueue
from gateway.token_log import Appended, TokenLog
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster
from tests.test_metrics_finals import logged_tokens

T0 = 1_700_000_000_000


@contextlib.contextmanager
def queue_and_log(*job_ids: str):
    """A real redis-server with a fresh key prefix: its client, keys, queue and token log, ``job_ids`` admitted (P3)
    at T0."""
    with RedisServer() as server:
        client = server.client()
        keys = KeySpace(prefix=f"test-{uuid.uuid4().hex[:10]}")
        queue = RedisQueue(client, keys, tier_timeouts_s=DEFAULT_TIER_TIMEOUTS_S)
        for job_id in job_ids:
            queue.admit(job_id=job_id, tenant="acme", tier_requested=Tier.P3, tier=Tier.P3, payload=b"x",
                        now_ms=T0, idempotency_key=None, quota=None, drain_rate_per_s={t: 10.0 for t in Tier})
        yield client, keys, queue, TokenLog(client, keys)


def test_tokens_are_appended_only_under_the_lease_the_job_hash_names():
    with queue_and_log("j", "k") as (client, keys, queue, log):
        assert [r.id for r in queue.claim(["j"], worker="wk", gateway="gw", lease_ms=60_000, now_ms=T0)] == ["j"]
        got = log.append([("j", 0, [1, 2], "wk", 1), ("j", 2, [3], "wk", 2), ("j", 2, [3], "other", 1),
                          ("k", 0, [4], "wk", 1), ("gone", 0, [5], "wk", 1)])
        assert got == Appended([True, False, False, False, False], [])
        assert [e[2] for e in log.read({"j": "0-0"})["j"]] == [[1, 2]]
        assert 0 < client.pttl(keys.tokens("j")) <= 3_600_000
        assert not client.exists(keys.tokens("k")) and not client.exists(keys.tokens("gone"))


def test_a_gateway_resumed_after_its_job_ended_elsewhere_does_not_recreate_its_token_log(tmp_path, tiny_model_dir):
    """gw-0 dispatches a long job and freezes with the worker's token frames unread in its socket; the worker takes
    the stream to gw-1, where the job ends (its token log deleted). gw-0 resumes, still holding the lease in its
    memory, and used to append the frames it read to the deleted log (a key nobody reads, kept an hour)."""
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=1, max_running=1, lease_s=2.0) as c:
        gw0, gw1 = c.procs["gw-0"].pid, c.procs["gw-1"].pid
        stopped = {gw1}
        os.kill(gw1, signal.SIGSTOP)  # gw-0 dispatches
        try:
            with c.client("batch-co", "gw-0", timeout_s=30.0) as b0:
                job = b0.submit(prompt_token_ids=[5, 6], max_tokens=2000, ignore_eos=True, tier="P3", seed=5)
                next(iter(job.stream(timeout=60)))
            wait_for(lambda: logged_tokens(c, job.id) > 0, 30, "gw-0 to write the token log")
            os.kill(gw0, signal.SIGSTOP)  # the worker's next frames wait, unread, in gw-0's socket
            stopped.add(gw0)
            os.kill(gw1, signal.SIGCONT)
            stopped.discard(gw1)
            wait_for(lambda: c.state(job.id) == "done", 180, "the job to end through gw-1")
            assert c.job(job.id)["gateway"] == b"gw-0" and c.job(job.id)["attempt"] == b"1", "not the case tested"
            assert not c.redis.exists(f"ts:{{c}}:tok:{job.id}")
            os.kill(gw0, signal.SIGCONT)
            stopped.discard(gw0)
            time.sleep(3.0)  # gw-0 reads its backlog and flushes (every 50 ms); a wrong write happens within a second
            assert not c.redis.exists(f"ts:{{c}}:tok:{job.id}"), f"recreated: {logged_tokens(c, job.id)} tokens"
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)


def test_a_first_token_claim_asked_again_wins_again_and_only_under_its_own_tag():
    """A claim whose reply was lost (Redis ran it after the gateway gave up) is asked again under the same tag and
    won; the same gateway's claim under another tag (it restarted, or saw a first token again on a later attempt)
    loses, as another gateway's does."""
    from common.redis_keys import run_pipelined

    with queue_and_log("j") as (client, keys, queue, log):
        call = ("first_token", [keys.job("j")], ["gw-a", "tag-1"])
        assert run_pipelined(client, [call]) == [1]
        assert run_pipelined(client, [call]) == [1]
        assert run_pipelined(client, [("first_token", [keys.job("j")], ["gw-a", "tag-2"])]) == [0]
        assert run_pipelined(client, [("first_token", [keys.job("j")], ["gw-b", "tag-1"])]) == [0]
        assert run_pipelined(client, [("first_token", [keys.job("j")], ["gw-a"])]) == [0]
        assert client.hget(keys.job("j"), "ttft_observed_by") == b"gw-a"
