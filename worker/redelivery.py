"""What a gateway may have lost, sent again: a worker's frames to a gateway that restarted, hung or died are gone,
and its clients would wait, for a stream's next tokens or a job's completion, until a lease ran out.

- a lost connection (worker/routes.py): that gateway's jobs stream through a connected one, every token so far first;
- a gateway silent past ``SILENT_RECONNECT_S``: connected anew, hello'd, and its jobs' tokens replayed;
- completions and hand-backs no gateway confirmed (worker/completions.py): sent again to every gateway, after a hello.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import zmq

from common import protocol as P
from worker.intake import RunningJob
from worker.routes import SILENT_RECONNECT_S

log = logging.getLogger("worker")


class Redelivery:
    """The worker service's repairs (a mixin of worker.service.WorkerService, under its socket lock): needs its
    ``config``, ``sockets``, ``routes``, ``jobs``, ``unconfirmed``, ``unconfirmed_releases``, ``counters``,
    ``clock``, ``_send`` and ``_hello``."""

    def _reroute(self, gone: zmq.Socket) -> None:
        """The connection to a gateway was lost: its jobs' tokens go to a connected one, every token so far first
        (worker/routes.py)."""
        other = self.routes.other_than(gone)
        moved = [job for job in self.jobs.values() if job.reply is gone] if other is not None else []
        for job in moved:
            job.reply = other
        self._replay_tokens(other, moved)
        if moved:
            self.counters["rerouted"] += len(moved)
            log.warning("lost the connection to a gateway: %d jobs now stream through another", len(moved))

    def _reconnect_silent(self) -> None:
        """A gateway that answers no hello may hold this worker's identity on a dead pipe (worker/routes.py)."""
        for sock in self.routes.silent(dict(zip(self.sockets, self.config.gateways)), self.clock()):
            log.warning("gateway %s answered nothing for %.0f s: connecting to it anew",
                        self.config.gateways[self.sockets.index(sock)], SILENT_RECONNECT_S)
            self._hello([sock])
            self._replay_tokens(sock, [job for job in self.jobs.values() if job.reply is sock])

    def _replay_tokens(self, sock: zmq.Socket, jobs: list[RunningJob]) -> None:
        """Every token so far of ``jobs``, through ``sock``: a gateway that dropped their token frames (it restarted)
        or that takes over their streams has a gap that would hold every client of the job until its completion
        filled it. The gateway takes the tokens it has already seen as seen (a frame counts from the first index it
        lacks)."""
        for job in jobs:
            if job.tokens:
                self._send(sock, P.JobTokens(job.job_id, job.attempt, 0, list(job.tokens)))

    def _resend_unconfirmed(self) -> None:
        now = self.clock()
        due = self.unconfirmed.due(now)
        releases = self.unconfirmed_releases.due(now)
        if not due and not releases:
            return
        # To every gateway: the one that dispatched it may be restarting, or gone for good, and any gateway can
        # store a completion (the lease in Redis says whose it is); the others take their copy as stale. A hello
        # first: a gateway restarted since drops the frames of a worker it has not heard one from.
        self._hello()
        now = self.clock()
        for msg, first_sent in due:
            late = msg if msg.prefill_start_age_s is None else replace(
                msg, prefill_start_age_s=msg.prefill_start_age_s + max(0.0, now - first_sent))
            # Recorded as sent only if a socket took it: refused by every one (full queues), it is tried again
            # soon (worker/completions.py), not a resend interval after the gateways read again. A list, not any()
            # over a generator: every socket is offered it.
            self.unconfirmed.sent(msg, now, delivered=any([self._send(sock, late) for sock in self.sockets]))
        for msg, _ in releases:
            self.unconfirmed_releases.sent(msg, now, delivered=any([self._send(sock, msg) for sock in self.sockets]))
