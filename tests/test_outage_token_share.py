"""Token frames of leases unknown here, kept during a Redis back-off (gateway/outage.py), have a share of the kept
bound of their own: a flood of them, as a restarted gateway hears (it knows no lease yet), filled the whole bound,
and the frames of the jobs this gateway does hold then waited in the socket behind it: their streams stood still
again and their completions went unkept. Past the share such a token frame is dropped and counted; the next frame of
its job shows the gap, which asks the worker to say hello and send every token so far again (worker_link.on_tokens).
A gateway built as `python -m gateway` builds it, its real redis-server stopped (SIGSTOP) for the back-off, and a
worker on a real ZeroMQ socket that said hello."""

from __future__ import annotations

import os
import signal

import msgpack
import pytest
import redis
import zmq

from common import protocol as P
from common.tiers import Tier
from gateway.outage import KEPT_FRAMES, KEPT_TOKEN_FRAMES
from tests.cluster_helpers import wait_for
from tests.gateway_helpers import built_gateway
from tests.test_outage_kept_frames import welcomed_worker

pytestmark = pytest.mark.faults  # stops Redis: the back-off starts on a read that waits out its 2 s timeout
UNKNOWN = ("job-old-a", "job-old-b")  # dispatched by this gateway's previous process: their leases are unknown here
PER_JOB = KEPT_FRAMES // len(UNKNOWN) + 256  # together past the whole kept bound, not only past their share
HELD_TOKENS = [7, 8, 9]


def _admit(gw, job_id: str) -> None:
    body = {"prompt_token_ids": [5, 6], "max_tokens": 64, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 1}
    gw.queue.admit(job_id=job_id, tenant="lab-co", tier_requested=Tier.P3, tier=Tier.P3,
                   payload=msgpack.packb(body), idempotency_key=None, quota=None, drain_rate_per_s={},
                   estimate_s=0.0)


def _replies(worker: zmq.Socket) -> list:
    out = []
    while worker.poll(500):
        out.append(P.decode(worker.recv()))
    return out


def _drain_until(gw, done, what: str) -> None:
    wait_for(lambda: (gw._drain(gw.worker_sock, gw._worker_handlers), done())[1], 30, what)


def test_a_flood_of_unknown_leases_tokens_leaves_room_for_the_held_jobs_frames(tmp_path):
    with built_gateway(tmp_path, "share") as (gw, _, server):
        worker = welcomed_worker(gw)
        try:
            worker.send(P.encode(P.WorkerLoad("wk-a", 1, 1024, {}, {}, [], 0.0)))
            _drain_until(gw, lambda: gw.workers.workers["wk-a"].load is not None, "the worker's report")
            _admit(gw, "job-held")
            gw.dispatch(gw.clock())
            dispatch = P.decode(worker.recv())
            assert isinstance(dispatch, P.DispatchJob) and dispatch.job_id == "job-held", dispatch
            attempt = dispatch.attempt
            assert gw.leases["job-held"] == ("wk-a", attempt)
            attempts = {}
            for job in UNKNOWN:
                _admit(gw, job)
                (rec,) = gw.queue.claim([job], worker="wk-a", gateway="gw-previous", lease_ms=600_000)
                attempts[job] = rec.attempt
                assert job not in gw.leases
            sent = {job: [1000 + i for i in range(PER_JOB)] for job in UNKNOWN}
            finished = P.JobFinished("job-held", attempt, "done", "length", len(HELD_TOKENS), 0.0, 0.1, 0,
                                     token_ids=HELD_TOKENS)

            os.kill(server.pid, signal.SIGSTOP)
            try:
                with pytest.raises(redis.RedisError) as failed:
                    gw.queue.get("job-held")
                gw._redis_failed(failed.value)
                gw._redis_retry_at = gw.clock() + 600  # it lasts the test, whatever the machine's pace
                for i in range(PER_JOB):
                    for job in UNKNOWN:
                        worker.send(P.encode(P.JobTokens(job, attempts[job], i, [sent[job][i]])))
                worker.send(P.encode(P.JobTokens("job-held", attempt, 0, HELD_TOKENS)))
                worker.send(P.encode(finished))
                worker.send(P.encode(finished))  # sent again, as a worker does until it is confirmed
                # Read during the back-off: the held job's tokens streamed, its completion kept (once).
                _drain_until(gw, lambda: gw.streams.streams["job-held"].tokens == HELD_TOKENS
                             and gw.counters["kept_in_outage"] == KEPT_TOKEN_FRAMES + 1 and not gw.worker_sock.poll(0),
                             "the held job's tokens streamed and its completion kept, past the flood")
                assert gw._redis_down() and gw.counters["redis_errors"] == 1  # nothing read Redis meanwhile
            finally:
                os.kill(server.pid, signal.SIGCONT)
            flood = PER_JOB * len(UNKNOWN)
            assert gw.counters["tokens_dropped_in_outage"] == flood - KEPT_TOKEN_FRAMES
            assert len(gw.kept) == KEPT_TOKEN_FRAMES + 1
            assert _replies(worker) == [], "a frame was answered while Redis was down"

            gw._redis_retry_at = gw.clock()  # the back-off is over
            gw._clients_answered()  # and no client waits for an answer
            gw.replay_kept()
            assert (len(gw.kept), gw.kept.bytes) == (0, 0)
            assert _replies(worker) == [P.JobFinishedAck("job-held", attempt)]
            stored = gw.queue.get("job-held")
            assert (stored.state, msgpack.unpackb(stored.result["token_ids"])) == ("done", HELD_TOKENS)
            # The kept share went to the unknown jobs' streams, each a prefix: the first frames of the flood.
            kept_each = KEPT_TOKEN_FRAMES // len(UNKNOWN)
            for job in UNKNOWN:
                assert gw.leases[job] == ("wk-a", attempts[job])
                assert gw.streams.streams[job].tokens == sent[job][:kept_each]
            assert (gw.counters["token_gaps"], gw.counters["stale_frames"]) == (0, 0)

            # The worker's next frame of a job whose tokens were dropped shows the gap: it is asked for them all.
            more = 1000 + PER_JOB
            worker.send(P.encode(P.JobTokens(UNKNOWN[0], attempts[UNKNOWN[0]], PER_JOB, [more])))
            _drain_until(gw, lambda: gw.counters["token_gaps"] == 1, "the gap seen")
            (ask,) = _replies(worker)
            assert isinstance(ask, P.ErrorReply) and ask.code == P.HELLO_FIRST, ask
            sent[UNKNOWN[0]].append(more)
            for job in UNKNOWN:  # as worker/intake answers it: every token so far, from index 0
                worker.send(P.encode(P.JobTokens(job, attempts[job], 0, sent[job])))
            _drain_until(gw, lambda: all(gw.streams.streams[j].tokens == sent[j] for j in UNKNOWN),
                         "every token of the unknown jobs, sent again")
            assert (gw.counters["token_gaps"], gw.counters["stale_frames"]) == (1, 0)
            assert gw.counters["kept_in_outage"] == KEPT_TOKEN_FRAMES + 1
            gw.flush_token_log()  # and the token log has each of them once, in order
            for job in UNKNOWN:
                logged = [t for _, index, tokens in gw.token_log.read({job: "0-0"})[job] for t in tokens]
                assert logged == sent[job]
        finally:
            worker.close(linger=0)
