"""This worker's measured token rates, and when each job's first prefill started.

The gateway's wait estimate (gateway/estimate.py) turns work (tokens) into seconds with the
rates every worker reports in its heartbeats. Both rates are per sequence, under the load the
worker actually ran with, because that is how long a job holds a batch slot:

- prefill: a request's prompt tokens (and the output a re-dispatched job came with, prefilled with its prompt)
  over the time from its first prefill chunk to its first token;
- decode: its further output tokens over the time from the first token to the end,
  less any time it spent suspended.

At start-up ``calibrate`` runs one full batch of short requests through the engine, so the very
first heartbeat already carries measured rates (a fresh cluster estimates from its capacity,
not from a guess). Afterwards every finished request updates the rates (decayed averages).

The tracker also records the start of each request's first prefill chunk: the end of its wait
(admission until first prefill), which the worker reports to the gateway.

Every step also goes to the fit of what a step costs this worker (worker/step_cost.py), which
the heartbeats carry too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from common.errors import InvalidRequest
from common.tiers import ALL_TIERS
from worker.request import RequestStatus, SamplingParams
from worker.step_cost import StepCostFit

# Weight of one finished request in the decayed averages: about the last 20 requests count.
DECAY = 0.05
CALIBRATION_PROMPT_TOKENS = 48
CALIBRATION_OUTPUT_TOKENS = 24
STATUS_CODES = {RequestStatus.RUNNING: 0, RequestStatus.SUSPENDED: 1, RequestStatus.WAITING: 2}


class DecayedRate:
    """tokens / seconds over recent observations, each weighted by its size (a big request counts more)."""

    def __init__(self) -> None:
        self.tokens = 0.0
        self.seconds = 0.0

    def add(self, tokens: float, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        if self.seconds == 0.0:
            self.tokens, self.seconds = tokens, seconds
            return
        self.tokens = (1 - DECAY) * self.tokens + DECAY * tokens
        self.seconds = (1 - DECAY) * self.seconds + DECAY * seconds

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Timing:
    request: object  # the engine's Request (its suspended time and token counts are read from it)
    received: float
    prefill_start: float | None = None
    suspended_at_first_token: float = 0.0
    first_token: float | None = None


class RateTracker:
    """Watches engine steps: first-prefill times per request, and the worker's measured rates."""

    def __init__(self, engine, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.clock = clock
        self.prefill = DecayedRate()
        self.decode = DecayedRate()
        self.steps = StepCostFit()
        self._timings: dict[str, _Timing] = {}
        self._step_start = 0.0
        # The last step, until the next one starts: (tokens batched, pairs attended, start, end, work left to go
        # straight on with).
        self._last_step: tuple[int, int, float, float, bool] | None = None
        self._not_started: list[str] = []

    def added(self, request_id: str) -> None:
        req = self.engine.get_request(request_id)
        if req is not None:
            self._timings[request_id] = _Timing(req, self.clock())

    def forget(self, request_id: str) -> None:
        self._timings.pop(request_id, None)

    def prefill_start_s(self, request_id: str) -> float | None:
        """Seconds from the request's arrival here to its first prefill chunk; None before it started."""
        t = self._timings.get(request_id)
        return None if t is None or t.prefill_start is None else t.prefill_start - t.received

    def prefill_start_age_s(self, request_id: str, now: float) -> float | None:
        """Seconds from the request's first prefill chunk starting to ``now``; None before it started."""
        t = self._timings.get(request_id)
        return None if t is None or t.prefill_start is None else max(0.0, now - t.prefill_start)

    def before_step(self) -> None:
        now = self.clock()
        self._flush_step(now)
        self._step_start = now
        self._not_started = [r.request_id for r in self.engine.scheduler.waiting
                             if not r.started and r.request_id in self._timings]

    def after_step(self, outputs) -> None:
        now = self.clock()
        # A step's cost is counted until the next step starts, where the worker goes straight on to it: sending its
        # tokens, reading dispatches and reporting between steps hold every running job up as the forward pass
        # does. Where the worker then idles, only to the step's end.
        self._last_step = (self.engine.last_batched_tokens, self.engine.last_attended_pairs, self._step_start, now,
                           self.engine.has_unfinished())
        for rid in self._not_started:
            t = self._timings.get(rid)
            if t is not None and t.request.started:
                t.prefill_start = self._step_start  # its first chunk ran in this step
        for out in outputs:
            t = self._timings.get(out.request_id)
            if t is None:
                continue
            req = t.request
            if t.first_token is None and out.new_token_ids:
                t.first_token = now
                t.suspended_at_first_token = req.suspended_total_s
                if t.prefill_start is not None:  # a resumed request prefilled the output it came with too
                    self.prefill.add(req.num_prompt_tokens + req.added_output_tokens,
                                     now - t.prefill_start - req.suspended_total_s)
            if out.finished and t.first_token is not None:
                suspended = req.suspended_total_s - t.suspended_at_first_token
                decoded = out.num_output_tokens - req.added_output_tokens - 1  # here, after its first token here
                self.decode.add(decoded, now - t.first_token - suspended)

    def _flush_step(self, now: float) -> None:
        if self._last_step is None:
            return
        tokens, pairs, start, end, goes_on = self._last_step
        self._last_step = None
        self.steps.add(tokens, (now if goes_on else end) - start, pairs)

    def rates(self) -> tuple[float, float]:
        """(prefill, decode) tokens per second per sequence."""
        return self.prefill.rate, self.decode.rate

    def step_cost(self) -> tuple[float, float, float]:
        """(base seconds, seconds per batched token, seconds per attended pair) of an engine step
        (worker/step_cost.py), the last step's included when the worker has gone idle since."""
        if self._last_step is not None and not self._last_step[4]:
            self._flush_step(self.clock())
        return self.steps.cost()

    def work(self) -> dict[str, list[int]]:
        """What each held request still has to do, for the gateway's estimate:
        job id -> [tier rank, status (0 running, 1 suspended, 2 waiting), tokens left to prefill,
        tokens generated, max_tokens, bit mask of the tiers that may preempt it, tokens it will still generate
        before a guard lets it be preempted (PreemptionPolicy.protected_tokens), tokens in its KV cache (where
        its next chunk or token attends from)]."""
        sched = self.engine.scheduler
        matrix = sched.preemption.config.matrix
        out = {}
        for r in sched.running + sched.waiting:
            mask = sum(1 << a.rank for a in ALL_TIERS if r.tier in matrix.get(a, ()))
            # Its next step batches every token not yet computed and draws one at the end. A decoding request's
            # one such token (its last output) is that decode step, not prefill; a resumed one (re-dispatched, or
            # recomputed after a preemption) prefills its prompt and all its output, as a fresh one its prompt.
            left = r.num_tokens - r.num_computed_tokens
            prefill_left = 0 if r.output_token_ids and left <= 1 else left
            out[r.request_id] = [r.tier.rank, STATUS_CODES.get(r.status, 2), prefill_left,
                                 len(r.output_token_ids), r.params.max_tokens, mask,
                                 sched.preemption.protected_tokens(r), r.num_computed_tokens]
        return out


def calibrate(engine, tracker: RateTracker) -> tuple[float, float]:
    """Run one full batch of short requests (greedy, fixed length) to measure the rates before serving."""
    n = engine.config.max_num_seqs
    vocab = engine.vocab_size
    prompt_len = max(1, min(CALIBRATION_PROMPT_TOKENS, engine.max_model_len - CALIBRATION_OUTPUT_TOKENS - 1))
    params = SamplingParams(max_tokens=CALIBRATION_OUTPUT_TOKENS, ignore_eos=True)
    ids = []
    for i in range(n):
        rid = f"calibration-{i}"
        prompt = [(7 * i + 13 * j + 1) % vocab for j in range(prompt_len)]
        try:
            engine.add_request(rid, prompt, params, tier="P3")
        except InvalidRequest:  # a KV pool or context too small for this batch: calibrate with what fits
            break
        tracker.added(rid)
        ids.append(rid)
    while engine.has_unfinished():
        tracker.before_step()
        tracker.after_step(engine.step())
    for rid in ids:
        tracker.forget(rid)
    return tracker.rates()
