"""A gateway's answers while Redis stands still (SIGSTOP): each try of Redis costs the loop one socket timeout (2 s),
and then the back-off, so no client waits for its `unavailable` longer than about one timeout. Real processes: Redis,
a gateway, a fake worker on its worker socket (tests/test_durability.Adversary)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq

from common import protocol as P
from common.sockets import make_socket
from tests.cluster_helpers import ROOT, wait_for
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


# Client frames behind the one whose Redis try stands the loop still. Their answers must take longer than the first
# back-off (0.1 s), or the old gateway passes too, and well under redis_backoff.ANSWER_FIRST_MAX_S (2 s), which lets
# Redis be tried with frames still unanswered, by design: so the pile is sized to what this machine answers in
# PILE_ANSWER_S, measured on a first pile, not fixed (12,000 took ~0.5 s alone and over 2 s beside two other suites).
PILE_ANSWER_S = 0.6
MOST_PILED = 12_000
FIRST_PILE = 2_000


@contextmanager
def serving(gw) -> Iterator[zmq.Socket]:
    """``gw``'s loop in a thread, and a DEALER connected to its client socket; both stopped after."""
    stop = threading.Event()
    loop = threading.Thread(target=gw.serve, args=(stop.is_set,), daemon=True)
    loop.start()
    sock = make_socket(zmq.Context.instance(), zmq.DEALER)
    sock.connect(gw.clients.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        yield sock
    finally:
        stop.set()
        loop.join(10)
        sock.close(linger=0)
        assert not loop.is_alive(), "the gateway's loop did not stop"


def pile_through_a_try(gw, sock, api_key: str, n: int, tag: str) -> tuple[list, list[int], list[float]]:
    """``n`` submissions sent at once while Redis stands still (the caller froze it): the first one's admission
    tries Redis (unless the loop's own work tried it first), and the rest wait in the socket behind it. (the answers,
    the gateway's Redis error count at each, the time of each)."""
    # One pipe, so the gateway reads them in order.
    for i in range(n):
        sock.send(P.encode(P.SubmitRequest(api_key, 2, prompt_token_ids=[5, 5], request_id=f"{tag}{i}")))
    answers, errors_seen, times = [], [], []
    for _ in range(n):
        assert sock.poll(30_000), f"{len(answers)} of {n} frames answered, then none"
        answers.append(P.decode(sock.recv()))
        errors_seen.append(gw.counters["redis_errors"])
        times.append(time.monotonic())
    return answers, errors_seen, times


def answer_rate(errors_seen: list[int], times: list[float]) -> float:
    """Frames answered a second between one Redis try and the next (the first run of answers at one error count):
    what the gateway answers while it tries nothing, whether or not it then waits for the rest."""
    k = errors_seen.count(errors_seen[0])
    assert k >= 100, f"only {k} frames answered before the gateway tried Redis again: no pace to measure"
    return (k - 1) / max(times[k - 1] - times[0], 1e-3)


def test_the_frames_that_waited_out_a_redis_try_are_all_answered_before_the_next_try(tmp_path):
    """Client frames pile up while a try of a frozen Redis stands the loop still (2 s). The back-off after it was
    shorter (0.1 s at first) than answering them took, so the next try stood the loop still again with most of them
    unanswered: they waited two timeouts (the SDK's TimeoutError, not Unavailable; the flaky
    test_long_pauses::test_redis_paused_...). The next try now waits until every frame that waited is answered.
    Counted, not timed: every answer must come before the gateway's second Redis error. The gateway is built as
    `python -m gateway` builds it, on a real redis-server; its loop runs in a thread."""
    with built_gateway(tmp_path, "piled") as (gw, tenants, server), serving(gw) as sock:
        api_key = tenants["lab-co"]["api_key"]
        # This machine's pace at answering a pile, through the same path: a first pile, then Redis back.
        os.kill(server.pid, signal.SIGSTOP)
        try:
            rate = answer_rate(*pile_through_a_try(gw, sock, api_key, FIRST_PILE, "m")[1:])
        finally:
            os.kill(server.pid, signal.SIGCONT)

        def redis_back() -> bool:
            sock.send(P.encode(P.StatusRequest(api_key, "job-none", request_id="up")))  # a try, once backed off
            while sock.poll(100):
                sock.recv()
            return not gw._redis_backoff_s

        wait_for(redis_back, 30, "the gateway to find Redis back", interval=0.2)
        piled = min(MOST_PILED, int(PILE_ANSWER_S * rate))
        assert piled >= 200, f"{rate:.0f} frames answered a second: too slow a machine for this test"
        os.kill(server.pid, signal.SIGSTOP)
        try:
            errors_before = gw.counters["redis_errors"]
            answers, errors_seen, _ = pile_through_a_try(gw, sock, api_key, piled + 1, "p")
        finally:
            os.kill(server.pid, signal.SIGCONT)
    assert {a.request_id for a in answers} == {f"p{i}" for i in range(piled + 1)}  # each answered once
    assert all(isinstance(a, P.ErrorReply) and a.code == "unavailable" for a in answers), \
        {getattr(a, "code", type(a).__name__) for a in answers}
    late = sum(e > errors_before + 1 for e in errors_seen)
    assert late == 0, (f"{late} of {piled + 1} frames answered only after the gateway tried the frozen Redis again "
                       f"(errors: {errors_before} before, {max(errors_seen)} at the last answer; {piled} piled at "
                       f"{rate:.0f} answers a second, measured)")


# A client in a process of its own (in the test's, it would take the gateway thread's interpreter lock): status
# requests sent as fast as its queue takes them, the codes of the answers written to a file as they come.
FLOODER = """
import collections, json, os, sys, zmq
sys.path.insert(0, os.getcwd())
from common import protocol as P
endpoint, api_key, out = sys.argv[1:4]
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.connect(endpoint)
frame, codes, n = P.encode(P.StatusRequest(api_key, "job-none", request_id="f")), collections.Counter(), 0
while True:
    try:
        sock.send(frame, zmq.NOBLOCK)
    except zmq.Again:  # its queue to the gateway is full: the gateway's socket is far from empty
        pass
    while sock.poll(0):
        codes[getattr(P.decode(sock.recv()), "code", "other")] += 1
    n += 1
    if n % 2000 == 0:
        with open(out + ".tmp", "w") as f:
            json.dump(codes, f)
        os.replace(out + ".tmp", out)
"""


def test_a_client_flood_that_never_leaves_the_socket_empty_does_not_keep_redis_untried(tmp_path):
    """The other side of answering waiting frames first: a flood of status requests, sent faster than the gateway
    refuses them, never leaves its client socket empty. Redis, back from its stand-still, must be tried again all
    the same (redis_backoff.ANSWER_FIRST_MAX_S after the back-off's end), and the flood then gets Redis's answers."""
    out = tmp_path / "codes.json"

    def codes() -> dict:
        try:
            return json.loads(out.read_text())
        except (OSError, ValueError):
            return {}

    with built_gateway(tmp_path, "flood") as (gw, tenants, server), serving(gw):
        os.kill(server.pid, signal.SIGSTOP)
        flooder = subprocess.Popen([sys.executable, "-c", FLOODER, gw.clients.getsockopt_string(zmq.LAST_ENDPOINT),
                                    tenants["lab-co"]["api_key"], str(out)], cwd=ROOT)
        try:
            try:
                wait_for(lambda: gw.counters["redis_errors"] >= 1 and codes().get("unavailable"), 30,
                         "the flood refused as unavailable")
            finally:
                os.kill(server.pid, signal.SIGCONT)
            wait_for(lambda: codes().get("not_found"), 30, "Redis tried again under the flood")
            assert flooder.poll() is None, "the flood stopped: this tested nothing"
        finally:
            flooder.kill()
            flooder.wait(10)
        refused = gw.counters["refused_unavailable"]
    assert refused > 1000, f"{refused} frames refused: too few for a flood that never left the socket empty"
