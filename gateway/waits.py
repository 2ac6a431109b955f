"""The measured wait of each job: admission until its first prefill started on a worker, across attempts and
gateways (the first start is recorded in the job's hash, first_prefill.lua); and each dispatch's hand-off.
JobResult.queued_s reports it, and the wait estimates learn from it."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import NamedTuple

MAX_KNOWN_JOBS = 200_000  # jobs remembered (oldest dropped first): another gateway's never finish here
# A worker's clock offset is the least lag of its frames over the last one or two windows: long enough to hold
# frames read at once (a gateway busy for a whole window keeps the last one's), short enough that a drift of
# 500 ppm moves it a few ms.
OFFSET_WINDOW_S = 30.0
BACKWARDS_S = 1.0  # a worker clock this far behind its latest frame is another process's (a host moved)


class WorkerClocks:
    """Where a worker's frame was sent, on this gateway's clock: its send time on the worker's clock
    (``sent_at_s``) plus that clock's offset from ours, learnt as the least (reading - sending) of its frames,
    which is the offset plus the quickest delivery. A frame read late (the gateway's loop was busy, or stood
    still) is then placed when it was sent, not when it was read; never later than its reading."""

    def __init__(self) -> None:
        # worker -> [window start (ours), least lag this window, least lag the window before, latest sent_at_s]
        self._known: dict[str, list[float]] = {}

    def heard(self, worker: str, sent_at_s: float | None, now: float) -> None:
        if sent_at_s is None or not math.isfinite(sent_at_s):
            return
        lag = now - sent_at_s
        k = self._known.get(worker)
        if k is None or sent_at_s < k[3] - BACKWARDS_S:
            self._known[worker] = [now, lag, math.inf, sent_at_s]
            return
        if now - k[0] >= OFFSET_WINDOW_S:
            k[:3] = [now, math.inf, k[1]]
        k[1] = min(k[1], lag)
        k[3] = max(k[3], sent_at_s)

    def sent(self, worker: str, sent_at_s: float | None, now: float) -> float:
        """The frame's send on this gateway's clock (``now``, its reading, if the worker's clock is not known)."""
        self.heard(worker, sent_at_s, now)
        k = self._known.get(worker)
        if sent_at_s is None or k is None or not math.isfinite(sent_at_s):
            return now
        return min(now, sent_at_s + min(k[1], k[2]))



class HandOff(NamedTuple):
    seconds: float  # dispatch until the prefill started
    busy: bool  # the worker was running other work when the job was sent


def first_prefill_ms(rec) -> int | None:
    """The first start of any attempt of the job, as recorded in its hash (first_prefill.lua), on Redis's clock."""
    raw = rec.result.get("first_prefill_ms")
    return None if raw is None else int(raw)


class Waits:
    """Each job's wait as measured: admission until the first prefill chunk of any of its attempts.

    A worker's clock is not ours, so it reports durations: how long before its frame the prefill
    started (the gateway counts back from when the frame came), and how long after it read the
    dispatch. The second alone would miss the time the dispatch sat unread while a step ran (a
    worker reads between steps); it is a floor: a start is never earlier than the dispatch plus it.
    """

    def __init__(self) -> None:
        # Bounded: jobs another gateway streams are dispatched from here but never finish here.
        # job id -> (attempt, sent, busy, its hand-off told): this gateway's latest dispatch of the job.
        self._dispatched: OrderedDict[str, tuple[int, float, bool, bool]] = OrderedDict()
        self._started: dict[str, float] = {}
        # From Redis's clock at the dispatch: the job's admission here (whichever gateway admitted it), and Redis ms
        # less this gateway's clock in ms, to write a start where every gateway reads it (the job's hash).
        self._admitted: dict[str, float] = {}
        self._offset_ms: dict[str, float] = {}
        self._unrecorded: dict[str, int] = {}  # job id -> its first start (Redis ms), not yet in its hash
        self.worker_clocks = WorkerClocks()

    def dispatched(self, job_id: str, now: float, busy: bool = True, attempt: int = 1, *,
                   sent_ms: int | None = None, enqueued_ms: int | None = None, first_ms: int | None = None,
                   told: bool = False) -> None:
        """``busy``: the worker it went to was running other work (so it reads the job after a step). ``sent_ms``,
        ``enqueued_ms``: the dispatch and the admission on Redis's clock; ``first_ms``: the first start an earlier
        attempt recorded in the job's hash (it ended the wait, whichever gateway heard it). ``told``: no hand-off
        to learn (a lease this gateway took over, sent at a time it only derives)."""
        self._dispatched[job_id] = (attempt, now, busy, told)
        self._dispatched.move_to_end(job_id)
        if sent_ms is not None and enqueued_ms is not None:
            self._admitted[job_id] = now - (sent_ms - enqueued_ms) / 1000
            self._offset_ms[job_id] = sent_ms - now * 1000
            if first_ms is not None:
                self._started[job_id] = min(self._started.get(job_id, math.inf), now - (sent_ms - first_ms) / 1000)
        while len(self._dispatched) > MAX_KNOWN_JOBS:
            self.forget(self._dispatched.popitem(last=False)[0])

    def _start(self, job_id: str, started: float) -> None:
        if job_id in self._started:
            return
        self._started[job_id] = started
        if job_id in self._offset_ms:
            self._unrecorded[job_id] = round(started * 1000 + self._offset_ms[job_id])

    def unrecorded(self) -> dict[str, int]:
        """First starts heard here not yet written to their jobs' hashes (first_prefill.lua): job id -> Redis ms."""
        return dict(self._unrecorded)

    def unrecorded_start_ms(self, job_id: str) -> int | None:
        return self._unrecorded.get(job_id)

    def recorded(self, starts: dict[str, int]) -> None:
        for job_id in starts:
            self._unrecorded.pop(job_id, None)

    def prefill_started(self, job_id: str, after_s: float | None, age_s: float | None = None,
                        now: float | None = None, attempt: int = 1) -> HandOff | None:
        """Record a start a worker reports for ``attempt`` of a job (the first of any attempt ends its wait).
        Returns the hand-off it took (this gateway's dispatch of that attempt until its prefill started), once per
        attempt; None for an attempt another gateway sent (its tokens came here when that gateway went away):
        measured from this gateway's dispatch of an earlier attempt, it held that attempt's lost time."""
        sent = self._dispatched.get(job_id)
        if after_s is None or sent is None:
            return None
        if sent[0] != attempt:
            if age_s is not None and now is not None:
                self._start(job_id, max(sent[1], now - max(0.0, age_s)))  # not before our dispatch
            return None
        started = sent[1] + max(0.0, after_s)
        if age_s is not None and now is not None:
            started = max(started, now - max(0.0, age_s))
        self._start(job_id, started)
        if sent[3]:
            return None
        self._dispatched[job_id] = (*sent[:3], True)
        return HandOff(started - sent[1], sent[2])

    def queued_s(self, job_id: str, enqueued_at: float | None) -> float | None:
        """``enqueued_at``: the admission, if this gateway made it; else the one Redis told at the dispatch."""
        started = self._started.get(job_id)
        enqueued_at = self.admitted_at(job_id, enqueued_at)
        return None if started is None or enqueued_at is None else max(0.0, started - enqueued_at)

    def admitted_at(self, job_id: str, enqueued_at: float | None) -> float | None:
        """The job's admission on this gateway's clock: ``enqueued_at`` if this gateway made it, else the one Redis
        told at the dispatch (None if neither)."""
        return self._admitted.get(job_id) if enqueued_at is None else enqueued_at

    def forget(self, job_id: str) -> None:
        self._dispatched.pop(job_id, None)
        for known in (self._started, self._admitted, self._offset_ms, self._unrecorded):
            known.pop(job_id, None)
