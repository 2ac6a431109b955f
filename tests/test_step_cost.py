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
    base, per_token = fit.cost()
    assert base == pytest.approx(0.025, rel=1e-6) and per_token == pytest.approx(0.0005, rel=1e-6)


def test_recent_steps_take_over_from_old_ones():
    fit = StepCostFit(decay=0.01)
    for n in range(2000):
        fit.add(1 + n % 500, 0.01 + 0.001 * (1 + n % 500))
    for n in range(2000):  # a slower model from here on
        fit.add(1 + n % 500, 0.05 + 0.002 * (1 + n % 500))
    base, per_token = fit.cost()
    assert base == pytest.approx(0.05, rel=0.01) and per_token == pytest.approx(0.002, rel=0.01)


def test_steps_all_of_one_size_give_their_mean_and_no_made_up_slope():
    fit = StepCostFit()
    for s in (0.02, 0.03, 0.025):
        fit.add(2, s)
    assert fit.cost() == pytest.approx((0.025, 0.0), abs=1e-4)  # their (decayed) mean
    for _ in range(50):  # then prefill steps: the slope is told apart at last
        fit.add(1002, 0.525)
        fit.add(2, 0.025)
    base, per_token = fit.cost()
    assert base == pytest.approx(0.024, abs=1e-3) and per_token == pytest.approx(0.0005, rel=0.01)


def test_a_line_through_zero_never_gives_a_negative_base():
    fit = StepCostFit()
    for tokens, s in [(10, 0.001), (1000, 1.0), (10, 0.001), (1000, 1.0)]:
        fit.add(tokens, s)  # the line would cross zero below 10 tokens
    base, per_token = fit.cost()
    assert base >= 0 and per_token > 0


@pytest.mark.parametrize("tokens, seconds", [(0, 0.1), (-5, 0.1), (4, 0.0), (4, -1.0), (4, math.nan), (4, math.inf)])
def test_steps_that_say_nothing_are_left_out(tokens, seconds):
    fit = StepCostFit()
    fit.add(tokens, seconds)
    assert fit.cost() == (0.0, 0.0)  # nothing measured: the gateway times jobs at the token rates
    fit.add(4, 0.02)
    assert fit.cost() == pytest.approx((0.02, 0.0))


def test_a_real_engine_steps_fit_and_the_heartbeat_carries_the_cost(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=2, num_kv_blocks=128,
                                                                  max_num_batched_tokens=64))
    tracker = RateTracker(engine)
    calibrate(engine, tracker)  # a prefill step and decode steps: a line before the first heartbeat
    base, per_token = tracker.step_cost()
    assert base > 0 and per_token >= 0  # (the tiny model's steps may cost the same, whatever they batch)
    steps = []
    engine.add_request("long", list(range(1, 200)), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("short", [5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True))
    while engine.has_unfinished():
        tracker.before_step()
        tracker.after_step(engine.step())
        steps.append(engine.last_batched_tokens)
    # The long prompt went in chunks of the step budget (64) beside the short job's decode tokens.
    assert max(steps) == 64 and min(steps) >= 1 and sum(steps) == 199 + 3 + 7 + 29
    base, per_token = tracker.step_cost()
    assert base > 0 and per_token >= 0
    load = P.WorkerLoad("wk", 0, 0, {}, {}, [], 0.0, {}, *tracker.rates(), tracker.work(),
                        step_base_s=base, step_token_s=per_token)
    assert P.decode(P.encode(load)) == load


def test_a_report_from_a_worker_that_does_not_say_its_step_cost_still_reads():
    old = P.WorkerLoad("wk", 1, 10, {}, {}, [], 0.0)
    assert P.decode(P.encode(old)).step_base_s == 0.0 and P.decode(P.encode(old)).step_token_s == 0.0


def test_the_workers_report_carries_its_step_cost_from_the_calibration_on(tiny_model_dir):
    from worker.service import WorkerService
    from worker.service_config import WorkerConfig

    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=2, num_kv_blocks=64))
    service = WorkerService(WorkerConfig(worker_id="wk-s", gateways=["tcp://127.0.0.1:9"], model="tiny"), engine)
    try:
        service._refresh_snapshot(0.0)
        assert (service._snapshot.step_base_s, service._snapshot.step_token_s) == (0.0, 0.0)  # nothing measured
        service.connect()  # calibrates: its steps are the first the line goes through
        service._refresh_snapshot(0.0)
        load = service._snapshot
        assert load.step_base_s > 0 and load.step_token_s >= 0
        assert (load.step_base_s, load.step_token_s) == service.rates.step_cost()
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
    base, per_token = tracker.step_cost()
    # Steps of 0.3, 0.2 and 0.1 s (too alike in size for a slope): their mean. Idle time counted would make it
    # 1.8 s; the forward passes alone, 0.1 s.
    assert per_token == 0.0 and base == pytest.approx(0.2, rel=0.01)
