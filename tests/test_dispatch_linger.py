"""A worker waits a moment, after a report that offers room, for the dispatch that answers it (worker/linger.py):
otherwise the answer, a few milliseconds behind the report, misses the step the worker had begun meanwhile and
waits that whole step with its slot idle."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from common import protocol as P
from worker.linger import EXPLORE_EVERY, Linger, offers_room


def test_the_window_is_bounded_by_the_cap_and_a_share_of_the_step_and_an_answer_ends_it():
    linger = Linger(0.01, share=0.05)
    assert linger.window_s(1.0) == 0.01  # the cap
    assert linger.window_s(0.1) == pytest.approx(0.005)  # 5 % of the step
    assert linger.window_s(0.01) == 0.0  # under the poller's resolution: not worth a wait
    linger.offered(0.0, 1.0)
    assert linger.poll_ms(0.0) == 10 and linger.poll_ms(0.004) == 6
    linger.dispatched(0.001)  # answered after 1 ms
    assert linger.poll_ms(0.001) == 0 and (linger.waits, linger.answers) == (1, 1)
    assert linger.window_s(1.0) == 0.01  # a quick answer does not shorten the next wait


def test_a_worker_stops_waiting_when_offers_go_unanswered_and_starts_again_when_answers_come_back():
    linger, now = Linger(0.01), 0.0
    waited = []
    for _ in range(40):  # a gateway with nothing queued: no offer is ever answered
        linger.offered(now, 1.0)
        waited.append(linger.poll_ms(now) > 0)
        now += 1.0
    assert all(waited[:7])  # it waits on the first ones ...
    # ... then only now and then, to see whether answers have come back
    assert sum(waited[7:]) == len([i for i in range(8, 41) if i % EXPLORE_EVERY == 0])
    while True:  # the next offer it waits on is answered, and so are all after it
        now += 1.0
        linger.offered(now, 1.0)
        if linger.poll_ms(now):
            break
    linger.dispatched(now + 0.002)
    for _ in range(5):
        now += 1.0
        linger.offered(now, 1.0)
        assert linger.poll_ms(now) > 0
        linger.dispatched(now + 0.002)
    assert linger.answers == 6


def test_a_dispatch_outside_an_offers_window_answers_nothing():
    linger = Linger(0.01)
    linger.dispatched(5.0)  # no offer open
    linger.offered(10.0, 1.0)
    linger.dispatched(10.5)  # long after the window: read after the step, not waited for
    assert linger.answers == 0
    assert linger.poll_ms(10.5) == 0


def test_every_offer_ends_one_way_and_says_how_long_it_waited():
    seen: list[tuple[str, float]] = []
    linger, now = Linger(0.01, observe=lambda outcome, waited_s: seen.append((outcome, waited_s))), 0.0
    linger.offered(now, 1.0)
    linger.dispatched(now + 0.003)
    linger.offered(now := 1.0, 1.0)
    assert linger.poll_ms(now + 0.011) == 0  # waited out
    linger.offered(now := 2.0, 0.001)  # a step too short to wait on
    assert [o for o, _ in seen] == ["answered", "unanswered", "not_waited"]
    assert [w for _, w in seen] == pytest.approx([0.003, 0.01, 0.0])
    assert len(seen) == linger.offers  # one outcome per offer, none twice
    linger.dispatched(now + 0.001)
    assert len(seen) == 3


@pytest.mark.parametrize("cap, share", [(-0.01, 0.05), (float("nan"), 0.05), (0.01, -1.0), (float("inf"), 0.05)])
def test_a_bad_linger_is_refused(cap, share):
    with pytest.raises(ValueError, match="linger"):
        Linger(cap, share)


def test_no_linger_never_waits():
    linger = Linger(0.0)
    linger.offered(0.0, 10.0)
    assert linger.poll_ms(0.0) == 0 and linger.waits == 0


def _load(free_slots: int, victims: dict[str, int]) -> P.WorkerLoad:
    return P.WorkerLoad("wk", free_slots, 10, {}, {}, [], 0.0, victims)


def test_room_is_a_free_slot_or_a_new_victim_for_an_urgent_tier():
    assert offers_room(_load(1, {}), None)
    assert offers_room(_load(0, {"P1": 1}), None)
    assert offers_room(_load(0, {"P0": 2, "P1": 1}), _load(0, {"P0": 1, "P1": 1}))
    assert not offers_room(_load(0, {"P0": 1, "P1": 1}), _load(0, {"P0": 1, "P1": 1}))  # nothing new
    assert not offers_room(_load(0, {"P2": 3}), _load(0, {}))  # no gateway sends a P2 on a victim
    assert not offers_room(_load(0, {}), None)


def _linger_count(outcome: str) -> float:
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value("ts_dispatch_linger_total", {"outcome": outcome}) or 0.0


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 200 + 5 for i in range(n)]


def _job(job_id: str, max_tokens: int, seed: int, prompt: list[int] | None = None) -> bytes:
    prompt = _prompt(20, seed) if prompt is None else prompt
    return P.encode(P.DispatchJob(job_id, 1, "P3", "t", prompt, max_tokens, 0.0, 1.0, None, seed, "gw",
                                  ignore_eos=True))


def _hello_from(gateway) -> bytes:
    """The routing id of the worker whose hello comes first."""
    while gateway.poll(60_000):
        ident, frame = gateway.recv_multipart()
        if isinstance(P.decode(frame), P.WorkerHello):
            return ident
    raise AssertionError("no hello from the worker")


@contextlib.contextmanager
def _serving(model_dir, worker_id: str, engine_config, linger: Linger):
    """A worker service on the tiny model with ``linger``, its step loop on a thread, and a ROUTER socket standing
    in for its gateway. Yields (that socket, the worker's routing id, the service, a function that stops the loop)
    once the worker has said hello. The loop steps only once it holds a job, so a test may wrap
    ``service.engine.step`` before it sends one."""
    import zmq

    from worker import Engine, metrics
    from worker.service import WorkerService
    from worker.service_config import WorkerConfig

    gateway = zmq.Context.instance().socket(zmq.ROUTER)
    port = gateway.bind_to_random_port("tcp://127.0.0.1")
    config = WorkerConfig(worker_id=worker_id, gateways=[f"tcp://127.0.0.1:{port}"], model="tiny",
                          dispatch_linger_s=linger.cap_s)
    service = WorkerService(config, Engine.from_pretrained(model_dir, engine_config))
    service.connect()
    assert service.linger.observe is metrics.dispatch_linger  # what /metrics serves is what the worker's own feeds
    service.linger = linger
    stop = threading.Event()
    thread = threading.Thread(target=service.serve, args=(stop.is_set,), daemon=True)
    thread.start()

    def halt() -> None:
        stop.set()
        thread.join(30)

    try:
        yield gateway, _hello_from(gateway), service, halt
    finally:
        halt()
        service.close()
        gateway.close(linger=0)


@pytest.mark.parametrize("cap_s, noise", [(0.0, False), (0.5, False), (0.5, True)])
def test_the_dispatch_answering_a_freed_slot_starts_in_the_next_step(tiny_model_dir, cap_s, noise):
    """A job finishes and frees a slot beside a long one; the gateway answers 20 ms later with the next job. With
    the linger it starts in the very next step; without, the worker had begun that step and the job misses it
    (the race this fixes, reproduced). Other frames that come first (junk, a cancel of no job here) do not end
    the wait."""
    from worker import EngineConfig, metrics

    # Any step's share: a tiny model's steps take a millisecond or two, the answer here 20 ms.
    linger = Linger(cap_s, share=1e6, observe=metrics.dispatch_linger)
    config = EngineConfig(num_kv_blocks=64, block_size=16, max_num_seqs=3, p0_reserve_slots=1)
    with _serving(tiny_model_dir, "wk-linger", config, linger) as (gateway, ident, service, halt):
        counted_before = {o: _linger_count(o) for o in metrics.LINGER_OUTCOMES}
        steps: list[tuple[set[str], set[str]]] = []  # per step: the jobs that got a token, those that finished
        step = service.engine.step

        def counted_step():
            outs = step()
            steps.append(({o.request_id for o in outs}, {o.request_id for o in outs if o.finished}))
            return outs

        service.engine.step = counted_step
        gateway.send_multipart([ident, _job("long", 200, 1)])
        gateway.send_multipart([ident, _job("short", 3, 2)])
        finished = set()
        while "next" not in finished and gateway.poll(60_000):
            _, frame = gateway.recv_multipart()
            msg = P.decode(frame)
            if isinstance(msg, P.JobFinished):
                finished.add(msg.job_id)
                if msg.job_id == "short":
                    if noise:
                        time.sleep(0.01)
                        gateway.send_multipart([ident, b"\xffnot a frame"])
                        gateway.send_multipart([ident, P.encode(P.CancelJob("no-such-job"))])
                    time.sleep(0.02)  # the gateway's claim in Redis and the frame's way back, made long
                    gateway.send_multipart([ident, _job("next", 3, 3)])
        assert {"short", "next"} <= finished
        short_done = next(i for i, (_, done) in enumerate(steps) if "short" in done)
        next_first = next(i for i, (got, _) in enumerate(steps) if "next" in got)
        assert "long" in steps[short_done + 1][0]  # the long job kept the worker stepping meanwhile
        if cap_s:
            assert next_first == short_done + 1, (steps, vars(service.linger))
            assert service.linger.answers >= 1
            assert service.counters["malformed"] == (1 if noise else 0)
        else:
            assert next_first >= short_done + 2
            assert service.linger.waits == 0
        # /metrics says the same, one outcome per offer (the last may still be open when the loop stops)
        halt()
        counted = {o: _linger_count(o) - counted_before[o] for o in metrics.LINGER_OUTCOMES}
        assert counted["answered"] == linger.answers
        assert counted["answered"] + counted["unanswered"] in (linger.waits, linger.waits - 1)  # one may be open
        assert sum(counted.values()) in (linger.offers, linger.offers - 1)


def test_the_worker_process_refuses_a_negative_linger_before_loading_its_model(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "worker", "--model", str(tmp_path / "no-model-here"),
                           "--dispatch-linger-s", "-1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "linger" in done.stderr and "Traceback" not in done.stderr


def test_a_dispatch_the_worker_refuses_still_answers_the_offer(tiny_model_dir):
    """The gateway answered the freed slot, with a job the worker refuses (an empty prompt here): the offer was
    answered all the same, and waiting on would only hold the running job back for the rest of the window."""
    from worker import EngineConfig

    outcomes: list[tuple[str, float]] = []
    linger = Linger(0.5, share=1e6, observe=lambda outcome, waited: outcomes.append((outcome, waited)))
    config = EngineConfig(num_kv_blocks=64, block_size=16, max_num_seqs=2)
    with _serving(tiny_model_dir, "wk-refuse", config, linger) as (gateway, ident, service, _):
        gateway.send_multipart([ident, _job("long", 400, 1)])
        gateway.send_multipart([ident, _job("short", 3, 2)])
        refused = None
        while refused is None and gateway.poll(60_000):
            msg = P.decode(gateway.recv_multipart()[1])
            if isinstance(msg, P.JobFinished) and msg.job_id == "short":
                outcomes.clear()  # the offers before this one (the second job may answer the first's) are not ours
                time.sleep(0.1)  # well inside the 0.5 s window, and after the offer opens even on a busy machine
                gateway.send_multipart([ident, _job("bad", 3, 3, prompt=[])])
            elif isinstance(msg, P.JobFinished) and msg.job_id == "bad":
                refused = msg
        assert refused is not None and refused.state == "failed" and "empty" in refused.reason
        answered = [waited for outcome, waited in outcomes if outcome == "answered"]
        assert len(answered) == 1 and 0.01 < answered[0] < 0.5, outcomes
        assert "long" in service.jobs  # still running: the refusal touched nothing else


def test_room_is_judged_against_the_last_report_sent_not_the_last_snapshot(tiny_model_dir, monkeypatch):
    """The snapshot is refreshed every half heartbeat interval whether or not it goes out. A victim that appeared
    in a refresh no report carried is new to every gateway when the next report carries it: that report offers
    room, and the worker waits for the answer."""
    from worker import Engine, EngineConfig, load_report
    from worker.service import WorkerService
    from worker.service_config import WorkerConfig

    import zmq

    gateway = zmq.Context.instance().socket(zmq.ROUTER)
    port = gateway.bind_to_random_port("tcp://127.0.0.1")
    now = [0.0]
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(num_kv_blocks=64, block_size=16, max_num_seqs=2))
    service = WorkerService(WorkerConfig(worker_id="wk-room", gateways=[f"tcp://127.0.0.1:{port}"], model="tiny",
                                         heartbeat_interval_s=0.5), engine, clock=lambda: now[0])
    service.sockets[0].connect(f"tcp://127.0.0.1:{port}")
    reports = iter([_load(0, {"P1": 0}), _load(0, {"P1": 1}), _load(0, {"P1": 1})])
    monkeypatch.setattr(load_report, "build", lambda *a, **k: next(reports))
    try:
        service._beat_soon()
        assert service._publish()[0]  # sent: no victim
        assert gateway.poll(10_000) and P.decode(gateway.recv_multipart()[1]).victims == {"P1": 0}
        now[0] = 10.0
        assert not service._publish()[0]  # refreshed (a victim now), not sent
        now[0] = 10.1
        service._beat_soon()
        sent, before = service._publish()
        assert sent and before is not None and before.victims == {"P1": 0}
        assert offers_room(service._snapshot, before)
    finally:
        service.close()
        gateway.close(linger=0)
