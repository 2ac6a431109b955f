"""The worker frames a gateway keeps aside while Redis is unreachable (gateway/outage.py): one copy of each, each
worker's latest load report, within a count and a size; beyond, frames wait in the socket and come after the kept
ones. The pure container first, then a gateway built as `python -m gateway` builds it, on a real redis-server."""

from __future__ import annotations

import os
import random
import signal
import time
import tracemalloc

import msgpack
import pytest
import redis
import zmq

from common import protocol as P
from common.sockets import make_socket
from common.tiers import Tier
from gateway.outage import Kept, KeptFrames
from tests.cluster_helpers import wait_for
from tests.gateway_helpers import built_gateway


def _load(worker: str, free: int) -> P.WorkerLoad:
    return P.WorkerLoad(worker, free, 1024, {}, {}, [], 0.0)


def _finished(job: str, attempt: int = 1) -> P.JobFinished:
    return P.JobFinished(job, attempt, "done", "length", 1, 0.0, 0.0, 0, token_ids=[1])


def _keep(kept: KeptFrames, ident: bytes, msg, key: str | None = None) -> bool:
    """``msg`` kept as the gateway keeps a frame it read: its wire bytes, with its decoded message for its key."""
    return kept.keep(Kept(ident, P.encode(msg), key), msg)


def _size(msg) -> int:
    return len(P.encode(msg))


def test_each_frame_is_kept_once_and_a_workers_latest_report_alone():
    kept = KeptFrames()
    assert _keep(kept, b"wk-a", _finished("j1"), "key-a")
    assert not _keep(kept, b"wk-a", _finished("j1"), "key-a")  # a copy sent again
    assert _keep(kept, b"wk-a", _finished("j1", attempt=2), "key-a")
    assert _keep(kept, b"wk-a", _load("wk-a", 0), "key-a")
    assert _keep(kept, b"wk-b", P.JobTokens("j2", 1, 0, [4, 5]), "key-b")
    assert not _keep(kept, b"wk-a", _load("wk-a", 1), "key-a")  # replaces the older report, at the end
    assert (len(kept), kept.bytes) == (4, _size(_finished("j1")) + _size(_finished("j1", attempt=2))
                                       + _size(P.JobTokens("j2", 1, 0, [4, 5])) + _size(_load("wk-a", 1)))
    out = [kept.take() for _ in range(4)]
    assert [(f.ident, f.decoded(), f.key) for f in out] == [
        (b"wk-a", _finished("j1"), "key-a"), (b"wk-a", _finished("j1", attempt=2), "key-a"),
        (b"wk-b", P.JobTokens("j2", 1, 0, [4, 5]), "key-b"), (b"wk-a", _load("wk-a", 1), "key-a")]
    assert (kept.take(), len(kept), kept.bytes) == (None, 0, 0)


def test_a_frame_is_held_as_it_was_read_not_encoded_again():
    """The bytes read are the bytes replayed (and counted): a frame kept was encoded again to be held, and again
    when put back, though the frame as read was at hand."""
    kept = KeptFrames()
    msg = _finished("j1")
    frame = P.encode(msg)
    kept.keep(Kept(b"wk-a", frame, "key-a"), msg)
    assert kept.bytes == len(frame)
    taken = kept.take()
    assert taken.frame is frame and taken.decoded() == msg
    kept.put_back(taken, msg)
    assert kept.take().frame is frame


def test_a_newer_hello_keeps_its_predecessors_place_ahead_of_the_frames_it_registers():
    kept = KeptFrames()
    first, second = (P.WorkerHello("wk-a", "m", 512, 2048, slots, 1024) for slots in (1, 2))
    _keep(kept, b"wk-a", first)
    _keep(kept, b"wk-a", _finished("j1"))
    _keep(kept, b"wk-a", second)
    assert [kept.take().decoded() for _ in range(2)] == [second, _finished("j1")]


def test_the_bound_counts_frames_and_bytes():
    by_count, by_bytes = KeptFrames(max_frames=2), KeptFrames(max_bytes=100)
    by_count.keep(Kept(b"w", b"x", None), _finished("a"))
    assert not by_count.full()
    by_count.keep(Kept(b"w", b"x", None), _finished("b"))
    assert by_count.full()
    by_bytes.keep(Kept(b"w", b"x" * 99, None), _finished("a"))
    assert not by_bytes.full()
    by_bytes.keep(Kept(b"w", b"x", None), _finished("b"))
    assert by_bytes.full()
    by_bytes.take()
    assert not by_bytes.full()


