"""A worker's engine steps, replayed for the wait model (gateway/estimate.py).

Each worker measures what a step costs it: seconds = base + per token x the tokens the step batches (prefill
chunks, and one token per decoding sequence) + per pair x the query-key pairs its attention computes (each token
attends to its sequence so far, so a prompt's later chunks cost more than its first; worker/step_cost.py). With
it the model times the work a worker holds now as the worker will run it, not at per-sequence token rates
averaged over jobs:

- the work a worker holds runs out step by step (``run_out``), in the worker's own order: each step the
  running jobs, oldest first, take one token each while decoding or a chunk of their prompt, until the step's
  token budget (max_num_batched_tokens) is spent, each from where its sequence stands (its tokens in the KV
  cache, as the worker reports them). So a short job next to a long prompt's prefill waits out that
  prompt's chunks, and one next to decoding work does not. The steps run from the worker's report, which is
  some tenths of a second old: the steps since have run, and the one in progress now is known, with when it
  ends. A job sent now is read after it (a P0 sent to preempt during a prompt's 1,024-token chunk waits half a
  second on the bench model);
- a prompt the model starts on that worker lengthens the steps of that work by its tokens' cost
  (``interference_s``): a decode step that batches a 1,024-token chunk lasts as long as the chunk.

The jobs the model starts keep the token rates, measured on the worker's own jobs as they ran. Timed at the
step cost instead (a job's chunks, a step per token, and each prompt started beside it), the queued jobs of the
bursty code trace were told 0.56-0.67 of their waits at the median, 35-65 of each tier's judged jobs under half
(on the states of one bench run, against 0.69-1.20 at the rates): a step's cost leaves out what holds a job up
between and around the steps, which a deep queue adds up job after job (BENCHMARKS.md, issue 12, twenty-first
session).

Where a worker reports no step cost (an older one), the model keeps its token rates (gateway/estimate_types.Rates).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    base_s: float
    token_s: float  # per token batched
    pair_s: float = 0.0  # per query-key pair attended (0: not reported, an older worker)

    def step_s(self, tokens: float, pairs: float = 0.0) -> float:
        return self.base_s + self.token_s * tokens + self.pair_s * pairs


def chunk_pairs(tokens: float, context: float) -> float:
    """Query-key pairs a chunk of ``tokens`` computes after ``context`` tokens of its sequence (each attends to
    the context, the chunk's tokens before it, and itself); a decode token: context + 1."""
    return tokens * context + tokens * (tokens + 1) / 2


@dataclass(frozen=True)
class RunOut:
    """How the work a worker holds runs out, if nothing else comes: per job, when it ends and when its guard lets
    it be preempted; and when the step in progress ends (a job sent now is read after it). Seconds from now."""

    ends: list[float]
    guards: list[float]
    step_left_s: float


def interference_s(cost: StepCost, prefill: float, context: float = 0.0) -> float:
    """How much longer the work beside a job runs while the job's prompt is prefilled: its chunks' tokens and
    the pairs they attend."""
    prefill = max(0.0, prefill)
    return cost.token_s * prefill + cost.pair_s * chunk_pairs(prefill, context)


def _steps_s(first: float, more: float, m: float) -> float:
    """Seconds of ``m`` steps, the first taking ``first`` and each one ``more`` longer than the one before."""
    return m * first + more * m * (m - 1) / 2


def _steps_within(first: float, more: float, x: float) -> int:
    """How many whole steps (as in _steps_s) end within ``x`` seconds."""
    if more <= 0:
        return int(x // first)
    # The larger root of more/2 m^2 + (first - more/2) m - x = 0, then mended for rounding.
    b = first - more / 2
    m = int((-b + math.sqrt(b * b + 2 * more * x)) / more)
    while m > 0 and _steps_s(first, more, m) > x:
        m -= 1
    while _steps_s(first, more, m + 1) <= x:
        m += 1
    return m


def run_out(jobs: Sequence[tuple[float, ...]], cost: StepCost, budget: float, age_s: float = 0.0) -> RunOut:
    """Step the worker through ``jobs`` (prefill tokens left, tokens still to generate, tokens to generate before
    its guard lets it go, and optionally its tokens in the KV cache), in the worker's order, until all have ended
    (see the module docstring). ``jobs`` are as the worker reported them ``age_s`` ago: the steps since have run,
    and one is in progress now."""
    n = len(jobs)
    prefill = [max(0.0, j[0]) for j in jobs]
    # Steps still to decode: a fraction of an expected token is a step, as the worker draws whole tokens.
    decode = [math.ceil(max(0.0, j[1]) - 1e-9) for j in jobs]
    guard = [j[2] for j in jobs]
    context = [max(0.0, j[3]) if len(j) > 3 else 0.0 for j in jobs]
    made = [0] * n
    ends = [0.0 if prefill[j] <= 0 and decode[j] <= 0 else math.inf for j in range(n)]
    guards = [0.0 if guard[j] <= 0 else math.inf for j in range(n)]
    t, left = 0.0, 0.0
    while True:
        live = [j for j in range(n) if ends[j] == math.inf]
        if not live:
            break
        if all(prefill[j] <= 0 for j in live) and len(live) <= budget:
            # Decode steps only, alike until the next job ends but for their contexts, each a token longer a step:
            # take them at once.
            k = min(decode[j] for j in live)
            first = cost.step_s(len(live), sum(context[j] + 1 for j in live))
            more = cost.pair_s * len(live)
            span = _steps_s(first, more, k)
            if t <= age_s < t + span:
                m = _steps_within(first, more, age_s - t)
                left = t + _steps_s(first, more, m + 1) - age_s
            for j in live:
                if guards[j] == math.inf and made[j] + k >= guard[j]:
                    guards[j] = t + _steps_s(first, more, guard[j] - made[j])
                made[j] += k
                decode[j] -= k
                context[j] += k
                if decode[j] <= 0:
                    ends[j] = t + span
            t += span
            continue
        room, tokens, pairs, drew = budget, 0.0, 0.0, []
        for j in live:
            if room <= 0:
                break
            take = min(prefill[j], room) if prefill[j] > 0 else 1
            pairs += chunk_pairs(take, context[j])
            context[j] += take
            room -= take
            tokens += take
            if prefill[j] > 0:
                prefill[j] -= take
                if prefill[j] <= 0:
                    drew.append(j)
            else:
                drew.append(j)
        step = cost.step_s(tokens, pairs)
        if t <= age_s < t + step:
            left = t + step - age_s
        t += step
        for j in drew:
            made[j] += 1
            decode[j] -= 1
            if guards[j] == math.inf and made[j] >= guard[j]:
                guards[j] = t
            if decode[j] <= 0:
                ends[j] = t
    return RunOut([max(0.0, e - age_s) for e in ends],
                  [max(0.0, min(g, e) - age_s) for g, e in zip(guards, ends)], left)
