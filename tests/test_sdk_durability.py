"""The SDK against real processes (issue 9, item 9): request ids, keepalives, long waits, retries, re-attach,
failover and one multiplexed asyncio connection.

Every test runs real redis-server, gateway and worker processes (scripts/up.py via tests/cluster_helpers.py).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import msgpack
import pytest
import zmq

from common import protocol as P
from gateway.sdk import AsyncGatewayClient, GatewayClient, Job, NotFound
from tests.cluster_helpers import ROOT, job_hash, job_ids, local_cluster, stop_process, wait_for

KEEPALIVE_ENV = {"TS_GATEWAY_KEEPALIVE_INTERVAL_S": "0.3"}


def start_worker(state: dict, model_dir: Path, worker_id: str, log: Path) -> subprocess.Popen:
    """One more real worker, connected to every gateway of the cluster."""
    cmd = [sys.executable, "-m", "worker", "--worker-id", worker_id, "--model", str(model_dir), "--max-num-seqs", "2"]
    for g in state["gateways"]:
        cmd += ["--gateway", g["worker_endpoint"]]
    # A worker started after up.py uses the key up.py generated for wk-0: without it the gateway refuses its hello.
    keys = state["keys"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT), TS_WORKER_TORCH_THREADS="1",
                                     TS_WORKER_DRAIN_TIMEOUT_S="0",
                                     TS_WORKER_CURVE_SECRET_KEY_FILE=keys["worker_secrets"]["wk-0"],
                                     TS_WORKER_GATEWAY_PUBLIC_KEY=keys["gateway_public"]))


class RawClient:
    """A bare DEALER socket speaking the protocol, to see exactly which frames the gateway sends."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, msg) -> None:
        self.sock.send(P.encode(msg))

    def recv(self, timeout_s: float = 30.0):
        assert self.sock.poll(int(timeout_s * 1000)), f"no frame within {timeout_s}s"
        return P.decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def idle_cluster(tiny_model_dir, tmp_path_factory):
    """A gateway with no worker yet: every job stays queued until a test starts one."""
    with local_cluster(tmp_path_factory.mktemp("idle"), tiny_model_dir, workers=0, env=KEEPALIVE_ENV,
                       http=False) as state:
        yield state


def test_every_reply_frame_echoes_its_request_id_and_a_queued_stream_gets_keepalives(idle_cluster, tiny_model_dir,
                                                                                      tmp_path):
    c = idle_cluster
    key = c["tenants"]["lab-co"]["api_key"]
    raw = RawClient(c["gateway"])
    try:
        raw.send(P.InfoRequest(key, request_id="info-1"))
        assert isinstance(info := raw.recv(), P.InfoReply) and info.request_id == "info-1"
        raw.send(P.InfoRequest("not-a-key", request_id="bad-key"))
        err = raw.recv()
        assert isinstance(err, P.ErrorReply) and err.code == "unauthorized" and err.request_id == "bad-key"
        raw.send(P.InfoRequest(key, request_id="x" * (P.MAX_REQUEST_ID_LEN + 1)))
        err = raw.recv()
        assert isinstance(err, P.ErrorReply) and err.code == "protocol" and err.field == "request_id"

        raw.send(P.SubmitRequest(key, max_tokens=5, prompt_token_ids=[3, 4, 5], ignore_eos=True, request_id="sub"))
        sub = raw.recv()
        assert isinstance(sub, P.SubmitReply) and sub.request_id == "sub"
        raw.send(P.StatusRequest(key, sub.job_id, request_id="st"))
        assert (st := raw.recv()).request_id == "st" and st.state == "queued"
        # Two streams of the same job on one connection, told apart by their request ids.
        raw.send(P.StreamRequest(key, sub.job_id, 0, request_id="s-a"))
        raw.send(P.StreamRequest(key, sub.job_id, 2, request_id="s-b"))
        # Queued, with no worker: nothing but keepalives, several for each stream, each naming its stream.
        seen = {"s-a": 0, "s-b": 0}
        while min(seen.values()) < 3:
            ka = raw.recv()
            assert isinstance(ka, P.StatusReply) and ka.job_id == sub.job_id and ka.state == "queued"
            seen[ka.request_id] += 1
        worker = start_worker(c, tiny_model_dir, "wk-echo", tmp_path / "worker.log")
        try:
            frames: dict[str, list] = {"s-a": [], "s-b": []}
            # Keepalives keep arriving while the job waits, so the wait needs its own deadline.
            deadline = time.monotonic() + 120
            while not all(f and isinstance(f[-1], P.JobDone) for f in frames.values()):
                assert time.monotonic() < deadline, f"the job did not finish: {frames}"
                m = raw.recv(timeout_s=120)
                frames[m.request_id].append(m)
            for rid, start in (("s-a", 0), ("s-b", 2)):
                tokens = [m for m in frames[rid] if isinstance(m, P.TokenChunk)]
                done = frames[rid][-1]
                assert done.state == "done" and len(done.token_ids) == 5
                assert [t for m in tokens for t in m.token_ids] == done.token_ids[start:]
            raw.send(P.CancelRequest(key, sub.job_id, request_id="cx"))
            cancel = raw.recv()
            assert isinstance(cancel, P.CancelReply) and cancel.request_id == "cx" and not cancel.cancelled
        finally:
            stop_process(worker, timeout=30)
            wait_for(lambda: not GatewayClient(c["gateway"], key, timeout_s=5).info().workers, 30,
                     "the gateway to drop the stopped worker")
    finally:
        raw.close()