def test_token_frames_have_a_share_of_the_bound_and_the_rest_is_room_for_the_others():
    kept = KeptFrames(max_frames=8)  # tokens: 2 frames
    assert (kept.max_token_frames, kept.max_token_bytes) == (2, KeptFrames().max_bytes // 4)
    tokens = [P.JobTokens("j", 1, i, [i]) for i in range(3)]
    for t in tokens[:2]:
        assert kept.can_keep(b"w", t) and _keep(kept, b"w", t)
    assert not kept.can_keep(b"w", tokens[2])  # past the share
    assert kept.can_keep(b"w", tokens[0])  # a copy of one kept: found kept, not dropped
    assert not kept.can_keep(b"w2", tokens[0])  # another worker's frame is not that copy
    for i in range(6):  # the rest of the bound, for completions (and reports, hellos, hand-backs)
        assert kept.can_keep(b"w", _finished(f"c{i}")) and _keep(kept, b"w", _finished(f"c{i}"))
    assert kept.full() and (kept.token_frames, kept.token_bytes) == (2, 2 * _size(tokens[0]))
    first = kept.take()
    assert first.decoded() == tokens[0] and kept.can_keep(b"w", tokens[2])
    kept.put_back(first, tokens[0])
    assert not kept.can_keep(b"w", tokens[2])
    while kept.take() is not None:
        pass
    assert (len(kept), kept.bytes, kept.token_frames, kept.token_bytes) == (0, 0, 0, 0)


def test_the_token_share_counts_bytes_too():
    kept = KeptFrames(max_bytes=400)  # tokens: 100 bytes
    big = P.JobTokens("j", 1, 0, list(range(1000, 1040)))
    assert _size(big) >= 100 and kept.can_keep(b"w", big)
    _keep(kept, b"w", big)
    assert not kept.can_keep(b"w", P.JobTokens("j", 1, 40, [1]))
    assert kept.can_keep(b"w", _finished("a"))


@pytest.mark.parametrize("frames, size", [(0, 1), (1, 0), (-1, 5)])
def test_a_bound_below_one_is_refused(frames, size):
    with pytest.raises(ValueError, match="must be >= 1"):
        KeptFrames(max_frames=frames, max_bytes=size)


def welcomed_worker(gw) -> zmq.Socket:
    """A worker socket (wk-a) that said hello to ``gw`` and was welcomed: registered, so its frames count."""
    worker = make_socket(zmq.Context.instance(), zmq.DEALER, identity=b"wk-a")
    worker.connect(gw.worker_sock.getsockopt_string(zmq.LAST_ENDPOINT))
    worker.send(P.encode(P.WorkerHello("wk-a", "m", 512, 2048, 1, 1024)))
    wait_for(lambda: (gw._drain(gw.worker_sock, gw._worker_handlers), "wk-a" in gw.workers.workers)[1], 10,
             "the worker's hello")
    assert isinstance(P.decode(worker.recv()), P.GatewayWelcome)
    return worker


def test_past_the_bound_frames_wait_in_the_socket_and_come_after_the_kept_ones(tmp_path):
    with built_gateway(tmp_path, "kept") as (gw, _, _):
        gw.kept = KeptFrames(max_frames=3)
        worker = welcomed_worker(gw)
        try:
            gw._redis_failed(redis.ConnectionError("test: the back-off starts"))
            gw._redis_retry_at = gw.clock() + 600  # it lasts the test, whatever the machine's pace
            jobs = [f"job-{i}" for i in range(5)]
            for job in jobs:
                worker.send(P.encode(_finished(job)))
            wait_for(lambda: (gw._drain(gw.worker_sock, gw._worker_handlers), gw.kept.full())[1], 10,
                     "three completions kept")
            assert worker.poll(0) == 0, "a completion was answered while Redis was down"
            assert gw.worker_sock.poll(1000), "the frames past the bound are not waiting in the socket"
            gw._drain(gw.worker_sock, gw._worker_handlers)
            assert len(gw.kept) == 3  # full: nothing more was read

            gw._redis_retry_at = gw.clock()  # the back-off is over
            gw._clients_answered()  # and no client waits for an answer
            gw.replay_kept()
            assert len(gw.kept) == 0
            deadline = time.monotonic() + 10
            while gw.worker_sock.poll(100) and time.monotonic() < deadline:
                gw._drain(gw.worker_sock, gw._worker_handlers)
            acks = []
            while len(acks) < len(jobs) and worker.poll(5000):
                acks.append(P.decode(worker.recv()))
            # None of the jobs exists: each completion is stale, and confirmed, once, in the order it was sent.
            assert acks == [P.JobFinishedAck(job, 1) for job in jobs]
            assert gw.counters["stale_frames"] == len(jobs)
            assert gw.counters["kept_in_outage"] == 3
        finally:
            worker.close(linger=0)


def test_a_frame_put_back_goes_first():
    kept = KeptFrames()
    _keep(kept, b"w", P.JobTokens("j", 1, 0, [1]))
    _keep(kept, b"w", P.JobTokens("j", 1, 1, [2]))
    first = kept.take()
    kept.put_back(first, first.decoded())
    assert (len(kept), kept.bytes) == (2, _size(P.JobTokens("j", 1, 0, [1])) + _size(P.JobTokens("j", 1, 1, [2])))
    assert [kept.take().decoded().index for _ in range(2)] == [0, 1]


def test_the_bytes_bound_bounds_the_memory_the_kept_frames_hold():
    """The bound counts the frames' encoded size, and that is what they hold: decoded, a completion's token list
    (4096 ids of 3 bytes each on the wire) held 13 times as much, 444 MB under the 32 MiB bound."""
    rng = random.Random(7)
    kept = KeptFrames(max_bytes=4 * 1024 * 1024)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        n = 0
        while not kept.full():
            frame = P.encode(P.JobFinished(f"job-{n}", 1, "done", "length", 4096, 0.0, 0.0, 0,
                                           token_ids=[rng.randrange(1000, 32000) for _ in range(4096)]))
            kept.keep(Kept(b"wk-a", frame, None), P.decode(frame))
            n += 1
        held = tracemalloc.get_traced_memory()[0] - base
        assert held < 1.5 * kept.bytes, f"{n} kept frames of {kept.bytes} bytes hold {held} bytes"
        taken = [kept.take() for _ in range(n)]
        assert [f.decoded().job_id for f in taken] == [f"job-{i}" for i in range(n)]
        assert all(len(f.decoded().token_ids) == 4096 for f in taken)
        assert (kept.take(), len(kept), kept.bytes) == (None, 0, 0)
    finally:
        tracemalloc.stop()


@pytest.mark.faults
def test_a_completion_whose_replay_finds_redis_down_again_is_kept_for_the_next(tmp_path):
    """A completion of a job whose lease this gateway does not know (another gateway dispatched it, or this one
    restarted) is fenced by a read of Redis before anything else. Replayed at the end of a back-off while Redis
    still stood still, that read failed, and the frame was gone: neither put back nor kept as unstored (only a failed
    store keeps one, worker_link._unstored). A worker that had given up resending it (give_up_s, 60 s: an outage
    that long) left the job to wait out its lease and run again."""
    with built_gateway(tmp_path, "kept") as (gw, _, server):
        worker = welcomed_worker(gw)
        try:
            gw.queue.admit(job_id="job-x", tenant="lab-co", tier_requested=Tier.P3, tier=Tier.P3,
                           payload=msgpack.packb({"prompt_token_ids": [5, 6], "max_tokens": 2}),
                           idempotency_key=None, quota=None, drain_rate_per_s={}, estimate_s=0.0)
            # Dispatched by another gateway: its lease is unknown here.
            (rec,) = gw.queue.claim(["job-x"], worker="wk-a", gateway="gw-other", lease_ms=600_000)
            assert "job-x" not in gw.leases

            gw._redis_failed(redis.ConnectionError("test: the back-off starts"))
            gw._redis_retry_at = gw.clock() + 600
            worker.send(P.encode(P.JobFinished("job-x", rec.attempt, "done", "length", 2, 0.0, 0.1, 0,
                                               token_ids=[7, 8])))
            wait_for(lambda: (gw._drain(gw.worker_sock, gw._worker_handlers), len(gw.kept) == 1)[1], 10,
                     "the completion kept")
            os.kill(server.pid, signal.SIGSTOP)
            try:
                gw._redis_retry_at = gw.clock()  # the back-off is over, Redis is not back
                gw._clients_answered()  # and no client waits for an answer
                gw.replay_kept()  # its lease read waits out the socket timeout and starts the back-off again
                assert gw._redis_down()
            finally:
                os.kill(server.pid, signal.SIGCONT)
            assert len(gw.kept) + len(gw._unstored) == 1, "the completion is gone from the gateway"
            assert worker.poll(0) == 0, "a completion was confirmed while Redis was down"

            gw._redis_retry_at = gw.clock()  # Redis is back; the worker sends the completion no more
            gw._clients_answered()
            gw.replay_kept()
            gw.retry_unstored()
            assert worker.poll(10_000), "the completion was never confirmed"
            assert P.decode(worker.recv()) == P.JobFinishedAck("job-x", rec.attempt)
            stored = gw.queue.get("job-x")
            assert stored.state == "done" and msgpack.unpackb(stored.result["token_ids"]) == [7, 8]
            assert (len(gw.kept), gw.kept.bytes, gw._unstored) == (0, 0, [])
        finally:
            worker.close(linger=0)
