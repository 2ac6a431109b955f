"""What an engine step costs a worker (worker/step_cost.py): the fit itself, on lines known exactly, and on a real
engine's steps, reported in its heartbeat."""

from __future__ import annotations

import math

import pytest

from common import protocol as P
from worker.calibration import RateTracker, calibrate
from worker.config import EngineConfig
from worker.engine import Engine
from worker.request import SamplingParams
from worker.step_cost import StepCostFit


def test_the_fit_recovers_a_line_through_decode_and_prefill_steps():
    fit = StepCostFit()
    for n in range(400):
        tokens = 1024 if n % 20 == 0 else 2 + n % 3  # a prefill chunk now and then, decode steps between
        fit.add(tokens, 0.025 + 0.0005 * tokens)
    base, per_token, per_pair = fit.cost()
    assert base == pytest.approx(0.025, rel=1e-6) and per_token == pytest.approx(0.0005, rel=1e-6)
    assert per_pair == 0.0  # no pairs reported: none made up


def _prefill_heavy(fit: StepCostFit, base: float, per_token: float, per_pair: float, steps: int = 600) -> None:
    """Steps as a prefill-heavy load has them: two decoding sequences, and now and then a long prompt's 1,024-token
    chunks beside them, the later ones from deeper in the prompt."""
    for n in range(steps):
        ctx = 300 + n % 700  # where the decoding sequences stand
        tokens, pairs = 2, 2 * ctx + 2
        if n % 7 == 0:
            start = 1024 * (n // 7 % 3)  # first, second or third chunk of a 3,000-token prompt
            tokens, pairs = tokens + 1024, pairs + 1024 * start + 1024 * 1025 // 2
        fit.add(tokens, base + per_token * tokens + per_pair * pairs, pairs)


def test_the_fit_recovers_the_cost_of_the_attentions_pairs_beside_the_tokens():
    fit = StepCostFit()
    _prefill_heavy(fit, 0.02, 0.0006, 4e-7)
    assert fit.cost() == pytest.approx((0.02, 0.0006, 4e-7), rel=1e-4)


def test_a_prompts_later_chunks_cost_more_and_the_fit_says_so():
    # The line on tokens alone puts a third chunk and a first at the same cost; the fit with the pairs does not.
    fit = StepCostFit()
    _prefill_heavy(fit, 0.02, 0.0006, 4e-7)
    base, per_token, per_pair = fit.cost()
    first = base + per_token * 1026 + per_pair * (1024 * 1025 // 2 + 2 * 500)
    third = base + per_token * 1026 + per_pair * (2048 * 1024 + 1024 * 1025 // 2 + 2 * 500)
    assert third / first == pytest.approx(1 + 4e-7 * 2048 * 1024 / first, rel=1e-4) and third > 1.9 * first


def test_pairs_without_spread_leave_the_tokens_line_alone_and_a_fitted_pair_slope_stands():
    fit = StepCostFit()
    for n in range(400):  # decode steps and short prompts: the pairs vary by a few thousand at most
        tokens = 40 if n % 10 == 0 else 2
        pairs = tokens * (tokens + 1) // 2 + n % 3
        fit.add(tokens, 0.02 + 0.0005 * tokens, pairs)
    base, per_token, per_pair = fit.cost()
    assert per_pair == 0.0 and base == pytest.approx(0.02, rel=1e-3) and per_token == pytest.approx(0.0005, rel=1e-3)
    fit = StepCostFit(decay=0.01)
    _prefill_heavy(fit, 0.02, 0.0006, 4e-7)
    for n in range(3000):  # then decode steps alone, long enough for the prompts to fade from the sums
        fit.add(2 + n % 2, 0.02 + 0.0006 * (2 + n % 2) + 4e-7 * 1000, 1000)
    assert fit.cost()[2] == pytest.approx(4e-7, rel=1e-3)


def test_a_pair_slope_below_nothing_is_never_told():
    # Steps whose time falls as their pairs grow (noise, or a kernel that speeds up): no negative cost per pair.
    fit = StepCostFit()
    for n in range(300):
        start = 1024 * (n % 3)
        pairs = 1024 * start + 1024 * 1025 // 2
        fit.add(1024 if n % 2 else 2, (0.6 if n % 2 else 0.02) - 1e-8 * pairs, pairs if n % 2 else 2000)
    base, per_token, per_pair = fit.cost()
    assert per_pair == 0.0 and base >= 0 and per_token > 0


def test_recent_steps_take_over_from_old_ones():
    fit = StepCostFit(decay=0.01)
    for n in range(2000):
        fit.add(1 + n % 500, 0.01 + 0.001 * (1 + n % 500))
    for n in range(2000):  # a slower model from here on
        fit.add(1 + n % 500, 0.05 + 0.002 * (1 + n % 500))
    base, per_token, _ = fit.cost()
    assert base == pytest.approx(0.05, rel=0.01) and per_token == pytest.approx(0.002, rel=0.01)


def test_steps_all_of_one_size_give_their_mean_and_no_made_up_slope():
    fit = StepCostFit()
    for s in (0.02, 0.03, 0.025):
        fit.add(2, s)
    assert fit.cost() == pytest.approx((0.025, 0.0, 0.0), abs=1e-4)  # their (decayed) mean
    for _ in range(50):  # then prefill steps: the slope is told apart at last
        fit.add(1002, 0.525)
        fit.add(2, 0.025)
    base, per_token, _ = fit.cost()
    assert base == pytest.approx(0.024, abs=1e-3) and per_token == pytest.approx(0.0005, rel=0.01)


def test_a_line_through_zero_never_gives_a_negative_base():
    fit = StepCostFit()
    for tokens, s in [(10, 0.001), (1000, 1.0), (10, 0.001), (1000, 1.0)]:
        fit.add(tokens, s)  # the line would cross zero below 10 tokens
    base, per_token, per_pair = fit.cost()
    assert base >= 0 and per_token > 0 and per_pair == 0


@pytest.mark.parametrize("tokens, seconds, pairs", [(0, 0.1, 0), (-5, 0.1, 0), (4, 0.0, 10), (4, -1.0, 10),
                                                    (4, math.nan, 10), (4, math.inf, 10), (4, 0.1, -1)])
def test_steps_that_say_nothing_are_left_out(tokens, seconds, pairs):
    fit = StepCostFit()
    fit.add(tokens, seconds, pairs)
    assert fit.cost() == (0.0, 0.0, 0.0)  # nothing measured: the gateway times jobs at the token rates
    fit.add(4, 0.02, 10)
    assert fit.cost() == pytest.approx((0.02, 0.0, 0.0))


def test_a_real_engine_steps_fit_and_the_heartbeat_carries_the_cost(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=2, num_kv_blocks=128,
                                                                  max_num_batched_tokens=64))
    tracker = RateTracker(engine)
    calibrate(engine, tracker)  # a prefill step and decode steps: a line before the first heartbeat
    base, per_token, per_pair = tracker.step_cost()
    assert base > 0 and per_token >= 0 and per_pair >= 0  # (the tiny model's steps may cost the same, whatever
    steps, pairs = [], []  # they batch)
    engine.add_request("long", list(range(1, 200)), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("short", [5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True))
    while engine.has_unfinished():
        tracker.before_step()
        tracker.after_step(engine.step())
        steps.append(engine.last_batched_tokens)
        pairs.append(engine.last_attended_pairs)
        # Each held job's report says where its sequence stands: the tokens in its KV cache.
        for rid, entry in tracker.work().items():
            assert entry[7] == engine.get_request(rid).num_computed_tokens
    # The long prompt went in chunks of the step budget (64) beside the short job's decode tokens.
    assert max(steps) == 64 and min(steps) >= 1 and sum(steps) == 199 + 3 + 7 + 29
    # Every position computed attends to itself and all before it: a sequence that computed n positions (its
    # prompt and all but its last token) attended n(n+1)/2 pairs, whatever its chunks and steps were.
    assert sum(pairs) == sum(n * (n + 1) // 2 for n in (199 + 7, 3 + 29))
    base, per_token, per_pair = tracker.step_cost()
    assert base > 0 and per_token >= 0 and per_pair >= 0
    load = P.WorkerLoad("wk", 0, 0, {}, {}, [], 0.0, {}, *tracker.rates(), tracker.work(),
                        step_base_s=base, step_token_s=per_token, step_pair_s=per_pair)
    assert P.decode(P.encode(load)) == load


def test_a_report_from_a_worker_that_does_not_say_its_step_cost_still_reads():
    old = P.WorkerLoad("wk", 1, 10, {}, {}, [], 0.0)
    back = P.decode(P.encode(old))
    assert back.step_base_s == 0.0 and back.step_token_s == 0.0 and back.step_pair_s == 0.0


def test_the_workers_report_carries_its_step_cost_from_the_calibration_on(tiny_model_dir):
    from worker.service import WorkerService
    from worker.service_config import WorkerConfig

    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=2, num_kv_blocks=64))
    service = WorkerService(WorkerConfig(worker_id="wk-s", gateways=["tcp://127.0.0.1:9"], model="tiny"), engine)
    try:
        service._refresh_snapshot(0.0)
        snap = service._snapshot
        assert (snap.step_base_s, snap.step_token_s, snap.step_pair_s) == (0.0, 0.0, 0.0)  # nothing measured
        service.connect()  # calibrates: its steps are the first the line goes through
        service._refresh_snapshot(0.0)
        load = service._snapshot
        assert load.step_base_s > 0 and load.step_token_s >= 0
        assert (load.step_base_s, load.step_token_s, load.step_pair_s) == service.rates.step_cost()
        assert P.decode(P.encode(load)) == load
    finally:
        service.close()


def test_a_steps_cost_runs_to_the_next_steps_start_but_not_through_idle_time(tiny_model_dir):
    # What the worker does between two steps (sending tokens, reading dispatches, reporting) holds up every job
    # it runs: counted with the step before. Time with nothing to run is not a step's.
    now = [0.0]
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=1, num_kv_blocks=16))
    tracker = RateTracker(engine, clock=lambda: now[0])
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))  # three steps
    for start, end in [(0.0, 0.1), (0.3, 0.4), (0.5, 0.6)]:  # 0.2 s, then 0.1 s between steps
        now[0] = start
        tracker.before_step()
        outs = engine.step()
        now[0] = end
        tracker.after_step(outs)
    assert not engine.has_unfinished()
    now[0] = 5.0  # idle since 0.6
    base, per_token, _ = tracker.step_cost()
    # Steps of 0.3, 0.2 and 0.1 s (too alike in size for a slope): their mean. Idle time counted would make it
    # 1.8 s; the forward passes alone, 0.1 s.
    assert per_token == 0.0 and base == pytest.approx(0.2, rel=0.01)
