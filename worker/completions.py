"""Completions (and a draining worker's hand-backs) no gateway has confirmed yet, sent again until one does.

A JobFinished can be lost: the gateway it went to was killed, and the one restarted in its place drops every
frame of a worker until that worker says hello again (the heartbeat re-announces it every few seconds). Lost,
the job waited out its lease and ran again from the start. So the worker keeps each JobFinished until the
gateway answers JobFinishedAck (stored, or not needed: its lease had moved on), reports the job as still held
meanwhile (its lease stays extended), and every ``resend_s`` sends it again to every gateway after a hello, so
that a gateway which does not know the worker learns it first (a socket keeps its frames in order), and one
that is gone for good does not hold it: any gateway can store it. A gateway takes a second copy of a completion
already stored as stale, so sending one twice is harmless. After ``give_up_s`` the lease decides, as before.

A ``JobReleased`` (worker/drain.py) is lost the same way, and then its job waited out its lease: it is kept
apart (a hand-back must not be reported as held, which would extend the lease it ends) in a second instance, and
confirmed by the same JobFinishedAck (the gateway requeued it, or its lease had moved on).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from common import protocol as P


Settled = P.JobFinished | P.JobReleased


# A copy refused again (every socket's queue full) is tried after this, not a resend interval later: the gateways
# may read again at any moment, and a client waits on it; yet not at every pass of the loop while they stay full.
REFUSED_RETRY_S = 0.1


@dataclass
class _Pending:
    msg: Settled
    first_sent: float
    due_at: float
    refused: int = 0  # sendings refused in a row


class Unconfirmed:
    def __init__(self, resend_s: float = 1.0, give_up_s: float = 60.0,
                 observe: Callable[[str, int], None] | None = None) -> None:
        """``observe(event, n)``: told of copies sent again that a socket took ("resent"), of those every socket
        refused ("refused": counted apart, as the refused-retry offers one ten times a second while the gateways
        stay full), and of completions given up ("given_up")."""
        self.resend_s, self.give_up_s = resend_s, give_up_s
        self.observe = observe
        self._pending: dict[tuple[str, int], _Pending] = {}
        self.resent = 0  # copies sent again that a socket took
        self.refused = 0  # copies sent again that every socket refused
        self.given_up = 0  # completions left to their lease

    def __len__(self) -> int:
        return len(self._pending)

    def sent(self, msg: Settled, now: float, delivered: bool = True) -> None:
        """``msg`` was sent at ``now``; not ``delivered``: every socket it was offered refused it (a full queue), so
        it is due again at once (the next pass offers it to every gateway), and, refused again, ``REFUSED_RETRY_S``
        after each refusal. One already kept is a copy sent again (``due``), and counted by what became of it."""
        key = (msg.job_id, msg.attempt)
        pending = self._pending.get(key)
        if pending is not None:
            if delivered:
                self.resent += 1
            else:
                self.refused += 1
            self._observe("resent" if delivered else "refused", 1)
        first = pending.first_sent if pending is not None else now
        refused = 0 if delivered else (pending.refused if pending is not None else 0) + 1
        due_at = now + self.resend_s if delivered else -math.inf if refused == 1 else now + REFUSED_RETRY_S
        self._pending[key] = _Pending(msg, first, due_at, refused)

    def confirmed(self, job_id: str, attempt: int) -> None:
        self._pending.pop((job_id, attempt), None)

    def attempts(self) -> list[tuple[str, int]]:
        return list(self._pending)

    def job_ids(self) -> list[str]:
        return [job_id for job_id, _ in self._pending]

    def due(self, now: float) -> list[tuple[Settled, float]]:
        """(completion, when it was first sent) for every completion unconfirmed for ``resend_s`` since it was last
        sent (one refused: see ``sent``); the caller sends each again (after a hello) and calls ``sent``. Those past
        ``give_up_s`` are forgotten."""
        out, given_up = [], 0
        for key, p in list(self._pending.items()):
            if now - p.first_sent >= self.give_up_s:
                del self._pending[key]
                given_up += 1
            elif now >= p.due_at:
                out.append((p.msg, p.first_sent))
        self.given_up += given_up
        if given_up:
            self._observe("given_up", given_up)
        return out

    def _observe(self, event: str, n: int) -> None:
        if self.observe is not None:
            self.observe(event, n)