def test_result_without_timeout_waits_for_a_job_queued_longer_than_timeout_s(idle_cluster, tiny_model_dir,
                                                                              tmp_path):
    c = idle_cluster
    client = GatewayClient(c["gateway"], c["tenants"]["lab-co"]["api_key"], timeout_s=2.0)
    job = client.submit(prompt_token_ids=[7, 8, 9], max_tokens=6, ignore_eos=True)
    out: dict = {}

    def wait() -> None:
        try:
            out["result"] = job.result()
        except BaseException as e:  # reported to the test thread
            out["error"] = e

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    # Queued for three times the client's timeout_s: result() must still be waiting, not failed.
    waiter.join(timeout=3 * client.timeout_s)
    assert waiter.is_alive(), f"result() returned early: {out}"
    worker = start_worker(c, tiny_model_dir, "wk-late", tmp_path / "worker.log")
    try:
        waiter.join(timeout=120)
        assert not waiter.is_alive() and "error" not in out, out
        assert len(out["result"].token_ids) == 6
    finally:
        stop_process(worker, timeout=30)
        wait_for(lambda: not client.info().workers, 30, "the gateway to drop the stopped worker")
        client.close()


def test_a_stream_the_client_gave_up_on_is_forgotten_by_its_gateway(idle_cluster):
    """Each wait that gave up (result(timeout=...), a cancelled task) left its subscription at the gateway until the
    job ended: a keepalive and a Redis read for each, every keepalive interval, for as long as the job waited (a P3
    job may wait for ever), and a copy of every token once it ran. Polling a queued job made that grow without
    bound; the client dropped every such frame as answering nobody."""
    c = idle_cluster

    async def main():
        async with AsyncGatewayClient(c["gateway"], c["tenants"]["lab-co"]["api_key"], timeout_s=5) as client:
            job = await client.submit(prompt_token_ids=[4, 5, 6], max_tokens=3, ignore_eos=True)
            try:
                for _ in range(20):
                    with pytest.raises(TimeoutError):
                        await job.result(timeout=0.05)
                waiting = asyncio.create_task(job.result())
                await asyncio.sleep(1.0)  # it gets keepalives meanwhile
                waiting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiting
                conn = next(iter(client._conns.values()))
                await asyncio.sleep(1.0)  # frames already on their way when it gave up
                before = conn.dropped
                await asyncio.sleep(2.0)  # over six keepalive intervals (KEEPALIVE_ENV)
                return conn.dropped - before, (await job.status()).state
            finally:
                await job.cancel()

    unread, state = asyncio.run(main())
    assert state == "queued"
    assert unread == 0, f"{unread} frames sent to streams nobody reads any more"


# -- a cluster of two gateways and one worker -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_gateways(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("two-gw"), tiny_model_dir, workers=1, gateways=2, max_running=4,
                       env=KEEPALIVE_ENV, http=False) as state:
        yield state


@contextmanager
def stopped(pid: int):
    """The process frozen (SIGSTOP): alive to the kernel, silent to its peers, like a hung gateway."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


class Failovers(logging.Handler):
    """Counts the SDK's 'trying the next gateway' warnings."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1

    def __enter__(self) -> Failovers:
        logging.getLogger("gateway.sdk").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("gateway.sdk").removeHandler(self)


def test_a_submit_retried_after_a_timeout_creates_no_duplicate(two_gateways):
    c = two_gateways
    gw0 = c["gateways"][0]["endpoint"]
    client = GatewayClient(gw0, c["tenants"]["lab-co"]["api_key"], timeout_s=1.0, retries=20)
    before = job_ids(c)
    out: dict = {}
    with Failovers() as failovers, stopped(c["pids"]["gw-0"]):
        submitter = threading.Thread(target=lambda: out.update(job=client.submit(prompt_token_ids=[11, 12],
                                                                                  max_tokens=3, ignore_eos=True)),
                                     daemon=True)
        submitter.start()
        # Every attempt so far sits unanswered in the frozen gateway's socket; each will be admitted.
        wait_for(lambda: failovers.count >= 3, 60, "three timed-out attempts")
    submitter.join(timeout=60)
    assert "job" in out, "submit() did not succeed once the gateway answered again"
    # All attempts reached the gateway; one job was admitted, the others found its idempotency key.
    assert job_ids(c) - before == {out["job"].id}
    assert out["job"].duplicate is False  # its own earlier attempt is not someone else's submission
    assert len(out["job"].result(timeout=120).token_ids) == 3
    client.close()


