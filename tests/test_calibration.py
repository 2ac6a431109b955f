"""The worker's measured rates and first-prefill times (worker/calibration.py) on a real engine and model, and
how a worker reports a first prefill's time to the gateway."""

from __future__ import annotations

import pytest

from common import protocol as P
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
    # No guard on either, and nothing in the KV cache.
    assert work == {"a": [3, 2, 3, 0, 20, 0b11, 0, 0], "b": [2, 2, 2, 0, 5, 0b01, 0, 0]}
    tracker.before_step()
    tracker.after_step(engine.step())
    started = {r: tracker.prefill_start_s(r) for r in "ab"}
    assert started["b"] is not None and started["b"] >= 0  # the P2 outranks the P3: its prefill ran first
    assert started["a"] is None  # one slot: the P3 has not started
    assert tracker.work()["b"][:4] == [2, 0, 0, 1]  # running, prompt done, one token out
    assert tracker.work()["b"][7] == 2  # its prompt in the cache; the token out is computed next step
    run(engine, tracker)
    assert tracker.prefill_start_s("a") > started["b"]
    assert all(r > 0 for r in tracker.rates())


def test_held_work_says_how_long_its_preemption_guards_protect_it(tiny_model_dir):
    # One slot: a P0 suspends the P3; the P3 resumes with a residency of min_residency_steps (8) tokens, during
    # which the next P0 must wait, and the report counts it down; near its end the progress guard covers the rest.
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=1, num_kv_blocks=64))
    tracker = RateTracker(engine)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True), tier="P3")
    for _ in range(3):
        engine.step()
    assert tracker.work()["a"][6] == 0  # never suspended: nothing protects it
    engine.add_request("p0", [4, 5], SamplingParams(max_tokens=2, ignore_eos=True), tier="P0")
    engine.step()
    assert tracker.work()["a"][1] == 1 and tracker.work()["a"][6] == 8  # suspended: it resumes protected
    while tracker.work()["a"][1] != 0:
        engine.step()
    left = tracker.work()["a"]
    ends_at = left[3] + left[6]  # the token its residency ends at: counted down, one a token
    assert 0 < left[6] <= 8
    while left[6] > 0:
        assert left[3] + left[6] == ends_at, left
        engine.step()
        left = tracker.work()["a"]
    assert left[3] == ends_at and left[4] - left[3] > 4  # free to be preempted again, far from its end
    while left[4] - left[3] > 4:
        engine.step()
        left = tracker.work()["a"]
    assert left[6] == left[4] - left[3]  # the last few tokens: protected to its end
    run(engine, tracker)


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


def test_a_completion_sent_late_says_how_long_ago_its_prefill_started(tiny_model_dir):
    # The gateway puts a job's prefill start at prefill_start_age_s before the frame came. A completion the
    # gateway could not take at once is retried later: its age must have grown by the delay, or the gateway
    # would put the start, and so the end of the job's wait, that much too late.
    import zmq

    from worker.service import WorkerService
    from worker.service_config import WorkerConfig

    now = [100.0]
    gateway = zmq.Context.instance().socket(zmq.ROUTER)
    port = gateway.bind_to_random_port("tcp://127.0.0.1")
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=2))
    service = WorkerService(WorkerConfig(worker_id="wk-late", gateways=[f"tcp://127.0.0.1:{port}"], model="tiny"),
                            engine, clock=lambda: now[0])
    service.sockets[0].connect(f"tcp://127.0.0.1:{port}")
    sends, real_send = [], service._send

    def send_unless_refused(sock, msg):  # the gateway refuses the first try (as a full queue would)
        sends.append(msg)
        return len(sends) > 1 and real_send(sock, msg)

    service._send = send_unless_refused
    try:
        done = P.JobFinished("j", 1, "done", "length", 2, 0.1, 0.5, 0, None, [7, 8], prefill_start_s=0.01,
                             prefill_start_age_s=0.4)
        service._finish(service.sockets[0], done)
        assert service.unconfirmed.job_ids() == ["j"]  # kept, not lost
        now[0] += 3.0
        service._resend_unconfirmed()  # a hello first, then the completion
        frames = []
        while gateway.poll(10_000):
            frames.append(P.decode(gateway.recv_multipart()[1]))
            if isinstance(frames[-1], P.JobFinished):
                break
        assert [type(f).__name__ for f in frames] == ["WorkerHello", "JobFinished"]
        late = frames[-1]
        assert late.prefill_start_age_s == pytest.approx(0.4 + 3.0) and late.token_ids == [7, 8]
        assert service.unconfirmed.job_ids() == ["j"]  # until a gateway confirms it
    finally:
        service.close()
        gateway.close(linger=0)


def test_a_resumed_request_counts_its_earlier_output_as_prefill_not_as_decode(tiny_model_dir):
    # A re-dispatched job comes with the output its earlier attempts made (resume_token_ids): the engine prefills
    # prompt + that output in its first steps and draws the next token at the end, as a fresh request draws its
    # first. The held work said one token less than that prefill; the prefill rate was the prompt alone over the
    # whole prefill's time (too slow), and the decode rate counted the earlier output as decoded here (too fast).
    ticks = iter(range(1000))
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(max_num_seqs=2, num_kv_blocks=64))
    tracker = RateTracker(engine, clock=lambda: next(ticks) * 0.5)  # a step: 0.5 s, then 0.5 s between steps
    engine.add_request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=40, ignore_eos=True), tier="P3",
                       output_token_ids=list(range(10, 40)))
    tracker.added("r")
    assert tracker.work()["r"][2:4] == [35, 30]  # prefill left: 5 prompt + 30 earlier tokens
    tracker.before_step()
    tracker.after_step(engine.step())
    assert engine.last_batched_tokens == 35 and tracker.work()["r"][2:4] == [0, 31]
    run(engine, tracker)
    # 35 tokens prefilled in one 0.5 s step; then 9 tokens, one a second.
    assert tracker.rates() == (pytest.approx(70.0), pytest.approx(1.0))
