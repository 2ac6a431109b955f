"""An SDK call's arguments are input like any other: a bad one (a job id, a timeout) is refused by the SDK with
InvalidRequest, at once, and nothing else on the client's connection notices.

Real processes (scripts/up.py: redis-server, a gateway, a worker).
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import threading
import time

import pytest

from common import protocol as P
from gateway.sdk import AsyncGatewayClient, AsyncJob, GatewayClient, InvalidRequest, Job, ServingError
from tests.cluster_helpers import frozen, local_cluster, state_pids
from tests.sdk_helpers import SdkWarnings, close_under_waiters, stream_beside

# Over one frame: the gateway's ZeroMQ drops the connection that carries it, and every stream on it with it.
HUGE = "x" * P.MAX_MESSAGE_BYTES


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("job-ids"), tiny_model_dir, workers=1, max_running=4,
                       http=False) as c:
        yield c


def key(c: dict) -> str:
    return c["tenants"]["lab-co"]["api_key"]


def test_a_bad_job_id_is_refused_at_once_and_the_streams_beside_it_go_on(cluster):
    """A job id over a frame's size was sent as it was: the gateway's ZeroMQ dropped the connection, so the call
    timed out after every retry (TimeoutError, blaming a gateway that was up) and each stream sharing the async
    client's connection went silent until it resubscribed. A job id that is not a string got a protocol error."""
    bad_ids = [HUGE, 12345, None]

    async def main():
        async with AsyncGatewayClient(cluster["gateway"], key(cluster), timeout_s=3, retries=1) as client:
            refusals = []
            async with stream_beside(client, 400, state_pids(cluster)["wk-0"]) as beside:
                for job_id in bad_ids:
                    for call in (client.status, client.cancel, client.job):
                        started = time.monotonic()
                        with pytest.raises(InvalidRequest) as e:
                            await call(job_id)
                        refusals.append((e.value.field, time.monotonic() - started))
                    started = time.monotonic()
                    with pytest.raises(InvalidRequest) as e:
                        async for _ in AsyncJob(client, job_id, "P3", 0.0).stream():
                            pass
                    refusals.append((e.value.field, time.monotonic() - started))
            return refusals, beside.streamed, beside.result

    with SdkWarnings() as warned:
        refusals, streamed, result = asyncio.run(main())
    assert {field for field, _ in refusals} == {"job_id"}
    assert all(took < 1 for _, took in refusals), refusals
    assert streamed == result and len(result) == 400
    assert not warned.messages, warned.messages  # no stream lost its gateway

    client = GatewayClient(cluster["gateway"], key(cluster), timeout_s=3, retries=1)
    try:
        for job_id in bad_ids:
            for call in (client.status, client.cancel, client.job, lambda j: list(Job(client, j, "P3", 0.0).stream())):
                started = time.monotonic()
                with pytest.raises(InvalidRequest) as e:
                    call(job_id)
                assert e.value.field == "job_id" and time.monotonic() - started < 1
        assert client.status(client.submit(prompt_token_ids=[1, 2], max_tokens=2).id).state
    finally:
        client.close()



