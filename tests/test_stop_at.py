"""``cancel(job_id, stop_at=n)``: the caller's answer ended with the job's first n tokens (the HTTP door's stop
strings), so the job ends done there, finish_reason "stop", with exactly those tokens, rather than cancelled.

The gateway passes the stop to the job's worker (CancelJob.stop_at) and stores the completion that worker sends,
as any other; the worker's result may be shorter than what it streamed (the step that passed the stop streamed
on), and only such a result, ended "stop" and the start of the streamed tokens, is taken. Where the worker is
older (its hello does not say ``stops_at``), it is cancelled as before; a queued job keeps the stop for its next
attempt (tests/test_stop_at_redispatch.py).

A real gateway process and Redis; the workers are raw sockets speaking the wire protocol (as worker/service.py
does), so that the test chooses what each sends. The real worker's side, through the real cluster and the HTTP
door: tests/test_http_stop.py.
"""

from __future__ import annotations

import uuid

import pytest

from common import protocol as P
from common.errors import InvalidRequest, JobCancelled, JobFailed
from common.redis_server import RedisServer
from gateway.sdk import GatewayClient
from tests.cluster_helpers import wait_for
from tests.raw_worker import RawWorker
from tests.test_tokenizer_match import _Gateway

TOKENS = [10, 11, 12, 13, 14, 15, 16]


def running(wk: RawWorker, sdk: GatewayClient, n: int = 5):
    """A job dispatched to ``wk`` that has streamed its first ``n`` tokens: (job, its dispatch)."""
    job = sdk.submit(prompt_token_ids=[3, 4, 5], max_tokens=len(TOKENS), ignore_eos=True)
    d = wk.recv(P.DispatchJob, 30)
    assert d is not None and d.job_id == job.id
    wk.held = [job.id]
    wk.send(P.JobTokens(job.id, d.attempt, 0, TOKENS[:n]))
    return job, d


def finish(wk: RawWorker, d: P.DispatchJob, reason: str, tokens: list[int]) -> None:
    wk.send(P.JobFinished(d.job_id, d.attempt, "done", reason, len(tokens), 0.01, 0.1, 0, None, tokens))
    wk.held = []
    assert wk.recv(P.JobFinishedAck, 30) is not None


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    with RedisServer() as redis_server:
        gw = _Gateway(tmp_path_factory.mktemp("stop-at"), "gw-stop-at", redis_server.url,
                      f"stopat-{uuid.uuid4().hex[:8]}")
        try:
            yield gw.started()
        finally:
            gw.stop()


@pytest.fixture
def sdk(gateway):
    with GatewayClient(gateway.clients, gateway.tenants["api-co"]["api_key"], timeout_s=30) as client:
        yield client


@pytest.fixture(scope="module")
def worker(gateway):
    """A raw worker that takes CancelJob.stop_at, the only one the gateway knows (each test leaves it idle)."""
    wk = RawWorker(gateway.workers, "wk-new", stops_at=True)
    with GatewayClient(gateway.clients, gateway.tenants["api-co"]["api_key"], timeout_s=30) as client:
        wait_for(lambda: client.info().workers == [wk.worker_id], 30, "the gateway to take the raw worker")
    try:
        yield wk
    finally:
        wk.close()


def started(job, n: int) -> None:
    """Wait until the job's stream has delivered ``n`` tokens (the gateway has them)."""
    seen = 0
    for chunk in job.stream(timeout=30):
        seen += len(chunk.token_ids)
        if seen >= n:
            return


def test_the_worker_is_told_where_the_answer_ended_and_its_cut_result_is_stored_done(worker, sdk):
    job, d = running(worker, sdk, 5)
    started(job, 5)
    assert sdk.cancel(job.id, stop_at=3) is True
    stop = worker.recv(P.CancelJob, 30)
    assert stop is not None and (stop.job_id, stop.attempt, stop.stop_at) == (job.id, d.attempt, 3)
    assert sdk.status(job.id).state == "dispatched"  # its worker's completion ends it, not the cancel
    finish(worker, d, "stop", TOKENS[:3])  # shorter than the 5 it streamed: the step past the stop
    result = job.result(timeout=30)
    assert (result.token_ids, result.finish_reason) == (TOKENS[:3], "stop")
    assert sdk.status(job.id).state == "done"