def test_a_fresh_client_re_attaches_to_a_job_by_id(two_gateways):
    c = two_gateways
    key = c["tenants"]["lab-co"]["api_key"]
    first = GatewayClient(c["gateway"], key)
    job = first.submit(prompt_token_ids=[21, 22, 23], max_tokens=40, ignore_eos=True, seed=5)
    queued = first.submit(prompt_token_ids=[24], max_tokens=2000, ignore_eos=True)
    first.close()  # the client "restarts": nothing of it survives but the job ids

    second = GatewayClient(c["gateway"], key)
    again = second.job(job.id)
    assert again.id == job.id and again.tier == "P3"
    chunks = list(again.stream())
    assert [i for ch in chunks for i in range(ch.index, ch.index + len(ch.token_ids))] == list(range(40))
    result = again.result(timeout=60)
    assert result.token_ids == [t for ch in chunks for t in ch.token_ids]
    assert again.status().state == "done"
    assert second.job(queued.id).cancel() is True
    assert second.status(queued.id).state == "cancelled"
    with pytest.raises(NotFound):
        second.job("0" * 32)
    # Another tenant cannot re-attach to it.
    with pytest.raises(NotFound):
        GatewayClient(c["gateway"], c["tenants"]["batch-co"]["api_key"]).job(job.id)
    second.close()


def test_the_client_fails_over_to_the_second_gateway(two_gateways):
    c = two_gateways
    ep0, ep1 = (g["endpoint"] for g in c["gateways"])
    key = c["tenants"]["lab-co"]["api_key"]
    client = GatewayClient([ep0, ep1], key, timeout_s=2.0)
    before = client.submit(prompt_token_ids=[31, 32], max_tokens=4, ignore_eos=True)
    assert len(before.result(timeout=60).token_ids) == 4 and client.endpoint == ep0
    with stopped(c["pids"]["gw-0"]):
        job = client.submit(prompt_token_ids=[33, 34], max_tokens=6, ignore_eos=True)
        assert client.endpoint == ep1
        assert len(job.result(timeout=60).token_ids) == 6
        assert client.status(before.id).state == "done"  # admitted by gw-0, read through gw-1
        assert len(client.job(before.id).result(timeout=60).token_ids) == 4
        # One endpoint only, and it is dead: result() without a timeout still ends, once keepalives stop.
        lone = GatewayClient(ep0, key, timeout_s=1.0, retries=1)
        with pytest.raises(TimeoutError):
            Job(lone, job.id, "P3", 0.0).result()
        lone.close()
    client.close()


def test_one_async_client_serves_200_concurrent_submits_and_results(two_gateways):
    c = two_gateways
    n = 200
    prompts = [[(7 * i) % 400 + 1, (11 * i) % 400 + 1, i % 50 + 1] for i in range(n)]
    lengths = [1 + i % 7 for i in range(n)]

    async def one(client: AsyncGatewayClient, i: int):
        job = await client.submit(prompt_token_ids=prompts[i], max_tokens=lengths[i], ignore_eos=True, seed=i)
        if i % 2:  # half stream, half only wait: both kinds multiplexed on the one connection
            streamed = [t async for ch in job.stream() for t in ch.token_ids]
            result = await job.result()
            assert streamed == result.token_ids
        else:
            result = await job.result()
        return job.id, result

    async def main():
        async with AsyncGatewayClient(c["gateway"], c["tenants"]["lab-co"]["api_key"], timeout_s=30) as client:
            out = await asyncio.gather(*(one(client, i) for i in range(n)))
            return out, len(client._conns)

    out, connections = asyncio.run(main())
    assert connections == 1
    assert len({job_id for job_id, _ in out}) == n
    r = c["redis_client"]
    for i, (job_id, result) in enumerate(out):
        assert len(result.token_ids) == lengths[i], (i, job_id)
        # The job this coroutine got is the one it submitted.
        h = job_hash(c, job_id)
        assert int(h["num_tokens"]) == lengths[i]
        assert msgpack.unpackb(r.hget(f"{c['key_prefix']}:{{c}}:job:{job_id}", "token_ids")) == result.token_ids


