"""A worker's shutdown (SIGTERM or SIGINT): take no new work, finish what runs, hand back the rest.

Before, a stopped worker exited at once and its jobs waited out their leases (``lease_s``) and ran again from
the start elsewhere: a rolling redeploy cost every running job a lease and its tokens. Now, on the first signal:

- its load reports offer nothing (no free slot, no victim), so the gateways send it no more work; a dispatch
  already on its way is handed back at once (``JobReleased``), and so is every job it holds that has not started;
- running and suspended jobs go on until they finish or ``drain_timeout_s`` has passed; then the rest are handed
  back, and the gateway requeues them at once (that attempt does not count against ``max_attempts``);
- each hand-back is sent again (after a hello) until a gateway confirms it, as completions are: a gateway that
  restarted meanwhile drops it, and the job would wait out its lease;
- it exits once it holds no job and every completion and hand-back is confirmed, or ``CONFIRM_GRACE_S`` after
  the deadline.

A second signal ends the drain: everything is handed back at once, and the worker exits as soon as a gateway
confirms it, ``CONFIRM_GRACE_S`` later at the latest (before, it left at once and closed its sockets, dropping the
hand-backs still queued for a gateway that was restarting: their jobs waited out their leases). A third signal leaves
at once. A worker that dies (kill -9, a crash) still loses its jobs to their leases: the drain needs the worker alive
to say what it gives up.
"""

from __future__ import annotations

import logging
import math

from common import protocol as P

log = logging.getLogger("worker")

CONFIRM_GRACE_S = 2.0  # after the deadline, how long the last completions may wait for their confirmations


class Drain:
    def __init__(self, timeout_s: float) -> None:
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s >= 0):
            raise ValueError(f"drain_timeout_s must be a finite number >= 0, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self.signals = 0  # set from a signal handler: the step loop reads it
        self.deadline: float | None = None

    def request(self) -> None:
        """A stop signal came (called from the signal handler: it only counts)."""
        self.signals += 1

    @property
    def active(self) -> bool:
        return self.deadline is not None

    def begin(self, now: float) -> bool:
        """True once, when the first signal is seen: the drain starts now."""
        if not self.signals or self.deadline is not None:
            return False
        self.deadline = now + self.timeout_s
        return True

    def due(self, now: float) -> bool:
        """The jobs still held are to be handed back: the deadline passed, or a second signal came (which moves the
        deadline to now: the hand-backs get their grace from then)."""
        if self.deadline is None:
            return False
        if self.signals > 1 and now < self.deadline:
            self.deadline = now
        return now >= self.deadline

    def finished(self, now: float, holding: bool, unconfirmed: bool) -> bool:
        """Nothing left to do here: no job held, and no completion waiting for a confirmation (or no more time)."""
        if self.deadline is None or holding:
            return False
        return not unconfirmed or self.signals > 2 or now >= self.deadline + CONFIRM_GRACE_S


class Draining:
    """The worker service's side of the drain (a mixin of worker.service.WorkerService, on its step loop's thread):
    needs its ``drain``, ``jobs``, ``engine``, ``rates``, ``unconfirmed``, ``unconfirmed_releases``, ``sockets``,
    ``_lock``, ``clock``, ``_send``, ``_hello`` and ``_refresh_snapshot``."""

    def _draining_done(self) -> bool:
        """Drive the shutdown (worker/drain.py); True once the loop may end."""
        if not self.drain.signals:
            return False  # the step loop's every pass: nothing to do until a signal
        now = self.clock()
        if self.drain.begin(now):
            log.info("draining: no new work; running jobs have %.0f s to finish, the rest is handed back",
                     self.drain.timeout_s)
            self._refresh_snapshot(now)  # the report the hello brings offers nothing
            with self._lock:
                # Says draining, with that report, before any hand-back: every gateway stops counting its slots
                # now, so a job it hands back is not sent here again.
                self._hello()
            # Nothing computed here (never started, or preempted by recompute): another worker loses nothing, and
            # output it already has comes back to it with the re-dispatch (DispatchJob.resume_token_ids).
            unstarted = {j: job.attempt for j, job in self.jobs.items()
                         if (r := self.engine.get_request(j)) is None or r.num_computed_tokens == 0}
            self._release(unstarted, "draining: not started")
        if self.drain.due(now) and self.jobs:
            log.warning("drain: handing back %d unfinished jobs", len(self.jobs))
            self._release({j: job.attempt for j, job in self.jobs.items()}, "draining: out of time")
        done = self.drain.finished(now, bool(self.jobs), len(self.unconfirmed) + len(self.unconfirmed_releases) > 0)
        if done:
            log.info("drained")
        return done

    def _release(self, attempts: dict[str, int], reason: str) -> None:
        """Hand these attempts (job id -> attempt) back to the gateways (JobReleased), after dropping them here and
        from the report the heartbeat thread sends (a report listing one would extend the lease the release ends)."""
        released = []
        for job_id, attempt in attempts.items():
            self.jobs.pop(job_id, None)
            self.engine.abort(job_id)
            self.rates.forget(job_id)
            released.append(P.JobReleased(job_id, attempt, reason))
        if not released:
            return
        now = self.clock()
        self._refresh_snapshot(now)
        with self._lock:
            for msg in released:
                # Any gateway can requeue it; the others take their copy as stale. A list, not any() over a
                # generator: every socket is offered it, not only those before the first that takes it.
                took = [self._send(sock, msg) for sock in self.sockets]
                # Kept until a gateway confirms it: one that restarted meanwhile drops it, and the job would wait
                # out its lease (worker/completions.py sends it again after a hello). Refused by every socket (full
                # queues), it is due again at once, not after the resend interval.
                self.unconfirmed_releases.sent(msg, now, delivered=any(took))