@pytest.mark.parametrize("reason, tokens", [("length", TOKENS[:3]), ("stop", [10, 11, 99]), ("eos", TOKENS[:2])],
                         ids=["shorter-not-stopped", "not-the-streamed-start", "shorter-eos"])
def test_a_result_shorter_than_what_was_streamed_is_taken_only_as_a_stop_at_the_streamed_tokens(
        worker, sdk, reason, tokens):
    """The check that a result holds every streamed token is kept for everything but a cut at a stop."""
    job, d = running(worker, sdk, 5)
    started(job, 5)
    finish(worker, d, reason, tokens)
    with pytest.raises(JobFailed, match="disagree"):
        job.result(timeout=30)


def test_a_worker_older_than_the_stop_has_the_job_cancelled(gateway, worker, sdk):
    worker.held = ["busy"]  # reported full: the job goes to the older worker
    worker.beat()
    old = RawWorker(gateway.workers, "wk-old", stops_at=False)
    try:
        wait_for(lambda: len(sdk.info().workers) == 2, 30, "the gateway to take the older worker")
        job, d = running(old, sdk, 5)
        started(job, 5)
        assert sdk.cancel(job.id, stop_at=3) is True
        plain = old.recv(P.CancelJob, 30)
        assert plain is not None and plain.job_id == job.id and plain.stop_at is None
        with pytest.raises(JobCancelled):
            job.result(timeout=30)
        assert worker.recv(P.CancelJob, 0.5) is None  # nothing went to the other worker
    finally:
        old.close()
        worker.held = []
        worker.beat()
        wait_for(lambda: sdk.info().workers == [worker.worker_id], 60, "the gateway to forget the older worker")


def test_a_queued_job_keeps_the_stop_for_its_attempt(worker, sdk):
    """Not cancelled: the stop is kept with it (stop_at.lua) and its attempt ends there (DispatchJob.stop_at)."""
    job, d = running(worker, sdk, 5)  # holds the raw worker's one slot
    queued = sdk.submit(prompt_token_ids=[3, 4], max_tokens=4)
    assert sdk.status(queued.id).state == "queued"
    assert sdk.cancel(queued.id, stop_at=2) is True
    assert sdk.status(queued.id).state == "queued"
    finish(worker, d, "length", TOKENS[:5] + [20, 21])
    assert job.result(timeout=30).token_ids == TOKENS[:5] + [20, 21]
    d2 = worker.recv(P.DispatchJob, 30)
    assert d2 is not None and (d2.job_id, d2.stop_at) == (queued.id, 2)
    worker.held = [queued.id]
    finish(worker, d2, "stop", [30, 31])
    result = queued.result(timeout=30)
    assert (result.token_ids, result.finish_reason) == ([30, 31], "stop")


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "3", 2**63, [3]])
def test_a_bad_stop_at_is_refused_and_changes_nothing(worker, sdk, bad):
    job, d = running(worker, sdk, 5)
    started(job, 5)
    with pytest.raises(InvalidRequest) as e:  # by the SDK, before anything is sent
        sdk.cancel(job.id, stop_at=bad)
    assert e.value.field == "stop_at"
    if type(bad) is int and bad < 2**63:  # and by the gateway, from a client that sends it anyway
        with pytest.raises(InvalidRequest) as e:
            sdk._call(P.CancelRequest(sdk.api_key, job.id, stop_at=bad))
        assert e.value.field == "stop_at"
    assert worker.recv(P.CancelJob, 1.0) is None
    assert sdk.status(job.id).state == "dispatched"
    finish(worker, d, "length", TOKENS)
    assert job.result(timeout=30).token_ids == TOKENS
