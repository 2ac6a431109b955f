"""A gateway restarted (kill -9) under a running job, whose first frame from the job's worker is the worker's
periodic hello: the tokens the worker had streamed to the dead process, never written to the job's Redis token
log, are a gap the restarted gateway must have the worker send again, not wait out until the job ends.

A real worker sends its hello every 5 s from its heartbeat thread, and ZeroMQ keeps what it sends while the
gateway is down queued for the new one: which frame comes first is a matter of timing. The worker here is a raw
socket speaking the wire protocol as worker/service.py does (hello, report, tokens; on `hello_first`, a hello and
every token so far), so the order is the test's; gateway and Redis are the real processes.
"""

from __future__ import annotations

import time

import pytest
import zmq

from common import protocol as P
from common.sockets import make_socket
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster
from tests.raw_worker import RawWorker

pytestmark = pytest.mark.faults


def chunks_until(sock: zmq.Socket, last_index: int, timeout_s: float) -> list[P.TokenChunk]:
    """TokenChunks until one reaches ``last_index`` (or ``timeout_s`` passes, or the job ends)."""
    out: list[P.TokenChunk] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not sock.poll(100):
            continue
        msg = P.decode(sock.recv())
        if isinstance(msg, P.TokenChunk):
            out.append(msg)
            if msg.index + len(msg.token_ids) > last_index:
                return out
        elif isinstance(msg, P.JobDone):
            raise AssertionError(f"the job ended before its stream reached index {last_index}: {msg}")
    return out


def test_a_restarted_gateway_hearing_a_periodic_hello_first_has_the_lost_tokens_sent_again(tmp_path, tiny_model_dir):
    # Tokens are written to Redis only at the job's end here: those the first gateway process got die with it.
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=0, lease_s=60.0,
                        gateway_env={"TS_GATEWAY_STREAM_FLUSH_INTERVAL_S": "30"}) as c:
        _, worker_ep = c.gateways["gw-0"]
        wk = RawWorker(worker_ep)
        client = c.client("lab-co")
        stream = make_socket(zmq.Context.instance(), zmq.DEALER)
        try:
            wait_for(lambda: len(client.info().workers) == 1, 30, "the gateway to hear the raw worker")
            job = client.submit(prompt_token_ids=[3, 4, 5], max_tokens=7, seed=1, ignore_eos=True)
            d = wk.recv(P.DispatchJob, 30)
            assert d is not None and d.job_id == job.id
            wk.held = [job.id]
            tokens = [10, 11, 12, 13, 14, 15, 16]
            wk.send(P.JobTokens(job.id, d.attempt, 0, tokens[:3]))
            stream.connect(c.endpoint("gw-0"))
            stream.send(P.encode(P.StreamRequest(c.key("lab-co"), job.id, 0)))
            got = chunks_until(stream, 2, 30)
            wk.send(P.JobTokens(job.id, d.attempt, 3, tokens[3:5]))
            got += chunks_until(stream, 4, 30)
            assert [t for ch in got for t in ch.token_ids] == tokens[:5]  # the first process had them all
            c.kill("gw-0")
            c.restart("gw-0")
            wk.hello()  # its periodic hello, the first frame the new process reads from it
            wait_for(lambda: len(client.info().workers) == 1, 60, "the restarted gateway to hear the worker")

            wk.send(P.JobTokens(job.id, d.attempt, 5, tokens[5:6]))
            stream.close(linger=0)
            stream = make_socket(zmq.Context.instance(), zmq.DEALER)
            stream.connect(c.endpoint("gw-0"))
            stream.send(P.encode(P.StreamRequest(c.key("lab-co"), job.id, 5)))
            asked = wk.recv(P.ErrorReply, 5)
            if asked is not None:  # what worker/service.py does when asked to say hello
                assert asked.code == P.HELLO_FIRST, asked
                wk.hello()
                wk.send(P.JobTokens(job.id, d.attempt, 0, tokens[:6]))
            live = chunks_until(stream, 5, 10)
            # Before the job ends, the client has every token after index 5 once, in order.
            assert [(ch.index, list(ch.token_ids)) for ch in live] == [(5, tokens[5:6])], \
                f"the stream did not go on before the job's end (asked to say hello: {asked})"

            wk.send(P.JobTokens(job.id, d.attempt, 6, tokens[6:]))
            rest = chunks_until(stream, 6, 10)
            assert [(ch.index, list(ch.token_ids)) for ch in rest] == [(6, tokens[6:])]
            wk.send(P.JobFinished(job.id, d.attempt, "done", "length", 7, 0.1, 1.0, 0, None, tokens))
            assert wk.recv(P.JobFinishedAck, 10) is not None
            wk.held = []
            assert job.result(timeout=30).token_ids == tokens
            assert c.stored_tokens(job.id) == tokens
        finally:
            stream.close(linger=0)
            client.close()
            wk.close()
