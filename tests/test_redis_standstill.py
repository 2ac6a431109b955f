"""A gateway's answers while Redis stands still (SIGSTOP): each try of Redis costs the loop one socket timeout (2 s),
and then the back-off, so no client waits for its `unavailable` longer than about one timeout. Real processes: Redis,
a gateway, a fake worker on its worker socket (tests/test_durability.Adversary)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import zmq

from common import protocol as P
from common.sockets import make_socket
from tests.durable_cluster import DurableCluster
from tests.gateway_helpers import built_gateway
from tests.test_durability import Adversary

pytestmark = pytest.mark.faults
REDIS_TIMEOUT_S = 2.0  # the gateway's Redis socket timeout (gateway/__main__.build)
# One Redis timeout, and room for a loaded 2-core machine; two timeouts in a row (4 s) are well past it.
LONGEST_ANSWER_S = REDIS_TIMEOUT_S + 1.0


def probe_answers(endpoint: str, api_key: str, seconds: float, gap_s: float = 0.05) -> list[tuple[float, object]]:
    """Submissions, one after another (``gap_s`` apart) for ``seconds``: (how long each waited for its answer, the
    answer)."""
    sock = make_socket(zmq.Context.instance(), zmq.DEALER)
    sock.connect(endpoint)
    answers = []
    try:
        end = time.monotonic() + seconds
        n = 0
        while time.monotonic() < end:
            n += 1
            sent = time.monotonic()
            sock.send(P.encode(P.SubmitRequest(api_key, 2, prompt_token_ids=[5, 5], request_id=f"p{n}")))
            assert sock.poll(20_000), "a submission got no answer at all"
            answers.append((time.monotonic() - sent, P.decode(sock.recv())))
            time.sleep(gap_s)
    finally:
        sock.close(linger=0)
    return answers


def frozen(c: DurableCluster, seconds: float, during) -> object:
    pid = c.procs["redis"].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        return during(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


def assert_answered_promptly(answers: list[tuple[float, object]]) -> None:
    assert answers and all(isinstance(a, P.ErrorReply) and a.code == "unavailable" for _, a in answers), answers
    longest = max(w for w, _ in answers)
    assert longest < LONGEST_ANSWER_S, (
        f"a submission waited {longest:.2f} s for its 'unavailable' (the loop waited out Redis more than once in a "
        f"row): {sorted(round(w, 2) for w, _ in answers)[-5:]}")


def test_a_worker_report_waits_out_a_frozen_redis_once_not_twice(tmp_path, tiny_model_dir):
    """A load report of a worker running a job read the cluster's memory of drained workers (gateway/drained.py;
    its error caught and logged) and then the job's record: two socket timeouts in a row, 4 s in which no client
    heard even `unavailable`, at every end of the back-off while a worker reported."""
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=0, lease_s=30.0) as c:
        worker = Adversary(c.gateways["gw-0"][1], "wk-adv", slots=1)
        stop = threading.Event()
        try:
            worker.load([], free=1)
            with c.client("lab-co") as lab:
                lab.submit(prompt_token_ids=[1, 2], max_tokens=2)
            d = worker.recv(P.DispatchJob, beat=[])

            def reports() -> None:
                while not stop.is_set():
                    worker.load([d.job_id], free=0)
                    stop.wait(0.25)
            beat = threading.Thread(target=reports, daemon=True)
            beat.start()
            time.sleep(1.0)  # reports are being read
            answers = frozen(c, 10.0, lambda s: probe_answers(c.endpoint(), c.key("lab-co"), s))
        finally:
            stop.set()
            worker.close()
        assert_answered_promptly(answers)


def test_keepalives_wait_out_a_frozen_redis_once_not_once_a_stream(tmp_path):
    """Each keepalive due read its job's record, stream after stream, and caught the error itself: with Redis frozen,
    four silent streams stood the loop still 8 s in a row, and the back-off was never started (so the background work
    waited out Redis once more after). The gateway is built as `python -m gateway` builds it, on a real redis-server."""
    with built_gateway(tmp_path, "still") as (gw, _, server):
        now = gw.clock()
        for i in range(4):
            gw.keepalives.watch((b"gone-client", f"r{i}"), f"job-{i}", now)
        os.kill(server.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            gw.send_keepalives(now + 2 * gw.config.keepalive_interval_s, redis_up=True)
            took = time.monotonic() - started
            in_backoff = gw.clock() < gw._redis_retry_at
        finally:
            os.kill(server.pid, signal.SIGCONT)
    assert took < LONGEST_ANSWER_S, f"four keepalives stood the loop still {took:.2f} s"
    assert in_backoff, "a Redis that did not answer a keepalive's read started no back-off"
