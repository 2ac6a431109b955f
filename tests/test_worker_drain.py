"""worker/drain.py: a worker told to stop takes no new work, finishes what runs, and hands back the rest.

The timing rules alone, then a real WorkerService (bench model, real ZeroMQ) facing a gateway socket the test
drives: what it hands back and when, what its reports offer while it drains, and that it ends holding nothing.
The same against a real cluster, SIGTERM included, is in tests/test_worker_drain_cluster.py.
"""

from __future__ import annotations

import random
import threading
import time
from contextlib import contextmanager

import pytest

from common import protocol as P
from worker.drain import CONFIRM_GRACE_S, Drain


def test_the_drain_starts_once_and_hands_back_at_its_deadline_or_a_second_signal():
    d = Drain(5.0)
    assert not d.begin(0.0) and not d.active and not d.due(100.0)  # no signal yet: nothing
    d.request()
    assert d.begin(10.0) and d.active and not d.begin(11.0)
    assert not d.due(14.9) and d.due(15.0)
    assert not d.finished(12.0, holding=True, unconfirmed=False)
    assert d.finished(12.0, holding=False, unconfirmed=False)
    assert not d.finished(15.0 + CONFIRM_GRACE_S - 0.1, holding=False, unconfirmed=True)
    assert d.finished(15.0 + CONFIRM_GRACE_S, holding=False, unconfirmed=True)
    d.request()  # a second signal: everything at once, and the confirmations get their grace from now
    assert d.due(11.0) and not d.finished(11.0, holding=False, unconfirmed=True)
    assert d.finished(11.5, holding=False, unconfirmed=False)
    assert not d.finished(11.0 + CONFIRM_GRACE_S - 0.1, holding=False, unconfirmed=True)
    assert d.finished(11.0 + CONFIRM_GRACE_S, holding=False, unconfirmed=True)
    d.request()  # a third: leave at once
    assert d.finished(11.1, holding=False, unconfirmed=True)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "10"])
def test_a_bad_timeout_is_refused(bad):
    with pytest.raises(ValueError, match="drain_timeout_s"):
        Drain(bad)


class FakeGateway:
    """A ROUTER socket the worker connects to, as a gateway's; frames read and kept in order."""

    def __init__(self) -> None:
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.ident: bytes | None = None
        self.seen: list = []

    def receive(self, match, timeout_s: float = 60.0):
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.sock.poll(100):
                self.ident, frame = self.sock.recv_multipart()
                msg = P.decode(frame)
                self.seen.append((time.monotonic(), msg))
                if match(msg):
                    return msg
        raise AssertionError("the worker did not send what was expected; seen: "
                             f"{[type(m).__name__ for _, m in self.seen][-20:]}")

    def dispatch(self, job_id: str, max_tokens: int, tier: str = "P2", attempt: int = 1) -> None:
        prompt = [random.Random(job_id).randrange(3, 500) for _ in range(12)]
        self.sock.send_multipart([self.ident, P.encode(P.DispatchJob(
            job_id, attempt, tier, "t", prompt, max_tokens, 0.0, 1.0, None, 1, "gw", ignore_eos=True))])

    def close(self) -> None:
        self.sock.close(linger=0)


def is_(kind, job_id: str | None = None):
    return lambda m: isinstance(m, kind) and (job_id is None or m.job_id == job_id)


@contextmanager
def serving_worker(model_dir, gateways: list[FakeGateway], **config):
    """A real WorkerService (max 2 running) connected to ``gateways``, serving on a thread once each has its
    hello; yields (service, thread) and stops and closes it all after."""
    from worker import Engine, EngineConfig
    from worker.service import WorkerService
    from worker.service_config import WorkerConfig

    engine = Engine.from_pretrained(str(model_dir), EngineConfig(max_num_seqs=2, p0_reserve_slots=0))
    service = WorkerService(WorkerConfig(gateways=[f"tcp://127.0.0.1:{g.port}" for g in gateways], model="bench",
                                         **config), engine)
    service.connect()
    stop = threading.Event()
    thread = threading.Thread(target=service.serve, args=(stop.is_set,), daemon=True)
    thread.start()
    for g in gateways:
        g.receive(is_(P.WorkerHello))
    try:
        yield service, thread
    finally:
        stop.set()
        thread.join(30)
        service.close()
        for g in gateways:
            g.close()


@pytest.fixture
def draining_worker(bench_model_dir):
    """A worker service serving on a thread (max 2 running), its fake gateway, and a function that starts the
    drain as the signal handler would."""
    gateway = FakeGateway()
    with serving_worker(bench_model_dir, [gateway], worker_id="wk-drain", drain_timeout_s=2.0) as (service, thread):
        yield service, gateway, thread


