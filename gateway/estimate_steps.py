"""A worker's engine steps, replayed for the wait model (gateway/estimate.py).

Each worker measures what a step costs it: seconds = base + per token x the tokens the step batches (prefill
chunks, and one token per decoding sequence; worker/step_cost.py). With it the model times the work a worker
holds now as the worker will run it, not at per-sequence token rates averaged over jobs:

- the work a worker holds runs out step by step (``run_out``), in the worker's own order: each step the
  running jobs, oldest first, take one token each while decoding or a chunk of their prompt, until the step's
  token budget (max_num_batched_tokens) is spent. So a short job next to a long prompt's prefill waits out that
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

    def step_s(self, tokens: float) -> float:
        return self.base_s + self.token_s * tokens


@dataclass(frozen=True)
class RunOut:
    """How the work a worker holds runs out, if nothing else comes: per job, when it ends and when its guard lets
    it be preempted; and when the step in progress ends (a job sent now is read after it). Seconds from now."""

    ends: list[float]
    guards: list[float]
    step_left_s: float


def interference_s(cost: StepCost, prefill: float) -> float:
    """How much longer the work beside a job runs while the job's prompt is prefilled: its chunks' tokens."""
    return cost.token_s * max(0.0, prefill)


def run_out(jobs: Sequence[tuple[float, float, float]], cost: StepCost, budget: float, age_s: float = 0.0) -> RunOut:
    """Step the worker through ``jobs`` (prefill tokens left, tokens still to generate, tokens to generate before
    its guard lets it go), in the worker's order, until all have ended (see the module docstring). ``jobs`` are as
    the worker reported them ``age_s`` ago: the steps since have run, and one is in progress now."""
    n = len(jobs)
    prefill = [max(0.0, p) for p, _, _ in jobs]
    # Steps still to decode: a fraction of an expected token is a step, as the worker draws whole tokens.
    decode = [math.ceil(max(0.0, d) - 1e-9) for _, d, _ in jobs]
    guard = [g for _, _, g in jobs]
    made = [0] * n
    ends = [0.0 if prefill[j] <= 0 and decode[j] <= 0 else math.inf for j in range(n)]
    guards = [0.0 if guard[j] <= 0 else math.inf for j in range(n)]
    t, left = 0.0, 0.0
    while True:
        live = [j for j in range(n) if ends[j] == math.inf]
        if not live:
            break
        if all(prefill[j] <= 0 for j in live) and len(live) <= budget:
            # Decode steps only, alike until the next job ends: take them at once.
            k = min(decode[j] for j in live)
            step = cost.step_s(len(live))
            if t <= age_s < t + k * step:
                left = step - (age_s - t) % step
            for j in live:
                if guards[j] == math.inf and made[j] + k >= guard[j]:
                    guards[j] = t + (guard[j] - made[j]) * step
                made[j] += k
                decode[j] -= k
                if decode[j] <= 0:
                    ends[j] = t + k * step
            t += k * step
            continue
        room, tokens, drew = budget, 0.0, []
        for j in live:
            if room <= 0:
                break
            if prefill[j] > 0:
                chunk = min(prefill[j], room)
                prefill[j] -= chunk
                room -= chunk
                tokens += chunk
                if prefill[j] <= 0:
                    drew.append(j)
            else:
                room -= 1
                tokens += 1
                drew.append(j)
        step = cost.step_s(tokens)
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
