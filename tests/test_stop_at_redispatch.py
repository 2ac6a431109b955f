"""A stop (``cancel(job_id, stop_at=n)``) outlives the attempt it was sent to: it is kept with the job in Redis
(stop_at.lua) and carried on every later dispatch (DispatchJob.stop_at), so a job whose worker died (or handed it
back) after the stop ends done, finish_reason "stop", with its first n tokens, as its caller was answered, not
with all of them. A stop of a job back in its queue is kept for its next attempt; a later stop lowers the kept one
and never raises it; a stopped job going to a worker older than the stop is cancelled (it would run past it).

A real gateway process and Redis with a short lease; the workers are raw sockets (tests/raw_worker.py), so that one
dies (its socket closed, its reports stopped) at an exact moment. Real workers killed -9 through a real cluster of
two gateways: tests/test_stop_at_kill.py.
"""

from __future__ import annotations

import os
import uuid
from unittest import mock

import pytest
import redis

from common import protocol as P
from common.errors import JobCancelled
from common.redis_server import RedisServer
from gateway.sdk import GatewayClient
from tests.cluster_helpers import wait_for
from tests.raw_worker import RawWorker
from tests.test_stop_at import TOKENS, finish, running, started
from tests.test_tokenizer_match import _Gateway

LEASE_S = 2.0  # a dead worker's job goes back to its queue this long after its last report


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    prefix = f"stopkept-{uuid.uuid4().hex[:8]}"
    with RedisServer() as redis_server, mock.patch.dict(os.environ, {"TS_GATEWAY_LEASE_S": str(LEASE_S)}):
        gw = _Gateway(tmp_path_factory.mktemp("stop-kept"), "gw-stop-kept", redis_server.url, prefix)
        gw.redis = redis.Redis.from_url(redis_server.url)
        gw.job_key = lambda job_id: f"{prefix}:{{c}}:job:{job_id}"
        try:
            yield gw.started()
        finally:
            gw.stop()


@pytest.fixture
def sdk(gateway):
    with GatewayClient(gateway.clients, gateway.tenants["api-co"]["api_key"], timeout_s=30) as client:
        yield client


@pytest.fixture
def workers(gateway, sdk):
    """Raw workers made by name (``make(name, **hello)``), each known to the gateway before it is returned; every
    one is closed (dead) at the end, and the gateway left knowing none."""
    made: list[RawWorker] = []

    def make(name: str, **hello) -> RawWorker:
        wk = RawWorker(gateway.workers, f"{name}-{uuid.uuid4().hex[:4]}", **({"stops_at": True} | hello))
        made.append(wk)
        wait_for(lambda: wk.worker_id in sdk.info().workers, 30, f"the gateway to take {name}")
        return wk

    yield make
    for wk in made:
        wk.close()
    wait_for(lambda: not sdk.info().workers, 60, "the gateway to forget the raw workers")


def die(wk: RawWorker, sdk: GatewayClient, job) -> None:
    """``wk`` dies (kill -9: no completion, no more reports); its job goes back to its queue when its lease ends."""
    wk.close()
    wait_for(lambda: sdk.status(job.id).state == "queued", 30, "the dead worker's job to go back to its queue")


def redispatched(wk: RawWorker, job) -> P.DispatchJob:
    d = wk.recv(P.DispatchJob, 30)
    assert d is not None and d.job_id == job.id and d.attempt == 2
    wk.held = [job.id]
    return d


def test_a_job_whose_worker_died_after_the_stop_ends_there_on_its_next_worker(gateway, sdk, workers):
    a = workers("wk-a")
    job, d = running(a, sdk, 2)
    started(job, 2)
    assert sdk.cancel(job.id, stop_at=4) is True  # past what it has made: its worker ends it at its 4th token
    stop = a.recv(P.CancelJob, 30)
    assert stop is not None and (stop.attempt, stop.stop_at) == (d.attempt, 4)
    die(a, sdk, job)  # before its 4th token
    b = workers("wk-b")
    d2 = redispatched(b, job)
    assert d2.stop_at == 4 and d2.resume_token_ids == TOKENS[:2]
    b.send(P.JobTokens(job.id, d2.attempt, 2, TOKENS[2:5]))  # the step that passed the stop streamed on
    finish(b, d2, "stop", TOKENS[:4])
    result = job.result(timeout=30)
    assert (result.token_ids, result.finish_reason) == (TOKENS[:4], "stop")
    assert sdk.status(job.id).state == "done"


