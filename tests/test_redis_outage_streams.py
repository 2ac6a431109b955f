"""A stream goes on while Redis stands still (SIGSTOP): the gateway holds the job's lease, so the worker's tokens need
no Redis to reach its subscribers; what does need Redis (the completion, the load reports that extend leases) is kept
aside and replayed, once, when Redis answers again. Real processes: Redis, a gateway, a fake worker on its worker
socket (tests/test_durability.Adversary) that sends one token every TOKEN_EVERY_S, and a client on a raw socket."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from common import protocol as P
from common.keys import generate
from common.ports import free_port
from common.redis_server import RedisServer
from common.sockets import make_socket
from gateway.sdk import GatewayClient
from scripts.up import write_tenants
from tests.cluster_helpers import stop_process, wait_for
from tests.durable_cluster import DurableCluster
from tests.test_durability import Adversary
from tests.test_security_worker_keys import _finished, _first_reply, _hello
from tests.test_security_worker_keys_shared import _start_gateway

pytestmark = pytest.mark.faults
# Long enough for the gateway's back-off to reach its 2 s steady state: a read of Redis then waits out its 2 s socket
# timeout after each 2 s of back-off. Frames read only between back-offs reached the client 4 s apart; read during
# them as well, no token waits longer than one timeout.
FREEZE_S = 16.0
TOKEN_EVERY_S = 0.1
LONGEST_SILENCE_S = 3.0  # one Redis timeout (2 s) and room for a loaded 2-core machine; two in a row are 4 s
RESENDS = 3  # copies of the completion the worker sends while no gateway confirms it (worker/completions.py)


class Watcher:
    """A client on a raw DEALER socket that subscribes to one job and records when each frame came."""

    def __init__(self, endpoint: str, api_key: str, job_id: str) -> None:
        self.sock = make_socket(zmq.Context.instance(), zmq.DEALER)
        self.sock.connect(endpoint)
        self.sock.send(P.encode(P.StreamRequest(api_key, job_id, request_id="watch")))
        self.chunks: list[tuple[float, P.TokenChunk]] = []
        self.dones: list[P.JobDone] = []
        self.errors: list[P.ErrorReply] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            msg = P.decode(self.sock.recv())
            if isinstance(msg, P.TokenChunk):
                self.chunks.append((time.monotonic(), msg))
            elif isinstance(msg, P.JobDone):
                self.dones.append(msg)
            elif isinstance(msg, P.ErrorReply):
                self.errors.append(msg)

    def tokens(self) -> list[int]:
        out: list[int] = []
        for _, c in self.chunks:
            assert c.index == len(out), f"a chunk at index {c.index} after {len(out)} tokens"
            out.extend(c.token_ids)
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(linger=0)


def finished_total(metrics_port: int) -> dict[str, float]:
    page = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return {s.labels["state"]: s.value for f in text_string_to_metric_families(page) if f.name == "ts_jobs_finished"
            for s in f.samples if s.name == "ts_jobs_finished_total"}


def test_a_stream_goes_on_while_redis_stands_still_and_its_completion_is_stored_once(tmp_path, tiny_model_dir):
    metrics_port = free_port()
    env = {"TS_GATEWAY_METRICS_BIND": f"127.0.0.1:{metrics_port}"}
    # A lease outlasts the freeze: the test is about the stream, not about a lease Redis's clock ran out meanwhile.
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=0, lease_s=60.0, gateway_env=env) as c:
        worker = Adversary(c.gateways["gw-0"][1], "wk-adv", slots=1)
        watcher = None
        try:
            worker.load([], free=1)
            with c.client("lab-co") as lab:
                job = lab.submit(prompt_token_ids=[1, 2], max_tokens=1000, ignore_eos=True)
            d = worker.recv(P.DispatchJob, beat=[])
            assert d.job_id == job.id
            watcher = Watcher(c.endpoint(), c.key("lab-co"), job.id)
            sent: list[tuple[float, int]] = []  # (when, token) for each token the worker sent

            def send_token() -> None:
                i = len(sent)
                worker.send(P.JobTokens(job.id, d.attempt, i, [100 + i], prefill_start_s=0.0 if i == 0 else None))
                sent.append((time.monotonic(), 100 + i))

            for _ in range(5):
                send_token()
            worker.load([job.id], free=0)
            wait_for(lambda: len(watcher.tokens()) == 5, 30, "the tokens sent before the freeze")

            redis_pid = c.procs["redis"].pid
            os.kill(redis_pid, signal.SIGSTOP)
            try:
                frozen_at = time.monotonic()
                next_load = frozen_at
                while time.monotonic() - frozen_at < FREEZE_S:
                    send_token()
                    if time.monotonic() >= next_load:  # the worker's heartbeat goes on, listing the job
                        worker.load([job.id], free=0)
                        next_load += 0.5
                    time.sleep(TOKEN_EVERY_S)
                tokens = [t for _, t in sent]
                finished = P.JobFinished(job.id, d.attempt, "done", "length", len(tokens), 0.01, 1.0, 0,
                                         token_ids=tokens)
                for _ in range(RESENDS):  # sent again, as a worker does until it is confirmed
                    worker.send(finished)
                    time.sleep(0.3)
                streamed_frozen = len(watcher.tokens())
                thawed_at = time.monotonic()
            finally:
                os.kill(redis_pid, signal.SIGCONT)

            wait_for(lambda: watcher.dones, 60, "the job's end after the freeze")
            time.sleep(1.0)  # a second JobDone, if one were coming, would come within this
            arrivals = [t for t, _ in watcher.chunks if frozen_at <= t <= thawed_at]
            gaps = [b - a for a, b in zip([frozen_at, *arrivals], [*arrivals, thawed_at])]
            print(f"longest silences while frozen: {sorted(round(g, 2) for g in gaps)[-4:]}")  # pytest -rP
            assert max(gaps) < LONGEST_SILENCE_S, (
                f"the stream stood still {max(gaps):.2f} s while Redis was frozen, though the worker sent a token "
                f"every {TOKEN_EVERY_S} s ({streamed_frozen} of {len(tokens)} tokens reached the client by the thaw; "
                f"longest silences {sorted(round(g, 2) for g in gaps)[-4:]})")
            assert watcher.tokens() == tokens
            assert len(watcher.dones) == 1, watcher.dones
            done = watcher.dones[0]
            assert (done.state, done.token_ids) == ("done", tokens)
            assert (c.state(job.id), c.stored_tokens(job.id)) == ("done", tokens)
            assert finished_total(metrics_port) == {"done": 1.0}
        finally:
            if watcher is not None:
                watcher.close()
            worker.close()


def in_backoff_for(endpoint: str, api_key: str, seconds: float, timeout_s: float = 60.0) -> None:
    """Return once a submission is refused as 'unavailable' with at least ``seconds`` of back-off left: the frames
    sent right after are read during the back-off."""
    sock = make_socket(zmq.Context.instance(), zmq.DEALER)
    sock.connect(endpoint)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            sock.send(P.encode(P.SubmitRequest(api_key, 2, prompt_token_ids=[5, 5], request_id="probe")))
            assert sock.poll(20_000), "a submission got no answer at all"
            reply = P.decode(sock.recv())
            if isinstance(reply, P.ErrorReply) and reply.code == "unavailable" and reply.retry_after_s >= seconds:
                return
            time.sleep(0.05)
        raise AssertionError(f"the gateway never was {seconds} s from the end of a back-off")
    finally:
        sock.close(linger=0)


def test_frames_kept_during_the_backoff_are_replayed_with_the_key_they_came_with(tmp_path):
    """Each worker frame is judged by the CURVE key it came with (security.from_registered_worker). A completion kept
    during the back-off and replayed after another worker's frame, judged by the key last read, would be dropped as
    from a worker that never said hello (and its job waits for the worker to resend it)."""
    keys = generate(tmp_path / "keys", ["wk-a", "wk-b"])
    tenants = write_tenants(tmp_path / "tenants.toml")
    api_key = tenants["lab-co"]["api_key"]
    with RedisServer() as server:
        proc, gw = _start_gateway(tmp_path, "gw-1", server.url, f"kept-{os.getpid()}-{time.monotonic_ns()}", keys)
        socks = []
        try:
            holder, hi = _first_reply(gw, "wk-a", "wk-a", _hello("wk-a"))
            socks.append(holder)
            assert isinstance(hi, P.GatewayWelcome), hi
            other, hi = _first_reply(gw, "wk-b", "wk-b", _hello("wk-b"))
            socks.append(other)
            assert isinstance(hi, P.GatewayWelcome), hi
            with GatewayClient(gw["client"], api_key, timeout_s=60) as client:
                holder.send(P.encode(P.WorkerLoad("wk-a", 1, 512, {}, {}, [], 0.0)))
                job = client.submit(prompt_token_ids=[1, 2, 3], max_tokens=4, ignore_eos=True)
                assert holder.poll(10_000), "no job dispatched to wk-a"
                dispatch = P.decode(holder.recv())
                assert isinstance(dispatch, P.DispatchJob) and dispatch.job_id == job.id, dispatch
                os.kill(server.pid, signal.SIGSTOP)
                try:
                    in_backoff_for(gw["client"], api_key, 1.0)
                    holder.send(P.encode(_finished(dispatch, [7, 8, 9, 10])))  # kept with key wk-a
                    other.send(P.encode(P.WorkerLoad("wk-b", 4, 512, {}, {}, [], 0.0)))  # kept after it, key wk-b
                    time.sleep(0.3)  # both are read while the back-off lasts (1 s or more)
                finally:
                    os.kill(server.pid, signal.SIGCONT)
                assert holder.poll(30_000), "no answer to wk-a's completion after the freeze"
                reply = P.decode(holder.recv())
                assert reply == P.JobFinishedAck(dispatch.job_id, dispatch.attempt), reply
                assert job.result(timeout=30).token_ids == [7, 8, 9, 10]
            wait_for(lambda: "replayed 2 worker frame(s)" in gw["log"].read_text(), 10,
                     "both frames kept during the back-off and replayed")
        finally:
            for s in socks:
                s.close(linger=0)
            stop_process(proc, timeout=15)


def test_a_stream_asked_for_while_redis_stands_still_is_served_from_the_tokens_held_here(tmp_path, tiny_model_dir):
    """A client that asks for a job's stream during the back-off (its first StreamRequest after the submission, or a
    second reader, or a re-subscription after its connection dropped) is served as the job's other subscribers are:
    the gateway holds the job's tokens, and answering needs no Redis (streaming.on_stream reads none for a stream it
    has). Refused 'unavailable', it heard none of the tokens streamed meanwhile to the others until Redis was back."""
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=0, lease_s=60.0) as c:
        worker = Adversary(c.gateways["gw-0"][1], "wk-adv", slots=1)
        first = late = None
        try:
            worker.load([], free=1)
            with c.client("lab-co") as lab:
                job = lab.submit(prompt_token_ids=[1, 2], max_tokens=100, ignore_eos=True)
            d = worker.recv(P.DispatchJob, beat=[])
            first = Watcher(c.endpoint(), c.key("lab-co"), job.id)
            tokens = [100 + i for i in range(12)]
            worker.send(P.JobTokens(job.id, d.attempt, 0, tokens[:4], prefill_start_s=0.0))
            worker.load([job.id], free=0)
            wait_for(lambda: first.tokens() == tokens[:4], 30, "the tokens sent before the freeze")
            redis_pid = c.procs["redis"].pid
            os.kill(redis_pid, signal.SIGSTOP)
            try:
                in_backoff_for(c.endpoint(), c.key("lab-co"), 1.5)
                for i in range(4, 8):
                    worker.send(P.JobTokens(job.id, d.attempt, i, [tokens[i]]))
                wait_for(lambda: first.tokens() == tokens[:8], 10, "the tokens sent in the freeze, to the first reader")
                late = Watcher(c.endpoint(), c.key("lab-co"), job.id)
                worker.send(P.JobTokens(job.id, d.attempt, 8, tokens[8:10]))
                # Within the back-off (1.5 s or more from the probe): no Redis is asked, so none is waited for.
                wait_for(lambda: late.tokens() == tokens[:10] or late.errors, 10, "the late reader's tokens")
                assert late.errors == [], f"the late reader was refused: {late.errors}"
                assert first.tokens() == tokens[:10]
            finally:
                os.kill(redis_pid, signal.SIGCONT)
            worker.send(P.JobTokens(job.id, d.attempt, 10, tokens[10:]))
            worker.send(P.JobFinished(job.id, d.attempt, "done", "length", len(tokens), 0.01, 1.0, 0,
                                      token_ids=tokens))
            wait_for(lambda: first.dones and late.dones, 60, "the job's end, to both readers")
            for w in (first, late):
                assert w.tokens() == tokens and [x.token_ids for x in w.dones] == [tokens]
            assert (c.state(job.id), c.stored_tokens(job.id)) == ("done", tokens)
        finally:
            for w in (first, late):
                if w is not None:
                    w.close()
            worker.close()
