"""Periodic maintenance: worker timeouts, expired leases, aging, queue timeouts, drain rates.

A mixin of gateway.server.Gateway; any number of gateways may run it at once (the scripts make it safe).
"""

from __future__ import annotations

import logging

from gateway.timeutil import ms as _ms

log = logging.getLogger("gateway")


class Maintenance:
    """The maintenance pass, run every ``maintenance_interval_s``."""

    def maintenance(self, now: float) -> None:
        for wid in self.workers.expire(now):
            log.warning("worker %s timed out; its leases will expire", wid)
        now_ms = _ms(now)
        for job_id, state in self.queue.requeue_expired(now_ms, self.config.max_attempts):
            self._dirty = True
            if state == "dead":
                self._finish_stream(job_id, "dead", None, "lease expired too many times")
        if self.queue.age(now_ms, _ms(self.config.aging_interval_s)):
            self._dirty = True
        for job_id in self.queue.expire(now_ms):
            self._finish_stream(job_id, "expired", None, "queue timeout exceeded")
        self._measured_rates = {t: st.rate_per_s for t, st in self.queue.drain_stats(now_ms).items()}
        self._dirty = True  # jobs admitted by other gateways, or capacity reported meanwhile
