"""The deadline admit.lua, claim.lua and cancel.lua take (gateway/redis_queue.py, _reply_deadline_ms): in Redis's
clock, a moment before the gateway gives up on the reply. It must leave a Redis that answers at once on time,
whatever reply timeout the operator chose (redis_url may carry ``socket_timeout``, which redis-py lets override the
gateway's 2 s)."""

from __future__ import annotations

import dataclasses

import redis

from common.redis_keys import KeySpace
from common.redis_server import RedisServer
from common.tiers import ALL_TIERS, Tier
from gateway.redis_queue import Admitted, RedisQueue
from tests.test_security_redis import _Gateway

_ADMIT = dict(tenant="a", tier_requested=Tier.P3, tier=Tier.P3, payload=b"x", idempotency_key=None, quota=None,
              drain_rate_per_s={})


def test_a_reply_timeout_shorter_than_the_margin_still_admits_claims_and_cancels():
    # With a 0.2 s timeout, the deadline was placed 0.05 s before the clock sample's own moment: every admission
    # was "late" (refused as unavailable), every claim claimed nothing and every cancel failed, for good.
    with RedisServer() as s:
        client = redis.Redis.from_url(s.url + "?socket_timeout=0.2")
        q = RedisQueue(client, KeySpace(prefix="short-timeout"), tier_timeouts_s={t: None for t in ALL_TIERS})
        try:
            q.server_ms()
            assert isinstance(q.admit(job_id="j1", **_ADMIT), Admitted)
            assert [r.id for r in q.claim(["j1"], worker="w", gateway="g", lease_ms=10_000)] == ["j1"]
            assert q.cancel("j1").state == "dispatched"
            # The deadline still bounds a script that runs late: a sample 10 s old in Redis's clock places it past.
            now_ms, read_by = q.clock_sample
            q.clock_sample = (now_ms - 10_000, read_by)
            assert q._reply_deadline_ms() and int(q._reply_deadline_ms()) < now_ms
        finally:
            client.close()


def test_a_gateway_whose_redis_url_sets_a_short_socket_timeout_admits(tmp_path):
    with RedisServer() as s:
        url = s.url + "?socket_timeout=0.2"
        gw = _Gateway(tmp_path, dataclasses.make_dataclass("Url", ["url"])(url))
        try:
            with gw.client("chat-co", timeout_s=10.0) as c:
                job = c.submit(prompt_token_ids=[1, 2, 3], max_tokens=2)
                assert c.status(job.id).state == "queued"
                assert c.cancel(job.id)
        finally:
            gw.stop()
