"""A worker given a dispatch frame twice, or an older attempt's after a newer one (a frame duplicated, or delayed
on another gateway's connection): the attempt it runs is the newest it was sent, and it runs once.

A real WorkerService (bench model, real ZeroMQ) facing a gateway socket the test drives (tests/test_worker_drain).
"""

from __future__ import annotations

import time

from common import protocol as P
from tests.test_worker_drain import draining_worker, is_  # noqa: F401 - the fixture, used by name


def tokens_of(gateway, job_id: str, attempt: int) -> list[P.JobTokens]:
    return [m for _, m in gateway.seen if isinstance(m, P.JobTokens) and m.job_id == job_id and m.attempt == attempt]


def test_a_duplicated_dispatch_does_not_start_the_job_over(draining_worker):  # noqa: F811
    """The copy restarted the job: its tokens were streamed from index 0 again and its work done twice."""
    service, gateway, _ = draining_worker
    gateway.dispatch("job", 300)
    gateway.receive(lambda m: isinstance(m, P.JobTokens) and m.job_id == "job" and m.index + len(m.token_ids) > 20)
    gateway.dispatch("job", 300)  # the same attempt again
    done = gateway.receive(is_(P.JobFinished, "job"), timeout_s=120)
    assert done.state == "done" and done.num_tokens == 300
    starts = [m.index for m in tokens_of(gateway, "job", 1)]
    assert starts == sorted(starts) and starts.count(0) == 1, f"streamed from the start again: {starts}"
    assert service.counters["duplicate_dispatches"] == 1


def test_an_older_attempts_dispatch_after_a_newer_one_is_dropped(draining_worker):  # noqa: F811
    """Run, the older attempt replaced the current one: its tokens and completion were stale at every gateway,
    while its reports (which name jobs, not attempts) kept the current attempt's lease alive for nothing."""
    service, gateway, _ = draining_worker
    gateway.dispatch("job", 200, attempt=2)
    gateway.receive(is_(P.JobTokens, "job"))
    gateway.dispatch("job", 200, attempt=1)  # delayed: sent before the lease that ended it moved on
    done = gateway.receive(is_(P.JobFinished, "job"), timeout_s=120)
    assert (done.attempt, done.state, done.num_tokens) == (2, "done", 200)
    time.sleep(0.3)
    assert not tokens_of(gateway, "job", 1) and not [m for _, m in gateway.seen if isinstance(m, P.JobFinished)
                                                     and m.attempt == 1]
    assert service.counters["stale_dispatches"] == 1


def test_a_dispatch_with_an_attempt_below_one_is_answered_as_failed(draining_worker):  # noqa: F811
    """Attempts count from 1 (claim.lua): one of 0 or less is a buggy gateway's frame. It was dropped as stale,
    with no answer, and the job waited out its lease in silence; it is answered as an invalid job is: failed, with
    the reason, and nothing runs. A job of the same id running here is left alone."""
    service, gateway, _ = draining_worker
    gateway.dispatch("running", 200, attempt=1)
    gateway.receive(is_(P.JobTokens, "running"))
    for job_id, attempt in (("zero", 0), ("negative", -3), ("running", 0)):
        gateway.dispatch(job_id, 20, attempt=attempt)
        done = gateway.receive(lambda m: isinstance(m, P.JobFinished) and m.job_id == job_id
                               and m.attempt == attempt, timeout_s=10)
        assert done.state == "failed" and "attempt" in done.reason and done.num_tokens == 0, done
    done = gateway.receive(lambda m: isinstance(m, P.JobFinished) and m.job_id == "running" and m.attempt == 1,
                           timeout_s=120)
    assert (done.state, done.num_tokens) == ("done", 200)
    assert not [m for _, m in gateway.seen if isinstance(m, P.JobTokens) and m.job_id in ("zero", "negative")]


def test_a_dispatch_the_engine_refuses_is_answered_counted_and_logged(draining_worker, caplog):  # noqa: F811
    """A buggy gateway's dispatch the engine refuses (negative max_tokens, a token id outside the vocabulary, an
    unknown tier) was answered as failed, but neither counted nor logged: the gateway's fault went unseen here.
    The worker serves on."""
    service, gateway, _ = draining_worker
    bad = {"neg-max": dict(max_tokens=-1), "bad-id": dict(prompt_token_ids=[-1, 5]), "tier": dict(tier="P9")}
    with caplog.at_level("WARNING", logger="worker"):
        for job_id, fields in bad.items():
            msg = P.DispatchJob(job_id, 1, fields.get("tier", "P2"), "t", fields.get("prompt_token_ids", [5, 6]),
                                fields.get("max_tokens", 4), 0.0, 1.0, None, 1, "gw", ignore_eos=True)
            gateway.sock.send_multipart([gateway.ident, P.encode(msg)])
            done = gateway.receive(is_(P.JobFinished, job_id), timeout_s=10)
            assert done.state == "failed" and done.num_tokens == 0 and done.reason, done
    assert service.counters["invalid_dispatches"] == len(bad)
    assert all(any(f"job {j} attempt 1" in r.getMessage() for r in caplog.records) for j in bad), caplog.text
    gateway.dispatch("fine", 8)
    assert gateway.receive(is_(P.JobFinished, "fine"), timeout_s=60).state == "done"


def test_a_refused_re_dispatch_leaves_no_timing_behind(draining_worker):  # noqa: F811
    """A newer attempt the engine refuses aborted the older one here but left its first-prefill timing (and the
    engine request it holds) in the worker's RateTracker: one entry more per refused re-dispatch, for good."""
    service, gateway, _ = draining_worker
    job_ids = [f"job-{i}" for i in range(6)]
    for job_id in job_ids:
        gateway.dispatch(job_id, 600)  # attempt 1, running or waiting for a slot
        bad = P.DispatchJob(job_id, 2, "P2", "t", [-1, 5], 4, 0.0, 1.0, None, 1, "gw", ignore_eos=True)
        gateway.sock.send_multipart([gateway.ident, P.encode(bad)])
        done = gateway.receive(lambda m, j=job_id: isinstance(m, P.JobFinished) and m.job_id == j and m.attempt == 2,
                               timeout_s=10)
        assert done.state == "failed", done
    assert service.counters["invalid_dispatches"] == len(job_ids)
    assert not service.jobs and not service.engine.has_unfinished()
    assert not [j for j in job_ids if j in service.rates._timings], service.rates._timings.keys()
