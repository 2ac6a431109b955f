"""The gateway's back-off while Redis is unreachable, and its pause while Redis is full.

Unreachable (a connection error or timeout): every try would stand the poll loop still for the socket timeout, so the
gateway backs off (0.1 s doubling to 2 s), answers clients 'unavailable' meanwhile and keeps serving what needs no Redis
(keepalives, the tokens of the leases it holds; worker frames that need Redis are kept aside, outage.py). Full (at its
maxmemory, noeviction): Redis still answers reads, so only the background work that writes waits a moment.

A mixin of gateway.server.Gateway: its state (_redis_backoff_s, _redis_retry_at, _background_retry_at,
_redis_full_logged_at) starts in Gateway.__init__, and the poll loop (Gateway.serve) reads it.
"""

from __future__ import annotations

import logging

from common import protocol as P
from gateway.client_api import REDIS_FULL_LOG_EVERY_S
from gateway.redis_queue import out_of_memory

log = logging.getLogger("gateway")

# A full Redis refused a write of the background work (dispatch, results, maintenance): it tries again after this.
REDIS_FULL_RETRY_S = 0.5
# After a failed try, the next waits until the client frames that piled up meanwhile are answered, but no longer than
# this past the back-off's end: a flood that never leaves the socket empty must not keep Redis untried for ever.
ANSWER_FIRST_MAX_S = 2.0


class RedisBackoff:
    """Starting, ending and telling of the back-off; what a client hears while it lasts."""

    def _redis_failed(self, e: Exception) -> None:
        """Redis is unreachable: back off (0.1 s doubling to 2 s) and keep serving what needs no Redis."""
        if out_of_memory(e):
            self._redis_full(e)
            return
        self.counters["redis_errors"] += 1
        if not self._redis_backoff_s:
            log.warning("Redis unreachable (%s); admission answers 'unavailable' until it is back", e)
        self._redis_backoff_s = min(2.0, max(0.1, self._redis_backoff_s * 2))
        self._redis_retry_at = self.clock() + self._redis_backoff_s
        # The try stood the loop still for up to the socket timeout, and client frames piled up meanwhile. Answering
        # them can take longer than the first back-offs (0.1 s, 0.2 s): the next try would then stand the loop still
        # again with them unanswered, two timeouts in a row (a client's timeout, not 'unavailable').
        self._answer_clients_first = True
        self._dirty = True

    def _redis_down(self) -> bool:
        """Redis did not answer lately and the back-off is not over, or the client frames that waited out the failed
        try are not all answered yet: a site that tries Redis and goes on without it (keepalives, the shared memories
        of drained workers and worker keys) skips it, rather than wait out the socket timeout again, one try after
        another, while no client hears even 'unavailable'."""
        now = self.clock()
        return now < self._redis_retry_at or (
            self._answer_clients_first and now < self._redis_retry_at + ANSWER_FIRST_MAX_S)

    def _clients_answered(self) -> None:
        """The client socket was found empty: every frame that waited out a failed try has its answer."""
        self._answer_clients_first = False

    def _redis_full(self, e: Exception) -> None:
        """Redis is reachable but at its maxmemory (noeviction) and refused a write. Reads, streams and cancels
        still work, so clients are not refused as if it were down; the work that writes waits a moment and tries
        again (a completion is kept until it is stored). Redis refuses only a script's first write that may use
        memory, so scripts that open with one that cannot (a claim's ZREM, a heartbeat's) still run in full."""
        self.counters["redis_full"] += 1
        now = self.clock()
        if now - self._redis_full_logged_at >= REDIS_FULL_LOG_EVERY_S:
            self._redis_full_logged_at = now
            log.warning("Redis is full (%s): dispatches and results wait for room; raise maxmemory or free memory", e)
        self._background_retry_at = now + REDIS_FULL_RETRY_S
        self._dirty = True  # a dispatch it refused is tried again with the rest

    def _redis_ok(self) -> None:
        if self._redis_backoff_s:
            log.warning("Redis reachable again")
            self._redis_backoff_s = 0.0

    def _unavailable(self) -> P.ErrorReply:
        self.counters["refused_unavailable"] += 1
        return P.ErrorReply("unavailable", "the queue (Redis) is unreachable; nothing was stored, retry",
                            retry_after_s=max(0.1, self._redis_retry_at - self.clock()))