def test_one_sync_client_shared_by_16_threads(two_gateways):
    """A web server's threads share one client, as they share one openai.OpenAI: every call and stream gets its own
    answer (each thread has its own connection; a ZeroMQ socket must not be used from two threads), and a call
    never steals another thread's reply, which left the threads timing out one another."""
    c = two_gateways
    n_threads, per_thread = 16, 4
    client = GatewayClient(c["gateway"], c["tenants"]["lab-co"]["api_key"], timeout_s=30, retries=0)
    out: dict[tuple[int, int], tuple[str, list[int], list[int]]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(n_threads)

    def work(t: int) -> None:
        try:
            start.wait()
            for k in range(per_thread):
                i = t * per_thread + k
                job = client.submit(prompt_token_ids=[t + 1, k + 1, 3], max_tokens=1 + i % 5, ignore_eos=True, seed=i)
                streamed = [tok for ch in job.stream() for tok in ch.token_ids] if k % 2 else None
                assert client.status(job.id).job_id == job.id
                out[(t, k)] = (job.id, job.result(timeout=120).token_ids, streamed)
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(180)
    gc.collect()
    assert not client._open, "a thread that ended left its connections open"
    client.close()
    assert not errors, errors[:3]
    assert len(out) == n_threads * per_thread and len({job_id for job_id, _, _ in out.values()}) == len(out)
    for (t, k), (job_id, tokens, streamed) in out.items():
        i = t * per_thread + k
        assert len(tokens) == 1 + i % 5 and (streamed is None or streamed == tokens), (t, k)
        assert int(job_hash(c, job_id)["num_tokens"]) == len(tokens)


def test_an_async_client_outlives_its_event_loop(two_gateways):
    """asyncio.run() twice with one client (a script's steps, a notebook, a framework running a loop per call):
    the second loop got a TimeoutError blaming a gateway that had answered, its reader task having died with the
    first loop. Connections now follow the running loop; a client used by two running loops at once is refused
    with a clear error instead."""
    c = two_gateways
    client = AsyncGatewayClient(c["gateway"], c["tenants"]["lab-co"]["api_key"], timeout_s=5, retries=0)

    async def one(seed: int) -> list[int]:
        job = await client.submit(prompt_token_ids=[3, 4, 5], max_tokens=3, ignore_eos=True, seed=seed)
        streamed = [t async for ch in job.stream() for t in ch.token_ids]
        assert (await job.result()).token_ids == streamed
        return streamed

    first = asyncio.run(one(1))
    assert asyncio.run(one(1)) == first and len(first) == 3
    assert len(asyncio.run(one(2))) == 3

    # Two loops at once: the one that did not make the connections is told so, not timed out.
    holding, release = threading.Event(), threading.Event()

    async def hold() -> None:
        await client.info()
        holding.set()
        while not release.is_set():
            await asyncio.sleep(0.01)

    other = threading.Thread(target=lambda: asyncio.run(hold()))
    other.start()
    try:
        assert holding.wait(30)
        with pytest.raises(RuntimeError, match="another event loop"):
            asyncio.run(client.info())
    finally:
        release.set()
        other.join(30)
    assert asyncio.run(client.info()).gateway_id  # that loop has ended: this one takes the client over
    client.close()


def unroutable(metrics_url: str) -> float:
    """The gateway's count of replies to clients no longer connected (ts_gateway_events{event="unroutable"})."""
    import httpx

    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith('ts_gateway_events_total{event="unroutable"}'):
            return float(line.split()[-1])
    return 0.0


def test_a_stream_whose_blocking_client_closed_its_socket_is_dropped_by_the_gateway(two_gateways):
    """The blocking client reads each stream on a socket of its own and closes it when the caller stops reading.
    The gateway kept the subscription until the job ended and sent every token batch into the void (each send
    refused as unroutable); a connection that is gone can never read again, so the first refusal now ends it."""
    c = two_gateways
    key = c["tenants"]["lab-co"]["api_key"]
    metrics_url = c["metrics"][0]  # gw-0's: gateways are started first
    client = GatewayClient(c["gateways"][0]["endpoint"], key, timeout_s=10.0)
    try:
        job = client.submit(prompt_token_ids=[31, 32], max_tokens=1500, ignore_eos=True, seed=9)
        chunks = job.stream(timeout=60)
        next(chunks)  # running, and streaming through gw-0
        before = unroutable(metrics_url)
        chunks.close()  # the caller stops reading: its socket closes
        assert len(job.result(timeout=120).token_ids) == 1500
        sent_into_the_void = unroutable(metrics_url) - before
        assert sent_into_the_void <= 2, f"{sent_into_the_void:.0f} frames sent to a stream whose socket is closed"
    finally:
        client.close()
