"""The worker's measured rates and first-prefill times (worker/calibration.py) on a real engine and model."""

from __future__ import annotations

from worker.calibration import RateTracker, calibrate
from worker.config import EngineConfig
from worker.engine import Engine
from worker.request import SamplingParams


def run(engine: Engine, tracker: RateTracker) -> None:
    while engine.has_unfinished():
        tracker.before_step()
        tracker.after_step(engine.step())


def test_calibration_measures_both_rates_and_leaves_the_engine_empty(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=2, num_kv_blocks=64))
    tracker = RateTracker(engine)
    prefill, decode = calibrate(engine, tracker)
    assert prefill > 0 and decode > 0
    assert not engine.has_unfinished() and engine.kv_usage().num_used == 0
    assert tracker.prefill_start_s("calibration-0") is None  # calibration requests are forgotten


def test_calibration_fits_a_pool_too_small_for_a_full_batch(tiny_model_dir):
    # 4 slots but blocks for only one calibration request: it calibrates with what fits.
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=4, num_kv_blocks=5))
    assert all(r > 0 for r in calibrate(engine, RateTracker(engine)))


def test_first_prefill_start_and_held_work(tiny_model_dir):
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=1, num_kv_blocks=64))
    tracker = RateTracker(engine)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True), tier="P3")
    engine.add_request("b", [4, 5], SamplingParams(max_tokens=5, ignore_eos=True), tier="P2")
    tracker.added("a")
    tracker.added("b")
    work = tracker.work()
    # Nothing ran yet: both wait with their whole prompts; P3 may be preempted by P0 and P1, P2 by P0.
    assert work == {"a": [3, 2, 3, 0, 20, 0b11], "b": [2, 2, 2, 0, 5, 0b01]}
    tracker.before_step()
    tracker.after_step(engine.step())
    started = {r: tracker.prefill_start_s(r) for r in "ab"}
    assert started["b"] is not None and started["b"] >= 0  # the P2 outranks the P3: its prefill ran first
    assert started["a"] is None  # one slot: the P3 has not started
    assert tracker.work()["b"][:4] == [2, 0, 0, 1]  # running, prompt done, one token out
    run(engine, tracker)
    assert tracker.prefill_start_s("a") > started["b"]
    assert all(r > 0 for r in tracker.rates())


def test_a_step_that_changes_what_runs_is_reported_at_once(tiny_model_dir):
    # Gateways send P0/P1 jobs to a full worker only on the victims its report lists, and estimate waits from
    # what it runs: a P3 that just started (a victim now) must not wait for the next heartbeat to be seen.
    from worker.service import WorkerService
    from worker.service_config import WorkerConfig

    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=1, num_kv_blocks=64))
    service = WorkerService(WorkerConfig(worker_id="wk-b", gateways=["tcp://127.0.0.1:9"], model="tiny"), engine)
    try:
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True), tier="P3")
        service._step()  # "a" starts
        assert service._beat_pending
        service._beat_pending = False
        service._step()  # "a" decodes: nothing new to say before the heartbeat
        assert not service._beat_pending
        engine.add_request("b", [4, 5], SamplingParams(max_tokens=5, ignore_eos=True), tier="P0")
        service._step()  # "b" takes the slot, "a" gives way
        assert service._beat_pending and [r.request_id for r in engine.scheduler.running] == ["b"]
    finally:
        service.close()