def test_a_later_stop_lowers_the_kept_one_and_never_raises_it(gateway, sdk, workers):
    a = workers("wk-a")
    job, d = running(a, sdk, 2)
    started(job, 2)
    told = []
    for n in (6, 4, 5):
        assert sdk.cancel(job.id, stop_at=n) is True
        stop = a.recv(P.CancelJob, 30)
        assert stop is not None
        told.append(stop.stop_at)
    assert told == [6, 4, 4]  # its answer ended at its earliest stop: a later one past it changes nothing
    assert gateway.redis.hget(gateway.job_key(job.id), "stop_at") == b"4"
    die(a, sdk, job)
    b = workers("wk-b")
    d2 = redispatched(b, job)
    assert d2.stop_at == 4
    finish(b, d2, "stop", TOKENS[:4])
    assert job.result(timeout=30).token_ids == TOKENS[:4]


def test_a_stop_of_a_job_back_in_its_queue_is_kept_for_its_next_attempt(gateway, sdk, workers):
    a = workers("wk-a")
    job, d = running(a, sdk, 3)
    started(job, 3)
    die(a, sdk, job)  # running nowhere when the stop comes
    assert sdk.cancel(job.id, stop_at=3) is True
    assert sdk.status(job.id).state == "queued"  # not cancelled: its next attempt ends at the stop
    b = workers("wk-b")
    d2 = redispatched(b, job)
    assert d2.stop_at == 3 and d2.resume_token_ids == TOKENS[:3]  # a worker ends it at once: it holds them all
    finish(b, d2, "stop", TOKENS[:3])
    result = job.result(timeout=30)
    assert (result.token_ids, result.finish_reason) == (TOKENS[:3], "stop")


def test_a_stopped_job_going_to_a_worker_older_than_the_stop_is_cancelled(gateway, sdk, workers):
    """Such a worker would run it to its end, past the answer its caller was given."""
    a = workers("wk-a")
    job, d = running(a, sdk, 2)
    started(job, 2)
    assert sdk.cancel(job.id, stop_at=4) is True
    die(a, sdk, job)
    old = workers("wk-old", stops_at=False)
    with pytest.raises(JobCancelled):
        job.result(timeout=30)
    assert old.recv(P.DispatchJob, 1.0) is None


def test_a_stop_of_a_finished_job_changes_nothing(gateway, sdk, workers):
    a = workers("wk-a")
    job, d = running(a, sdk, 2)
    finish(a, d, "length", TOKENS)
    assert job.result(timeout=30).token_ids == TOKENS
    before = gateway.redis.hgetall(gateway.job_key(job.id))
    assert sdk.cancel(job.id, stop_at=3) is False
    assert a.recv(P.CancelJob, 0.5) is None
    assert gateway.redis.hgetall(gateway.job_key(job.id)) == before
    result = job.result(timeout=30)
    assert (result.token_ids, result.finish_reason) == (TOKENS, "length")


def test_a_job_handed_back_after_the_stop_ends_there_on_its_next_worker(gateway, sdk, workers):
    """A draining worker hands it back (JobReleased) rather than die: the re-dispatch carries the stop as well."""
    a = workers("wk-a")
    job, d = running(a, sdk, 2)
    started(job, 2)
    assert sdk.cancel(job.id, stop_at=5) is True
    assert a.recv(P.CancelJob, 30) is not None
    a.held = ["busy"]  # full: its job goes elsewhere
    a.send(P.JobReleased(job.id, d.attempt))
    b = workers("wk-b")
    d2 = redispatched(b, job)
    assert d2.stop_at == 5
    finish(b, d2, "stop", TOKENS[:5])
    result = job.result(timeout=30)
    assert (result.token_ids, result.finish_reason) == (TOKENS[:5], "stop")
