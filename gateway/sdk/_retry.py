"""Retries: which failures another attempt may cure, and how long a call waits before it."""

from __future__ import annotations

import asyncio
import random

from common.errors import Unavailable

# Failures that another attempt (on the next gateway) may cure; every other error is final.
RETRYABLE = (TimeoutError, Unavailable)

# The share of a gateway's retry_after_s added, at random, to the pause (RetryBudget.pause_s).
RETRY_AFTER_SPREAD = 0.25


def outcome_unknown(e: BaseException) -> bool:
    """Did a call end with no answer, its request perhaps taken all the same (no reply in time, the caller's task
    cancelled, the process interrupted)? A refusal the gateway answered changed nothing, Unavailable too ("nothing
    was stored": admit.lua refuses to store what comes after its caller gave up). Withdrawing after it also sent a
    flood of frames to gateways already struggling without Redis, each a try that stood their loop still."""
    return isinstance(e, (TimeoutError, asyncio.CancelledError, KeyboardInterrupt))


def withdraw_retries(retries: int) -> int:
    """A withdrawal's retries (the SDK's of a submit given up on): more than a call's, as it is the last word on a
    job that would otherwise run unseen, and a gateway slow enough to fail the submission may answer it later."""
    return max(retries, 4)


def failed_at(endpoint: str, why: Exception) -> str:
    """``why`` a call to ``endpoint`` failed, naming the gateway once."""
    return str(why) if endpoint in str(why) else f"gateway {endpoint}: {why}"


class RetryBudget:
    """Whether a failed attempt may be retried, and after what pause.

    A silent gateway (TimeoutError): up to ``retries`` times in a row, at once, on the next gateway. An
    unavailable cluster (its Redis unreachable): retried after the pause the gateway asks for (up to a quarter
    more, at random; else 0.1 s doubling to 2 s, with jitter) until the pauses add up to ``budget_s``, so a
    Redis blip is waited out.
    """

    def __init__(self, retries: int, budget_s: float) -> None:
        self.retries, self.budget_s = retries, budget_s
        self.reset()

    def reset(self) -> None:
        """The gateway answered: count from zero again."""
        self.silent = self.unavailable = 0
        self.waited_s = 0.0

    def pause_s(self, error: Exception) -> float:
        """The pause before the next attempt; re-raises ``error`` when the budget is spent."""
        if isinstance(error, TimeoutError):
            self.silent += 1
            if self.silent > self.retries:
                raise error
            return 0.0
        self.unavailable += 1
        asked = getattr(error, "retry_after_s", None)
        if asked:
            # Every client the gateway refused during one back-off is told its same end: spread over a quarter of it
            # more, their retries do not all land on the gateway in the one instant it tries Redis again.
            pause = asked * random.uniform(1.0, 1.0 + RETRY_AFTER_SPREAD)
        else:
            pause = min(2.0, 0.1 * 2 ** (self.unavailable - 1)) * random.uniform(0.5, 1.0)
        if self.waited_s + pause > self.budget_s:
            raise error
        self.waited_s += pause
        return pause