def test_a_nan_timeout_is_refused_not_taken_for_no_timeout(cluster):
    """result(timeout=nan) and stream(timeout=nan) (a caller's remaining budget computed as inf - inf, say) waited
    for as long as the job took: NaN compares false with every clock reading, so the deadline never came. The
    client's own timeout_s refuses NaN; these now do too."""
    worker = cluster["workers"][0]["pid"]
    client = GatewayClient(cluster["gateway"], key(cluster), timeout_s=5)
    outcome: list = []
    os.kill(worker, signal.SIGSTOP)  # the job waits: only a deadline can end these calls early
    try:
        job = client.submit(prompt_token_ids=[3, 4, 5], max_tokens=3, ignore_eos=True)
        for call in (lambda: job.result(timeout=math.nan), lambda: next(job.stream(timeout=math.nan)),
                     lambda: job.result(timeout="1"), lambda: job.result(timeout=True)):
            started = time.monotonic()
            waiter = threading.Thread(target=lambda c: outcome.append(_raised(c)), args=(call,), daemon=True)
            waiter.start()
            waiter.join(8)
            assert not waiter.is_alive(), "a NaN timeout waited as if there were none"
            assert outcome[-1] == (InvalidRequest, "timeout") and time.monotonic() - started < 1, outcome

        async def both():
            async with AsyncGatewayClient(cluster["gateway"], key(cluster), timeout_s=5) as ac:
                j = await ac.job(job.id)
                for call in (lambda: j.result(timeout=math.nan), lambda: anext(j.stream(timeout=math.nan))):
                    with pytest.raises(InvalidRequest) as e:
                        await asyncio.wait_for(call(), 8)
                    assert e.value.field == "timeout"

        asyncio.run(both())
    finally:
        os.kill(worker, signal.SIGCONT)
        client.close()
    assert job.result(timeout=60).token_ids


def _raised(call) -> tuple:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test compares it
        return type(e), getattr(e, "field", None)
    return None, None


def test_closing_an_async_client_ends_the_calls_and_streams_waiting_on_it(cluster):
    """close() closed the sockets under the waiting calls and streams, which then heard nothing until timeout_s
    passed, took their gateway for dead (a failover warning; the client moved on to its next gateway for every
    later call) and opened a new connection there, behind the back of the caller that had closed the client. They
    now end at once with a ServingError that says so."""
    worker = cluster["workers"][0]["pid"]
    endpoints = [cluster["gateway"], cluster["gateway"]]  # the second, if failed over to, shows as a new connection

    async def main():
        client = AsyncGatewayClient(endpoints, key(cluster), timeout_s=3)
        job = await client.submit(prompt_token_ids=[3, 4, 5], max_tokens=3, ignore_eos=True)
        waiting = [asyncio.create_task(job.result()), asyncio.create_task(anext(job.stream()))]
        await asyncio.sleep(0.5)
        started = time.monotonic()
        client.close()
        done, _ = await asyncio.wait(waiting, timeout=8)
        outcomes = [type(t.exception()) if t in done else None for t in waiting]
        took, conns = time.monotonic() - started, len(client._conns)
        client.close()
        return job.id, outcomes, took, conns, client._current

    with frozen(worker):  # the job waits
        with SdkWarnings() as warned:
            job_id, outcomes, took, conns, current = asyncio.run(main())
    assert outcomes == [ServingError, ServingError] and took < 1, (outcomes, took)
    assert conns == 0 and current == 0 and not warned.messages, (conns, current, warned.messages)
    with GatewayClient(cluster["gateway"], key(cluster), timeout_s=5) as client:
        assert client.job(job_id).result(timeout=60).token_ids  # closing the client left the job alone


def test_numpy_numbers_are_taken_as_the_plain_numbers_they_are(cluster):
    """max_tokens=np.int64(8) (a length read from an array, a seed drawn with numpy) was refused as 'max_tokens has
    the wrong type: int64', as were numpy seeds, top_k, from_index, retries and a float32 temperature; the SDK
    now sends each as the plain number it is. Bools and floats for an int field are still refused."""
    import numpy as np

    plain = dict(prompt_token_ids=[5, 6, 7], max_tokens=8, ignore_eos=True, seed=11, top_k=5, temperature=0.5)
    numpyish = dict(prompt_token_ids=np.array([5, 6, 7]), max_tokens=np.int64(8), ignore_eos=True,
                    seed=np.uint32(11), top_k=np.int16(5), temperature=np.float32(0.5))
    with GatewayClient(cluster["gateway"], key(cluster), timeout_s=np.int64(10), retries=np.int8(1)) as client:
        want = client.submit(**plain).result(timeout=60).token_ids
        job = client.submit(**numpyish)
        assert job.result(timeout=60).token_ids == want
        assert [c.index for c in job.stream(from_index=np.int64(6))] == [6]
        for name, bad in (("max_tokens", np.float64(8.0)), ("max_tokens", np.bool_(True)), ("seed", True)):
            with pytest.raises(InvalidRequest) as e:
                client.submit(**plain | {name: bad})
            assert e.value.field == name

    async def main():
        async with AsyncGatewayClient(cluster["gateway"], key(cluster), timeout_s=np.float32(10)) as ac:
            job = await ac.submit(**numpyish)
            return (await job.result(timeout=60)).token_ids

    assert asyncio.run(main()) == want


