"""A stop (CancelJob.stop_at) that reaches the worker before the dispatch of its attempt.

Each gateway has its own connection to a worker: gateway B may keep a stop in Redis just after gateway A claimed the
job (stop_at.lua reads the claim: B tells the worker that attempt), and B's frame can come first. The worker dropped
it as a stop of a job it did not have, and the attempt ran to its end, past the answer its caller was given (the
record then held every token, finish "length"). It is now kept until the dispatch comes (a minute at most).

A real WorkerService (bench model, real ZeroMQ) facing two gateway sockets the test drives (tests/test_worker_drain).
"""

from __future__ import annotations

from common import protocol as P
from tests.cluster_helpers import wait_for
from tests.test_worker_drain import FakeGateway, is_, serving_worker
from worker.intake import EarlyStops


def _stop(gateway: FakeGateway, job_id: str, attempt: int, n: int) -> None:
    gateway.sock.send_multipart([gateway.ident, P.encode(P.CancelJob(job_id, attempt, stop_at=n))])


def test_a_stop_sent_before_its_dispatch_by_another_gateway_ends_the_job_there(bench_model_dir):
    a, b = FakeGateway(), FakeGateway()
    with serving_worker(bench_model_dir, [a, b], worker_id="wk-early") as (service, _):
        _stop(b, "job", 1, 6)
        _stop(b, "job", 1, 9)  # a later, larger stop does not raise it
        wait_for(lambda: service.counters["early_stops"] == 2, 30, "the worker to read the stops")
        a.dispatch("job", 300)
        done = a.receive(is_(P.JobFinished, "job"), timeout_s=120)
        assert (done.attempt, done.state, done.finish_reason, done.num_tokens) == (1, "done", "stop", 6), done
        assert len(done.token_ids) == 6
        assert service.counters["early_stops"] == 2 and len(service.early_stops) == 0
        assert not service.jobs


def test_a_stop_of_the_next_attempt_waits_for_it_and_leaves_the_current_one_to_its_dispatch(bench_model_dir):
    """Attempt 1 runs here; gateway B, which claimed attempt 2 (here again, after a lease ran out), stops it before
    its dispatch comes: attempt 2 ends at the stop."""
    a, b = FakeGateway(), FakeGateway()
    with serving_worker(bench_model_dir, [a, b], worker_id="wk-early-2") as (service, _):
        a.dispatch("job", 300, attempt=1)
        a.receive(is_(P.JobTokens, "job"))
        _stop(b, "job", 2, 5)
        wait_for(lambda: service.counters["early_stops"] == 1, 30, "the worker to read the stop")
        b.dispatch("job", 300, attempt=2)
        done = b.receive(lambda m: isinstance(m, P.JobFinished) and m.job_id == "job", timeout_s=120)
        assert (done.attempt, done.state, done.finish_reason, done.num_tokens) == (2, "done", "stop", 5), done
        assert service.counters["early_stops"] == 1 and len(service.early_stops) == 0


def test_a_dispatch_s_malformed_stop_leaves_the_early_one(bench_model_dir):
    """A buggy gateway's stop_at of -1 in the dispatch is dropped (counted), not taken for the smaller stop, and the
    stop that came first still ends the job."""
    a, b = FakeGateway(), FakeGateway()
    with serving_worker(bench_model_dir, [a, b], worker_id="wk-early-3") as (service, _):
        _stop(b, "job", 1, 4)
        wait_for(lambda: service.counters["early_stops"] == 1, 30, "the worker to read the stop")
        a.sock.send_multipart([a.ident, P.encode(P.DispatchJob(
            "job", 1, "P2", "t", [5, 6, 7], 50, 0.0, 1.0, None, 1, "gw", ignore_eos=True, stop_at=-1))])
        done = a.receive(is_(P.JobFinished, "job"), timeout_s=120)
        assert (done.state, done.finish_reason, done.num_tokens) == ("done", "stop", 4), done
        assert service.counters["malformed"] == 1


def test_a_stop_that_is_never_dispatched_is_let_go():
    stops = EarlyStops()
    stops.keep("a", 1, 5, now=0.0)
    stops.keep("a", 1, 3, now=1.0)
    stops.keep("a", 2, 7, now=1.0)
    assert stops.take("a", 1, now=2.0) == 3 and stops.take("a", 1, now=2.0) is None
    assert stops.take("a", 2, now=1.0 + EarlyStops.KEEP_S + 0.1) is None  # gone after KEEP_S
    for i in range(EarlyStops.MAX + 10):  # a flood of stops for jobs never sent: bounded, the oldest go first
        stops.keep(f"j{i}", 1, 1, now=5.0)
    assert len(stops) == EarlyStops.MAX
    assert stops.take("j0", 1, now=5.0) is None and stops.take(f"j{EarlyStops.MAX + 9}", 1, now=5.0) == 1
