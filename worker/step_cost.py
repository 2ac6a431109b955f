"""What one engine step costs this worker: seconds = base + per token x the tokens it batches.

A job's time in its batch slot is not its own: a decode step that shares the batch with another job's
1,024-token prefill chunk lasts as long as that chunk (half a second with the bench model on CPU, against
0.03 s for a decode step), so a per-sequence token rate averaged over jobs predicts a short job up to twice
too long, or a long one too short (BENCHMARKS.md, issue 12, twentieth session). A step's time, on the other
hand, follows the tokens in its batch: on the bench model a straight line through the steps of a prefill-heavy,
a code-like and a conversation-like load fits each step within 10-14 % at the median (the same line on all
three: 0.02-0.03 s plus 0.51-0.57 ms a token). The gateway replays each worker's steps with it
(gateway/estimate_steps.py) for the work each worker holds.

The fit is least squares over recent steps, each weighted by a decay so that a changed load (longer contexts,
another model) takes over within a few thousand steps; the start-up calibration (worker/calibration.py)
gives it a prefill step and decode steps before the first heartbeat.
"""

from __future__ import annotations

# Weight of one step in the decayed sums: about the last 1,000 steps count (tens of seconds of serving, and
# the few dozen prefill steps among them that fix the slope).
DECAY = 0.001
# Below this spread of batch sizes (tokens, as a standard deviation) the slope is not told apart from noise: the
# last slope fitted, if any, stands.
MIN_SPREAD_TOKENS = 4.0


class StepCostFit:
    """Decayed least squares of a step's seconds on the tokens it batched."""

    def __init__(self, decay: float = DECAY) -> None:
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._slope: float | None = None

    def add(self, tokens: int, seconds: float) -> None:
        """One step: ``tokens`` batched (prefill chunks and one per decoding sequence), ``seconds`` it took."""
        if tokens <= 0 or not seconds > 0 or seconds == float("inf"):
            return  # an empty step (block copies only) or a clock that did not move says nothing of the line
        keep = 1.0 - self.decay if self._w > 0 else 0.0
        self._w = keep * self._w + 1.0
        self._x = keep * self._x + tokens
        self._y = keep * self._y + seconds
        self._xx = keep * self._xx + tokens * tokens
        self._xy = keep * self._xy + tokens * seconds
        var = self._xx / self._w - (self._x / self._w) ** 2
        if var >= MIN_SPREAD_TOKENS ** 2:
            cov = self._xy / self._w - (self._x / self._w) * (self._y / self._w)
            self._slope = max(0.0, cov / var)

    def cost(self) -> tuple[float, float]:
        """(base seconds, seconds per batched token); (0, 0): nothing measured yet. Neither is negative: where
        the line would cross zero, the base is 0 and the slope is the mean seconds per token."""
        if self._w <= 0:
            return 0.0, 0.0
        mean_x, mean_y = self._x / self._w, self._y / self._w
        slope = self._slope if self._slope is not None else 0.0
        base = mean_y - slope * mean_x
        if base < 0:
            return 0.0, mean_y / mean_x
        return base, slope