def test_a_draining_worker_hands_back_what_has_not_started_then_what_runs_out_of_time(draining_worker):
    service, gateway, thread = draining_worker
    gateway.dispatch("long-a", 600)  # about 10 s each here: longer than the drain's 2 s
    gateway.dispatch("long-b", 600)
    gateway.dispatch("queued", 5)  # no slot left: it waits, never started
    gateway.receive(is_(P.JobTokens, "long-a"))
    gateway.receive(is_(P.JobTokens, "long-b"))
    begun = time.monotonic()
    service.drain.request()

    # Said at once, in a hello (what a gateway that restarted meanwhile hears first) and in every report: its
    # slots are no capacity for queued work, and no gateway sends it any.
    assert gateway.receive(is_(P.WorkerHello), timeout_s=1.5).draining
    released = gateway.receive(is_(P.JobReleased, "queued"), timeout_s=5)
    assert (released.attempt, released.reason) == (1, "draining: not started")
    report = gateway.receive(lambda m: isinstance(m, P.WorkerLoad) and "queued" not in m.job_ids)
    assert report.free_slots == 0 and not any(report.victims.values()) and report.preemption_cost_s >= 1e6
    assert report.draining
    assert not [m for t, m in gateway.seen if isinstance(m, (P.WorkerLoad, P.WorkerHello)) and m.draining
                and t < begun]
    assert sorted(report.job_ids) == ["long-a", "long-b"]  # still held, and their leases still extended

    gateway.dispatch("late", 5, tier="P0")  # sent before this gateway read the report offering nothing
    assert gateway.receive(is_(P.JobReleased, "late"), timeout_s=5).reason == "draining: not started"

    out_of_time = [gateway.receive(is_(P.JobReleased, j), timeout_s=10) for j in ("long-a", "long-b")]
    assert all(m.reason == "draining: out of time" for m in out_of_time)
    assert time.monotonic() - begun >= 2.0 - 0.1
    thread.join(10)
    assert not thread.is_alive(), "serve() did not return once it held nothing"
    assert not service.jobs and not service.engine.has_unfinished()
    assert service.engine.kv_usage().num_used == 0  # every block the aborted jobs held is free
    # No report after a release lists the job it released: that would extend the lease the release ended.
    for j in ("queued", "late", "long-a", "long-b"):
        at = next(t for t, m in gateway.seen if is_(P.JobReleased, j)(m))
        assert not [m for t, m in gateway.seen if t > at and isinstance(m, P.WorkerLoad) and j in m.job_ids]
    assert not [m for _, m in gateway.seen if isinstance(m, P.JobFinished)]


def test_a_job_that_finishes_in_time_is_not_handed_back_and_the_worker_waits_for_its_confirmation(
        draining_worker):
    service, gateway, thread = draining_worker
    gateway.dispatch("short", 30)
    gateway.receive(is_(P.JobTokens, "short"))
    service.drain.request()
    done = gateway.receive(is_(P.JobFinished, "short"), timeout_s=10)
    assert done.state == "done" and done.num_tokens == 30
    time.sleep(0.3)
    assert thread.is_alive(), "it left before its completion was confirmed"
    gateway.sock.send_multipart([gateway.ident, P.encode(P.JobFinishedAck("short", 1))])
    thread.join(5)
    assert not thread.is_alive()
    assert not [m for _, m in gateway.seen if isinstance(m, P.JobReleased)]


def test_a_second_signal_hands_back_everything_at_once(draining_worker):
    service, gateway, thread = draining_worker
    gateway.dispatch("long", 600)
    gateway.receive(is_(P.JobTokens, "long"))
    service.drain.request()
    service.drain.request()
    assert gateway.receive(is_(P.JobReleased, "long"), timeout_s=1.5).reason == "draining: out of time"
    thread.join(5)
    assert not thread.is_alive()


