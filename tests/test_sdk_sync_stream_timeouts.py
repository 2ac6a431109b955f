"""The blocking client's Job.stream(timeout=T) read by a heartbeat loop: ``next(it)``, a keep-alive sent at each
TimeoutError, then the same iterator read on. The stream was a generator, which the first exception out of a wait
ended for good: the loop's next ``next(it)`` got StopIteration, and the stream ended quietly, short of its tokens,
against the SDK's promise that a stream never does. Its close() must still tell the gateway at once.

Real redis-server, gateway and worker processes (scripts/up.py via tests/cluster_helpers.py); the worker is frozen
(SIGSTOP) in bursts, so that waits between chunks outlast the stream's own limit.
"""

from __future__ import annotations

import threading
import time

import pytest

from gateway.sdk import GatewayClient, JobCancelled
from tests.cluster_helpers import frozen, local_cluster

KEEPALIVE_ENV = {"TS_GATEWAY_KEEPALIVE_INTERVAL_S": "0.3"}
N = 200
READERS = 3
CHUNK_TIMEOUT_S = 0.15


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("sdk-sync-timeouts"), tiny_model_dir, workers=1, max_running=4,
                       env=KEEPALIVE_ENV, http=False) as state:
        yield state


def unroutable(metrics_url: str) -> float:
    """The gateway's count of frames to clients no longer connected (as tests/test_sdk_durability.py reads it)."""
    import httpx

    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith('ts_gateway_events_total{event="unroutable"}'):
            return float(line.split()[-1])
    return 0.0


def heartbeat(it, within_s: float = 60.0) -> tuple[list[int], int, int]:
    """Read ``it`` to its end as a heartbeat loop does, catching each TimeoutError and reading on. (tokens, timeouts,
    timeouts after the first token)."""
    got: list[int] = []
    timeouts = mid = 0
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            chunk = next(it)
        except TimeoutError:
            timeouts, mid = timeouts + 1, mid + bool(got)
            continue
        except StopIteration:
            return got, timeouts, mid
        assert chunk.index == len(got), f"chunk at {chunk.index} after {len(got)} tokens"
        got.extend(chunk.token_ids)
    raise AssertionError(f"the stream did not end within {within_s}s ({len(got)} tokens)")


def stutter(pid: int, bursts: int, run_s: float, still_s: float) -> None:
    """The worker runs ``run_s`` then stands still ``still_s``, ``bursts`` times: a worker slowed to a crawl."""
    for _ in range(bursts):
        with frozen(pid):
            time.sleep(still_s)
        time.sleep(run_s)


def test_a_heartbeat_loop_reads_every_token_once_through_its_timeouts(cluster):
    """Threads sharing one client, each reading its own job's stream(timeout=T) through waits that time out (before
    the first token and between tokens): each gets every token once, in order, as result() has them."""
    c = cluster
    pid = c["workers"][0]["pid"]
    with GatewayClient(c["gateway"], c["tenants"]["api-co"]["api_key"], timeout_s=5) as client:
        with frozen(pid):  # none can start before its stream's first wait has timed out
            jobs = [client.submit(prompt_token_ids=[6, 5, 4 + k], max_tokens=N, ignore_eos=True, seed=k)
                    for k in range(READERS)]
            out: dict[int, tuple[list[int], int, int] | BaseException] = {}

            def read(k: int) -> None:
                try:
                    out[k] = heartbeat(jobs[k].stream(timeout=CHUNK_TIMEOUT_S))
                except BaseException as e:  # noqa: BLE001 - checked in the test's thread
                    out[k] = e

            readers = [threading.Thread(target=read, args=(k,)) for k in range(READERS)]
            for t in readers:
                t.start()
            time.sleep(3 * CHUNK_TIMEOUT_S)
        started = time.monotonic()
        stutter(pid, bursts=12, run_s=0.02, still_s=0.4)
        for t in readers:
            t.join(60)
        assert not any(t.is_alive() for t in readers), "a stream never ended"
        expected = [job.result(timeout=30).token_ids for job in jobs]
        took = time.monotonic() - started
    for k in range(READERS):
        assert not isinstance(out[k], BaseException), out[k]
        got, timeouts, mid = out[k]
        assert len(expected[k]) == N and got == expected[k], f"reader {k}: {len(got)} of {N} tokens after " \
                                                            f"{timeouts} timeouts"
        assert timeouts >= 2, f"reader {k}: only {timeouts} waits timed out"
    mids = [out[k][2] for k in range(READERS)]
    print(f"timeouts {[out[k][1] for k in range(READERS)]}, mid-stream {mids}, {took:.1f}s")
    assert sum(mids) >= 2, f"only {sum(mids)} waits timed out between tokens: the worker ran too fast"


def test_a_stream_read_on_after_a_timeout_is_closed_at_once(cluster):
    """close() on an iterator that subscribed again after a timeout closes that subscription's socket at once (the
    gateway drops the subscription at its first refused frame, rather than send it every token batch of the job);
    the iterator is then ended, as a closed generator was."""
    c = cluster
    pid = c["workers"][0]["pid"]
    metrics_url = c["metrics"][0]  # the gateway's: started first
    with GatewayClient(c["gateway"], c["tenants"]["api-co"]["api_key"], timeout_s=5) as client:
        with frozen(pid):
            job = client.submit(prompt_token_ids=[31, 32], max_tokens=1500, ignore_eos=True, seed=9)
            chunks = job.stream(timeout=CHUNK_TIMEOUT_S)
            for _ in range(2):
                with pytest.raises(TimeoutError):
                    next(chunks)
        first = next(chunks)
        assert first.index == 0
        time.sleep(0.5)  # the subscriptions of the timed-out waits have had their frames refused
        before = unroutable(metrics_url)
        chunks.close()
        with pytest.raises(StopIteration):
            next(chunks)
        assert len(job.result(timeout=120).token_ids) == 1500
        sent_into_the_void = unroutable(metrics_url) - before
        assert sent_into_the_void <= 2, f"{sent_into_the_void:.0f} frames sent to a stream closed"

        # Closed between subscriptions (its last wait timed out), and iterated with for: nothing left to close.
        with frozen(pid):
            idle = client.submit(prompt_token_ids=[33, 34], max_tokens=4, ignore_eos=True, seed=9)
            chunks = idle.stream(timeout=CHUNK_TIMEOUT_S)
            with pytest.raises(TimeoutError):
                next(chunks)
            chunks.close()
            assert list(chunks) == []
        assert [t for ch in idle.stream(timeout=30) for t in ch.token_ids] == idle.result(timeout=30).token_ids

        # A job that ends cancelled while its stream is between subscriptions: the next call raises that, once.
        with frozen(pid):
            doomed = client.submit(prompt_token_ids=[35, 36], max_tokens=4, ignore_eos=True, seed=9)
            chunks = doomed.stream(timeout=CHUNK_TIMEOUT_S)
            with pytest.raises(TimeoutError):
                next(chunks)
            assert doomed.cancel()
            with pytest.raises(JobCancelled):
                next(chunks)
            with pytest.raises(StopIteration):
                next(chunks)