def test_closing_a_blocking_client_ends_a_stream_waiting_in_another_thread_with_a_serving_error(cluster):
    """close() from one thread closed the socket under a stream another thread was reading: that stream raised
    zmq's own ZMQError ('Socket operation on non-socket'), not one of the SDK's errors; the async client has ended
    such streams with ServingError since 3a2076a. The job itself is left alone."""
    worker = cluster["workers"][0]["pid"]
    client = GatewayClient(cluster["gateway"], key(cluster), timeout_s=5)
    with frozen(worker):  # the job waits: the stream is in its poll when the client closes
        job = client.submit(prompt_token_ids=[3, 4, 5], max_tokens=3, ignore_eos=True)
        outcome, took = close_under_waiters(client, (job.result, lambda: list(job.stream())), settle_s=1.0,
                                            join_s=8)
    assert outcome == [ServingError, ServingError] and took < 2, (outcome, took)
    with GatewayClient(cluster["gateway"], key(cluster), timeout_s=5) as again:
        assert again.job(job.id).result(timeout=60).token_ids


def test_a_client_used_in_a_forked_child_answers_there(cluster):
    """A client made (and used) before os.fork() (a preforking server, multiprocessing's fork) kept its ZeroMQ
    context and sockets in the child, where libzmq's threads no longer run: the child's first call blocked in its
    poll for ever, its timeout_s notwithstanding. Both clients now start afresh in a child."""
    client = GatewayClient(cluster["gateway"], key(cluster), timeout_s=5)
    aclient = AsyncGatewayClient(cluster["gateway"], key(cluster), timeout_s=5)
    job = client.submit(prompt_token_ids=[3, 4, 5], max_tokens=3, ignore_eos=True)
    want = job.result(timeout=60).token_ids

    async def status():
        return (await aclient.status(job.id)).state

    assert asyncio.run(status()) == "done"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's cleanup
        try:
            got = [client.status(job.id).state, client.job(job.id).result(timeout=10).token_ids == want,
                   asyncio.run(status())]
            os.write(write, repr(got).encode())
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 30
    while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    if time.monotonic() >= deadline:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        reported = f.read()
    assert reported == repr(["done", True, "done"]), f"the child reported {reported!r} (nothing: it hung)"
    assert client.status(job.id).state == "done"  # the parent's own connections still serve it
    client.close()
    aclient.close()


@pytest.mark.parametrize("field,ids,words", [
    ("prompt_token_ids", [5, 6.0], ["item 1", "float", "6.0"]),
    ("prompt_token_ids", [True, 5], ["item 0", "bool"]),
    ("prompt_token_ids", ["5"], ["item 0", "str", "'5'"]),
    ("prompt_token_ids", (5, None), ["item 1", "NoneType"]),
    ("stop_token_ids", [2.5], ["item 0", "float"]),
])
def test_a_token_id_of_the_wrong_type_is_named_with_its_place(field, ids, words):
    """[5, 6.0] was refused as 'prompt_token_ids has the wrong type: list': the list was fine, an item was not, and
    nothing said which. Refused before anything is sent (no gateway listens here)."""
    with GatewayClient("tcp://127.0.0.1:9", "a-key", timeout_s=1) as client:
        with pytest.raises(InvalidRequest) as e:
            client.submit(prompt_token_ids=ids if field == "prompt_token_ids" else [5], max_tokens=2,
                          **({field: ids} if field != "prompt_token_ids" else {}))
    assert e.value.field == field and all(w in str(e.value) for w in words), e.value
