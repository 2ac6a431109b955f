"""The cluster's memory of drained workers, in Redis (``drained-workers``, common/lua/note_drained.lua).

A gateway remembers a worker that was draining when it timed out (gateway/workers.DRAINED_MEMORY_S), so a job only
that worker fits waits for a redeploy to bring it back. That memory was the gateway's own: one restarted while the
worker was away, or one that never heard it drain, sent such a job to a smaller worker to fail, and refused a new one
as invalid. Every gateway that hears a draining report writes the worker's size here; each reads the whole memory
back every REFRESH_S (a cached copy: no dispatch pass waits on Redis for it). While Redis does not answer, the copy
read last and the gateway's own memory decide.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import msgpack
import redis

from common.redis_keys import KeySpace, load_scripts

log = logging.getLogger("gateway")
REFRESH_S = 1.0  # how often the cached copy is read again (and how often a worker's entry is written, at most)
NOTE_MEMORY = 4096  # worker ids remembered as written lately: made-up ids cannot grow it further
MAX_ENTRIES = 1024  # entries read back at most (a worker id is up to 200 characters)


class SharedDrained:
    """``entries``: worker id -> (its tier limits, until when it counts on this gateway's clock)."""

    def __init__(self, client: redis.Redis, keys: KeySpace, ttl_s: float,
                 failed: Callable[[Exception], None] = lambda e: None) -> None:
        # ``failed``: told of a Redis error this memory goes on without (the gateway's back-off starts with it).
        self.client, self.keys, self.failed = client, keys, failed
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.entries: dict[str, tuple[dict[str, int], float]] = {}
        self._noted: OrderedDict[str, float] = OrderedDict()
        self._read_at = float("-inf")

    def note(self, worker_id: str, limits: dict[str, int] | None, now: float) -> None:
        """``worker_id`` drains (its hello or report says so): every gateway is to wait for it."""
        if not limits or now - self._noted.get(worker_id, float("-inf")) < REFRESH_S:
            return
        # Noted before Redis answers: a Redis that does not answer is asked again a while later, not at every report.
        self._noted[worker_id] = now
        self._noted.move_to_end(worker_id)
        while len(self._noted) > NOTE_MEMORY:
            self._noted.popitem(last=False)
        try:
            load_scripts(self.client)["note_drained"](keys=[self.keys.drained_workers],
                                                      args=[worker_id, msgpack.packb(limits), self.ttl_ms, ""])
        except redis.RedisError as e:
            log.warning("worker %s drains; the cluster's memory of it is not written (Redis: %s)", worker_id, e)
            self.failed(e)

    def back(self, worker_id: str) -> None:
        """``worker_id`` serves again (a hello or report that does not say it drains): no one is to wait for it."""
        # Also one this gateway wrote and has not read back yet: left, it would be waited for after a later kill.
        if self.entries.pop(worker_id, None) is None and self._noted.pop(worker_id, None) is None:
            return
        self._noted.pop(worker_id, None)
        try:
            self.client.hdel(self.keys.drained_workers, worker_id)
        except redis.RedisError as e:
            log.warning("worker %s is back; the cluster's memory of its drain stays (Redis: %s)", worker_id, e)
            self.failed(e)

    def refresh(self, now: float) -> None:
        """Read the cluster's memory again if REFRESH_S has passed (a Redis that does not answer keeps the last)."""
        if now - self._read_at < REFRESH_S:
            return
        self._read_at = now
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.hgetall(self.keys.drained_workers)
            pipe.time()
            raw, (secs, micros) = pipe.execute()
        except redis.RedisError as e:
            log.warning("the cluster's memory of drained workers is unreadable (%s); the copy read last decides", e)
            self.failed(e)
            return
        server_ms = secs * 1000 + micros // 1000
        entries = {}
        for wid, value in list(raw.items())[:MAX_ENTRIES]:
            parsed = _parse(value)
            if parsed is not None and parsed[0] > server_ms:
                entries[wid.decode(errors="replace")] = (parsed[1], now + (parsed[0] - server_ms) / 1000)
        self.entries = entries

    def alive(self, now: float) -> dict[str, dict[str, int]]:
        """The entries that still count: worker id -> its tier limits."""
        return {wid: limits for wid, (limits, until) in self.entries.items() if until > now}


def _parse(value: bytes) -> tuple[int, dict[str, int]] | None:
    """(until ms, tier limits) of an entry, or None for one this release cannot read."""
    head, sep, packed = value.partition(b" ")
    try:
        limits = msgpack.unpackb(packed) if sep and head.isdigit() else None
    except (ValueError, msgpack.UnpackException):
        return None
    if not isinstance(limits, dict) or not all(isinstance(k, str) and type(v) is int for k, v in limits.items()):
        return None
    return int(head), limits
