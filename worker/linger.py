"""A moment's wait for the gateway's answer before the next step.

A worker reports at once when a slot frees or what runs changes (worker/service.py), and a gateway answers such
a report with the jobs it sends on it: a free slot's, or an urgent job's on a victim. The answer comes a few
milliseconds later (the gateway claims the job in Redis first), and by then the step loop had begun the next
step: the job waited that whole step, its slot idle or its victim still running (on a CPU a long prompt's chunk
is a second). So after a report that offers room the loop polls its sockets a little longer before it steps.

How long: ``cap_s``, and never more than ``share`` of the last step (a step costs every running job the same
time, so the wait is at most that share of their pace); an answer ends the wait when it comes. On the bench's
CPU cluster answers came 1.7-8.1 ms after the report (p10-p90, median 3.8 ms; BENCHMARKS.md, issue 12, twenty-third
session), where a step's fixed cost alone is 20-27 ms. Whether: only while offers have been answered lately. A
gateway with nothing queued answers none, and a worker that went on waiting would slow its running jobs for
nothing; so once answers stop it waits only on every ``EXPLORE_EVERY``-th offer, to see whether they have come back.

Each offer ends one way, told to ``observe`` (worker/metrics.py: ``ts_dispatch_linger_total``, and the seconds
waited): ``answered`` in time, ``unanswered`` (the window ran out), or ``not_waited``. An operator tuning the cap
reads the first two against the seconds they cost the running jobs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from common.tiers import PREEMPTING_TIERS

EXPLORE_EVERY = 8  # offers between two waits while answers have stopped coming
MIN_ANSWERED = 0.25  # the share of recent offers answered in time below which the worker stops waiting
DECAY = 0.2  # weight of the newest offer in the share answered
MIN_WINDOW_S = 0.001  # the poller's resolution
OUTCOMES = ANSWERED, UNANSWERED, NOT_WAITED = ("answered", "unanswered", "not_waited")  # one per offer, to observe


def offers_room(report, before) -> bool:
    """Does ``report`` (a WorkerLoad) offer a gateway room it may answer with a dispatch: a free slot, or more
    victims for an urgent tier than the report ``before`` it listed (None: none before)?"""
    if report.free_slots > 0:
        return True
    was = before.victims if before is not None else {}
    return any(report.victims.get(t.value, 0) > was.get(t.value, 0) for t in PREEMPTING_TIERS)


class Linger:
    """Decides how long the step loop waits for dispatches after each offering report."""

    def __init__(self, cap_s: float, share: float = 0.25,
                 observe: Callable[[str, float], None] | None = None) -> None:
        if not (math.isfinite(cap_s) and cap_s >= 0 and math.isfinite(share) and share >= 0):
            raise ValueError(f"dispatch linger must be finite and >= 0, got cap {cap_s}, share {share}")
        self.cap_s, self.share = cap_s, share
        self.observe = observe or (lambda outcome, waited_s: None)  # (outcome, seconds waited) per offer
        self.answered_share = 1.0  # optimistic: a fresh worker waits on its first offers
        self.offers = 0
        self.waits = 0  # offers on which the loop waited
        self.answers = 0  # of those, answered within the window
        self._since = 0.0  # when the open offer went out
        self._until: float | None = None  # when its window ends; None: no offer open

    def offered(self, now: float, step_s: float) -> None:
        """A report offering room went out at ``now``; the last step took ``step_s``."""
        self._close()
        self.offers += 1
        window = self.window_s(step_s)
        if window <= 0 or (self.answered_share < MIN_ANSWERED and self.offers % EXPLORE_EVERY):
            self.observe(NOT_WAITED, 0.0)
            return
        self.waits += 1
        self._since, self._until = now, now + window

    def window_s(self, step_s: float) -> float:
        """How long an offer is waited on after a step of ``step_s``."""
        # Not fitted to the answers' latency: one learned from the second of two jobs sent together (0.2 ms)
        # would miss the usual answer (the gateway's claim in Redis first, a few ms).
        window = min(self.cap_s, self.share * max(0.0, step_s))
        return window if window >= MIN_WINDOW_S else 0.0

    def dispatched(self, now: float) -> None:
        """A dispatch came in at ``now``."""
        if self._until is not None and now <= self._until:
            self.answers += 1
            self.answered_share += DECAY * (1.0 - self.answered_share)
            self._until = None
            self.observe(ANSWERED, max(0.0, now - self._since))

    def poll_ms(self, now: float) -> int:
        """The poll timeout before the next step: 0 unless an offer's window is open."""
        if self._until is None:
            return 0
        if now >= self._until:
            self._close()
            return 0
        return max(1, math.ceil((self._until - now) * 1000))

    def _close(self) -> None:
        """The open offer, if any, went unanswered."""
        if self._until is not None:
            self.answered_share *= 1 - DECAY
            self.observe(UNANSWERED, self._until - self._since)
            self._until = None
