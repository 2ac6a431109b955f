"""worker/completions.py: a completion is kept until its gateway confirms it, sent again every resend_s, and left
to its lease after give_up_s."""

from __future__ import annotations

from common import protocol as P
from worker.completions import Unconfirmed


def _finished(job_id: str, attempt: int = 1) -> P.JobFinished:
    return P.JobFinished(job_id, attempt, "done", "length", 1, 0.1, 0.2, 0, None, [7])


def test_kept_until_confirmed_and_sent_again_on_time():
    u = Unconfirmed(resend_s=1.0, give_up_s=10.0)
    a, b = _finished("a"), _finished("b")
    u.sent(a, now=0.0)
    u.sent(b, now=0.5)
    assert u.due(0.9) == [] and sorted(u.job_ids()) == ["a", "b"]
    assert u.due(1.0) == [(a, 0.0)]
    u.sent(a, now=1.0)  # sent again: its first sending still counts for the give-up and the age
    assert u.due(1.5) == [(b, 0.5)]
    u.confirmed("b", 1)
    u.confirmed("b", 1)  # a second ack (for a second copy) is harmless
    u.confirmed("a", 2)  # another attempt's ack confirms nothing of this one
    assert u.job_ids() == ["a"] and u.due(2.0) == [(a, 0.0)]
    assert u.resent == 1  # copies counted as they are sent again, not as they fall due


def test_an_attempt_is_its_own_completion():
    u = Unconfirmed(resend_s=1.0, give_up_s=10.0)
    u.sent(_finished("a", 1), now=0.0)
    u.sent(_finished("a", 2), now=0.0)
    u.confirmed("a", 1)
    assert len(u) == 1 and [m.attempt for m, _ in u.due(1.0)] == [2]


def test_one_the_socket_refused_is_due_at_once_and_all_are_given_up_in_time():
    seen = []
    u = Unconfirmed(resend_s=1.0, give_up_s=5.0, observe=lambda event, n: seen.append((event, n)))
    u.sent(_finished("a"), now=0.0, delivered=False)  # a full queue: not sent at all
    assert [m.job_id for m, _ in u.due(0.0)] == ["a"]
    u.sent(_finished("a"), now=0.0)
    u.sent(_finished("b"), now=4.0)
    assert [m.job_id for m, _ in u.due(5.0)] == ["b"]  # a, first handed over at 0 s, is left to its lease
    assert u.job_ids() == ["b"] and u.given_up == 1
    assert seen == [("resent", 1), ("given_up", 1)]  # a first sending, refused or not, is no resend


def test_one_refused_again_is_due_soon_and_one_taken_a_resend_interval_later():
    from worker.completions import REFUSED_RETRY_S

    u = Unconfirmed(resend_s=1.0, give_up_s=10.0)
    a = _finished("a")
    u.sent(a, now=0.0, delivered=False)  # refused: the next pass offers it to every gateway
    assert u.due(0.0) == [(a, 0.0)]
    u.sent(a, now=0.0, delivered=False)  # refused by every gateway too: soon, not at every pass
    assert u.due(REFUSED_RETRY_S / 2) == [] and u.due(REFUSED_RETRY_S) == [(a, 0.0)]
    u.sent(a, now=REFUSED_RETRY_S, delivered=False)
    assert u.due(2 * REFUSED_RETRY_S) == [(a, 0.0)]
    u.sent(a, now=2 * REFUSED_RETRY_S)  # taken at last: the next copy a resend interval later
    assert u.due(2 * REFUSED_RETRY_S + 0.99) == [] and u.due(2 * REFUSED_RETRY_S + 1.0) == [(a, 0.0)]
    u.sent(a, now=5.0, delivered=False)  # a refusal after one was taken counts from one again
    assert u.due(5.0) == [(a, 0.0)]
    assert (u.resent, u.refused) == (1, 3)
