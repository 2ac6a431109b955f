"""What one engine step costs this worker: seconds = base + per token x the tokens it batches + per pair x the
query-key pairs its attention computes.

A job's time in its batch slot is not its own: a decode step that shares the batch with another job's
1,024-token prefill chunk lasts as long as that chunk (half a second with the bench model on CPU, against
0.03 s for a decode step), so a per-sequence token rate averaged over jobs predicts a short job up to twice
too long, or a long one too short (BENCHMARKS.md, issue 12, twentieth session). A step's time, on the other
hand, follows what its batch computes. The tokens alone fit each step within 10-14 % at the median on the bench
model (0.02-0.03 s plus 0.51-0.57 ms a token), but not a long prompt's later chunks: each of their tokens
attends to all the prompt before it, so the second 1,024-token chunk of a 2,000-token prompt took 1.2-1.5 s
where the first took 0.9 s. Counting the attention's pairs too (a chunk of n tokens from position s computes
n*s + n(n+1)/2 of them) fits the prefill steps of a prefill-heavy load within 6 % at the median, against 18 %
(BENCHMARKS.md, issue 12, twenty-second session). The gateway replays each worker's steps with it
(gateway/estimate_steps.py) for the work each worker holds.

The fit is least squares over recent steps, each weighted by a decay so that a changed load (longer contexts,
another model) takes over within a few thousand steps; the start-up calibration (worker/calibration.py)
gives it a prefill step and decode steps before the first heartbeat.
"""

from __future__ import annotations

# Weight of one step in the decayed sums: about the last 1,000 steps count (tens of seconds of serving, and
# the few dozen prefill steps among them that fix the slopes).
DECAY = 0.001
# Below this spread of batch sizes (tokens, as a standard deviation) the per-token slope is not told apart from
# noise: the last slopes fitted, if any, stand.
MIN_SPREAD_TOKENS = 4.0
# Below this spread of attended pairs that the tokens do not explain (a standard deviation) the per-pair slope is
# not told apart from noise: the last one fitted (none at first) stands, and the tokens fit the rest. Decode steps
# alone, or the calibration's short prompts, stay below it (a few thousand pairs); a few prompts of some hundreds
# of tokens pass it.
MIN_SPREAD_PAIRS = 20_000.0


class StepCostFit:
    """Decayed least squares of a step's seconds on the tokens it batched and the pairs its attention computed."""

    def __init__(self, decay: float = DECAY) -> None:
        self.decay = decay
        # Decayed sums: weight, then of t (tokens), p (pairs), y (seconds) and their products.
        self._w = self._t = self._p = self._y = 0.0
        self._tt = self._tp = self._pp = self._ty = self._py = 0.0
        self._token_s: float | None = None
        self._pair_s = 0.0

    def add(self, tokens: int, seconds: float, pairs: int = 0) -> None:
        """One step: ``tokens`` batched (prefill chunks and one per decoding sequence), ``pairs`` of query and key
        its attention computed, ``seconds`` it took."""
        if tokens <= 0 or pairs < 0 or not seconds > 0 or seconds == float("inf"):
            return  # an empty step (block copies only) or a clock that did not move says nothing of the line
        keep = 1.0 - self.decay if self._w > 0 else 0.0
        t, p, y = float(tokens), float(pairs), float(seconds)
        self._w = keep * self._w + 1.0
        self._t = keep * self._t + t
        self._p = keep * self._p + p
        self._y = keep * self._y + y
        self._tt = keep * self._tt + t * t
        self._tp = keep * self._tp + t * p
        self._pp = keep * self._pp + p * p
        self._ty = keep * self._ty + t * y
        self._py = keep * self._py + p * y
        self._refit()

    def _refit(self) -> None:
        w = self._w
        mt, mp, my = self._t / w, self._p / w, self._y / w
        vtt = self._tt / w - mt * mt
        if vtt < MIN_SPREAD_TOKENS ** 2:
            return
        vpp, vtp = self._pp / w - mp * mp, self._tp / w - mt * mp
        vty, vpy = self._ty / w - mt * my, self._py / w - mp * my
        if vpp - vtp * vtp / vtt >= MIN_SPREAD_PAIRS ** 2:
            det = vtt * vpp - vtp * vtp
            token_s, pair_s = (vty * vpp - vpy * vtp) / det, (vpy * vtt - vty * vtp) / det
            if pair_s < 0:  # a slope below nothing is noise: the other alone explains the steps
                token_s, pair_s = vty / vtt, 0.0
            elif token_s < 0:
                token_s, pair_s = 0.0, max(0.0, vpy / vpp)
            self._pair_s = pair_s
        else:  # the pairs' slope stands; the tokens fit what it leaves
            token_s = (vty - self._pair_s * vtp) / vtt
        self._token_s = max(0.0, token_s)

    def cost(self) -> tuple[float, float, float]:
        """(base seconds, seconds per batched token, seconds per attended pair); (0, 0, 0): nothing measured yet.
        None is negative: where the fit would put the base below zero, the base is 0 and the tokens take the mean
        seconds the pairs leave."""
        if self._w <= 0:
            return 0.0, 0.0, 0.0
        mt, mp, my = self._t / self._w, self._p / self._w, self._y / self._w
        token_s = self._token_s if self._token_s is not None else 0.0
        base = my - token_s * mt - self._pair_s * mp
        if base < 0:
            return 0.0, max(0.0, my - self._pair_s * mp) / mt, self._pair_s
        return base, token_s, self._pair_s