def test_a_second_signal_while_the_gateway_restarts_still_hands_back(draining_worker):
    """A second signal while the gateway was down (crashed, its supervisor restarting it): the worker left at once,
    and closing its sockets dropped the hand-backs queued for that gateway; the jobs waited out their leases (an
    attempt counted each). It waits CONFIRM_GRACE_S for a confirmation, sending them again after a hello."""
    import zmq

    service, gateway, thread = draining_worker
    gateway.dispatch("long", 600)
    gateway.receive(is_(P.JobTokens, "long"))
    gateway.sock.close(linger=0)  # down
    service.drain.request()
    service.drain.request()
    end = time.monotonic() + 0.5
    while thread.is_alive() and time.monotonic() < end:
        time.sleep(0.01)
    if not thread.is_alive():
        service.close()  # as the process does the moment serve() returns
    gateway.sock = zmq.Context.instance().socket(zmq.ROUTER)  # back, on the same port
    gateway.sock.bind(f"tcp://127.0.0.1:{gateway.port}")
    released = gateway.receive(is_(P.JobReleased, "long"), timeout_s=3)
    assert (released.attempt, released.reason) == (1, "draining: out of time")
    gateway.sock.send_multipart([gateway.ident, P.encode(P.JobFinishedAck("long", 1))])
    thread.join(CONFIRM_GRACE_S)
    assert not thread.is_alive()


def test_every_hello_comes_with_a_report_at_once(draining_worker):
    """A gateway gives a worker it knows from a hello alone no credit (gateway/workers.WorkerState.credit): a
    hello, at start-up, when a restarted gateway asks for one (hello_first) or when the drain begins, is followed
    by the latest report at once, not a heartbeat later, and a draining worker's says so."""
    service, gateway, thread = draining_worker
    gateway.sock.send_multipart([gateway.ident, P.encode(P.ErrorReply(P.HELLO_FIRST, "who are you?"))])
    gateway.receive(is_(P.WorkerHello))
    service.drain.request()
    gateway.receive(lambda m: isinstance(m, P.WorkerHello) and m.draining, timeout_s=5)
    thread.join(10)
    while gateway.sock.poll(200):  # what it sent before it exited, not yet read
        gateway.seen.append((time.monotonic(), P.decode(gateway.sock.recv_multipart()[1])))
    frames = [m for _, m in gateway.seen]
    hellos = [i for i, m in enumerate(frames) if isinstance(m, P.WorkerHello)]
    assert len(hellos) >= 2  # the fixture's, the one asked for, the draining one (and a periodic one, maybe)
    for i in hellos:
        after = frames[i + 1] if i + 1 < len(frames) else None
        assert isinstance(after, P.WorkerLoad) and after.draining == frames[i].draining, (i, frames[i:i + 2])


def test_a_hand_back_no_gateway_confirms_is_sent_again_after_a_hello_until_one_does(draining_worker):
    """A gateway that restarted drops a worker's frames until its hello: a JobReleased sent then was lost, and its
    job waited out its lease. It is kept, like a completion, and sent again after a hello until a JobFinishedAck
    answers it; then no more copies, and the worker leaves as soon as nothing is left unconfirmed."""
    service, gateway, thread = draining_worker
    gateway.dispatch("long-a", 600)
    gateway.dispatch("long-b", 600)
    gateway.dispatch("queued", 5)  # never started: handed back when the drain begins
    gateway.receive(is_(P.JobTokens, "long-a"))
    gateway.receive(is_(P.JobTokens, "long-b"))
    service.drain.request()
    gateway.receive(is_(P.JobReleased, "queued"), timeout_s=5)  # as if dropped: no confirmation
    first = len(gateway.seen)
    again = gateway.receive(is_(P.JobReleased, "queued"), timeout_s=1.9)  # before the drain's 2 s deadline
    assert (again.attempt, again.reason) == (1, "draining: not started")
    resent = [m for _, m in gateway.seen[first:]]
    assert any(isinstance(m, P.WorkerHello) for m in resent[:-1]), "sent again without a hello first"
    assert not [m for m in resent if isinstance(m, P.WorkerLoad) and "queued" in m.job_ids]  # never held again
    gateway.sock.send_multipart([gateway.ident, P.encode(P.JobFinishedAck("queued", 1))])

    out_of_time = {gateway.receive(is_(P.JobReleased, j), timeout_s=10).job_id for j in ("long-a", "long-b")}
    assert out_of_time == {"long-a", "long-b"}
    time.sleep(0.3)
    assert thread.is_alive(), "it left before its hand-backs were confirmed"
    confirmed = time.monotonic()
    for j in sorted(out_of_time):
        gateway.sock.send_multipart([gateway.ident, P.encode(P.JobFinishedAck(j, 1))])
    thread.join(CONFIRM_GRACE_S - 0.5)
    assert not thread.is_alive(), "it stayed after every hand-back was confirmed"
    while gateway.sock.poll(200):
        gateway.seen.append((time.monotonic(), P.decode(gateway.sock.recv_multipart()[1])))
    late = [m.job_id for t, m in gateway.seen if isinstance(m, P.JobReleased) and t > confirmed + 0.5]
    assert not late, f"sent again after its confirmation: {late}"
    assert not service.unconfirmed_releases and not service.unconfirmed
