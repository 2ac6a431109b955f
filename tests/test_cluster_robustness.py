"""Cluster robustness: two gateways on one Redis, a worker killed mid-generation, and fuzzed wire frames.

Each test starts its own real cluster (scripts/up.py: redis-server, gateway and worker processes on
loopback). Streams are read with raw ZeroMQ sockets rather than the SDK, because the SDK trims
duplicated indices defensively and would hide a gateway that sent one twice. Token contents are
checked against the engine run in this process (the reference): the sampler's randomness depends
only on (seed, index), so a job's tokens do not depend on batching, preemption or re-dispatch.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import zmq

from common import protocol as P
from common.monitors import close_monitor, monitor_events, monitor_socket
from common.ports import free_port
from common.sockets import curve_client, make_socket
from gateway.sdk import GatewayClient
from tests.cluster_helpers import job_hash, local_cluster, process_running, stop_process, wait_for

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 512  # models/configs/tiny-llama.json


# -- helpers ----------------------------------------------------------------------------------------------------------


class RawStream(threading.Thread):
    """Subscribes to one job with a raw DEALER and records every frame the gateway sends, unfiltered."""

    def __init__(self, endpoint: str, api_key: str, job_id: str, frame_timeout_s: float = 60.0) -> None:
        super().__init__(daemon=True, name=f"stream-{job_id[:8]}")
        self.endpoint, self.api_key, self.job_id = endpoint, api_key, job_id
        self.frame_timeout_s = frame_timeout_s
        self.chunks: list[tuple[int, list[int]]] = []  # (index, token_ids) of every TokenChunk, in arrival order
        self.done: P.JobDone | None = None
        self.keepalives = 0
        self.error: object = None  # an unexpected reply or exception

    def run(self) -> None:
        sock = make_socket(zmq.Context.instance(), zmq.DEALER)
        try:
            sock.connect(self.endpoint)
            sock.send(P.encode(P.StreamRequest(self.api_key, self.job_id, 0)))
            while self.done is None:
                if not sock.poll(int(self.frame_timeout_s * 1000)):
                    raise TimeoutError(f"no frame for job {self.job_id} in {self.frame_timeout_s}s")
                msg = P.decode(sock.recv())
                if isinstance(msg, P.TokenChunk) and msg.job_id == self.job_id:
                    self.chunks.append((msg.index, list(msg.token_ids)))
                elif isinstance(msg, P.JobDone) and msg.job_id == self.job_id:
                    self.done = msg
                elif isinstance(msg, P.StatusReply) and msg.job_id == self.job_id:
                    self.keepalives += 1  # the gateway saying it is alive while the job has no news
                else:
                    self.error = msg
                    return
        except Exception as e:  # reported by the test's assertions
            self.error = e
        finally:
            sock.close(linger=0)

    @property
    def n_tokens(self) -> int:
        return sum(len(ids) for _, ids in self.chunks)

    def streamed_tokens(self) -> list[int]:
        return [t for _, ids in self.chunks for t in ids]

    def assert_exactly_once(self, n: int) -> None:
        """Indices 0..n-1, each exactly once, contiguous and in order; then a successful JobDone."""
        assert self.error is None, f"job {self.job_id}: {self.error!r}"
        assert self.done is not None, f"job {self.job_id}: no JobDone"
        indices = [i for start, ids in self.chunks for i in range(start, start + len(ids))]
        assert indices == list(range(n)), f"job {self.job_id}: streamed indices {_runs(indices)}, wanted 0..{n - 1}"
        assert self.done.state == "done", f"job {self.job_id}: {self.done}"
        assert self.done.token_ids == self.streamed_tokens()


def _runs(indices: list[int]) -> str:
    """Compact description of an index sequence, e.g. '0-99,50-120' for a duplicated range."""
    if not indices:
        return "(none)"
    out, start, prev = [], indices[0], indices[0]
    for i in indices[1:]:
        if i != prev + 1:
            out.append(f"{start}-{prev}")
            start = i
        prev = i
    out.append(f"{start}-{prev}")
    return ",".join(out)


def _redis_tokens(state: dict, job_id: str) -> list[int]:
    raw = state["redis_client"].hget(f"{state['key_prefix']}:{{c}}:job:{job_id}", "token_ids")
    return msgpack.unpackb(raw) if raw else []


def _join_all(threads: list[threading.Thread], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"streams still open after {timeout_s}s: {stuck}"


# -- 1. two gateways on one Redis -------------------------------------------------------------------------------------


def test_two_gateways_share_one_redis_and_dispatch_every_job_exactly_once(tmp_path, tiny_model_dir, reference):
    rng = random.Random(20240601)
    specs = []  # (admitting gateway, tier, prompt, max_tokens, temperature, seed)
    for i in range(40):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))]
        specs.append((i % 2, rng.choice(["P1", "P2", "P3"]), prompt, rng.randint(4, 32), rng.choice([0.0, 0.9]),
                      rng.getrandbits(32)))
    want = reference([(p, n, temp, seed) for _, _, p, n, temp, seed in specs])

    with local_cluster(tmp_path, tiny_model_dir, workers=2, gateways=2, max_running=4, http=False) as state:
        gws = state["gateways"]
        key = state["tenants"]["api-co"]["api_key"]  # P1..P3
        clients = [GatewayClient(g["endpoint"], key, timeout_s=30) for g in gws]
        try:
            jobs, streams = [], []
            for g, tier, prompt, n, temp, seed in specs:
                job = clients[g].submit(prompt_token_ids=prompt, max_tokens=n, temperature=temp, seed=seed,
                                        tier=tier, ignore_eos=True)
                assert job.tier == tier and not job.duplicate
                jobs.append(job)
                # A job's tokens come back through the gateway that admitted it.
                s = RawStream(gws[g]["endpoint"], key, job.id)
                s.start()
                streams.append(s)
            _join_all(streams, 120)

            dispatchers = set()
            for (g, tier, prompt, n, temp, seed), job, s, ref in zip(specs, jobs, streams, want):
                s.assert_exactly_once(n)
                assert s.streamed_tokens() == ref, f"job {job.id}: tokens differ from the engine's"
                h = job_hash(state, job.id)
                assert h["state"] == "done" and h["attempt"] == "1", f"job {job.id} ({gws[g]['id']}): {h}"
                assert int(h["num_tokens"]) == n and _redis_tokens(state, job.id) == ref
                dispatchers.add(h["gateway"])
                # Either gateway answers for any job (state lives in Redis), and the other gateway serves the
                # finished result too.
                # The tier now is the queue it left from: one up from where it was admitted where its promised start
                # fell due.
                up = f"P{int(tier[1]) - 1}" if "promoted_at_ms" in h else tier
                assert h["tier_granted"] == tier and h["tier"] in (tier, up)
                for c in clients:
                    st = c.status(job.id)
                    assert (st.state, st.attempt, st.tier) == ("done", 1, h["tier"])
                other = RawStream(gws[1 - g]["endpoint"], key, job.id, frame_timeout_s=10)
                other.run()
                other.assert_exactly_once(n)
                assert other.streamed_tokens() == ref
            assert dispatchers <= {g["id"] for g in gws}

            r, prefix = state["redis_client"], f"{state['key_prefix']}:{{c}}"
            assert r.zcard(f"{prefix}:inflight") == 0 and r.zcard(f"{prefix}:dead") == 0
            assert all(r.zcard(f"{prefix}:q:P{t}") == 0 for t in range(4))
            drain = {k.decode(): v for k, v in r.hgetall(f"{prefix}:drain").items()}
            assert sum(int(drain.get(f"completed:P{t}", 0)) for t in range(4)) == len(specs)  # no double completion

            # Rounds of short jobs: many are dispatched by the gateway that did not admit them, and end (through
            # the admitting one) before any load report lists them. Dispatch must not stall: neither gateway
            # may keep counting such jobs against a worker's free slots.
            for rnd in range(3):
                burst = [(n, clients[i % 2].submit(prompt_token_ids=[7, rnd, i], max_tokens=n, ignore_eos=True,
                                                   tier=rng.choice(["P2", "P3"])))
                         for i, n in enumerate(rng.randint(1, 4) for _ in range(40))]

                def unfinished():
                    return [j.id for _, j in burst if job_hash(state, j.id)["state"] != "done"]

                try:
                    wait_for(lambda: not unfinished(), 30, "")
                except AssertionError:
                    stuck = unfinished()
                    raise AssertionError(f"round {rnd}: {len(stuck)} of 40 jobs never finished, states "
                                         f"{sorted({job_hash(state, j)['state'] for j in stuck})}") from None
                for n, j in burst:
                    h = job_hash(state, j.id)
                    assert h["attempt"] == "1" and int(h["num_tokens"]) == n
        finally:
            for c in clients:
                c.close()


# -- 2. a worker killed mid-generation --------------------------------------------------------------------------------


def test_kill_9_of_a_worker_mid_generation_loses_and_duplicates_nothing(tmp_path, tiny_model_dir, reference):
    rng = random.Random(90210)
    n_tokens = 400
    specs = [([rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 16))], n_tokens, 0.8, rng.getrandbits(40))
             for _ in range(8)]
    want = reference(specs)

    with local_cluster(tmp_path, tiny_model_dir, workers=2, max_running=2, lease_s=1.5, http=False) as state:
        key = state["tenants"]["lab-co"]["api_key"]  # P3 only
        victim_worker = state["workers"][0]
        client = GatewayClient(state["gateway"], key, timeout_s=30)
        try:
            jobs, streams = [], []
            for prompt, n, temp, seed in specs:
                job = client.submit(prompt_token_ids=prompt, max_tokens=n, temperature=temp, seed=seed,
                                    ignore_eos=True)
                jobs.append(job)
                s = RawStream(state["gateway"], key, job.id)
                s.start()
                streams.append(s)

            def in_flight_on_victim():
                """Jobs the victim is generating, well before their end: at least one chunk, under half."""
                hit = []
                for job, s in zip(jobs, streams):
                    h = job_hash(state, job.id)
                    if h.get("state") == "dispatched" and h.get("worker") == victim_worker["id"] \
                            and 1 <= s.n_tokens <= n_tokens // 2:
                        hit.append(job.id)
                return hit

            victims = wait_for(in_flight_on_victim, 60, f"{victim_worker['id']} to be generating")
            os.kill(victim_worker["pid"], signal.SIGKILL)
            before = {j: job_hash(state, j) for j in victims}
            wait_for(lambda: not process_running(victim_worker["pid"]), 10, "the killed worker to be gone")

            _join_all(streams, 120)
            for (prompt, n, temp, seed), job, s, ref in zip(specs, jobs, streams, want):
                s.assert_exactly_once(n)
                h = job_hash(state, job.id)
                assert h["state"] == "done", f"job {job.id}: {h}"
                assert s.streamed_tokens() == s.done.token_ids == _redis_tokens(state, job.id)
                # The seed was fixed at admission: a re-dispatched job reproduces the same tokens.
                assert s.streamed_tokens() == ref, f"job {job.id} (attempt {h['attempt']}): tokens differ"
                if job.id in victims:
                    assert int(h["attempt"]) >= 2, f"victim {job.id} was not re-dispatched: {before[job.id]} -> {h}"
                    assert h["worker"] != victim_worker["id"]
            # Every job finished exactly once (nothing dead-lettered, no lease left behind).
            r, prefix = state["redis_client"], f"{state['key_prefix']}:{{c}}"
            assert r.zcard(f"{prefix}:inflight") == 0 and r.zcard(f"{prefix}:dead") == 0
            # Counted by the queue each left from: P3, or P2 or P1 for a job whose promised start fell due.
            assert sum(int(r.hget(f"{prefix}:drain", f"completed:{t}") or 0) for t in ("P1", "P2", "P3")) == len(specs)
            # The survivors are still up and the cluster still serves.
            assert all(process_running(p) for p in state["gateway_pids"])
            assert process_running(state["workers"][1]["pid"])
            assert len(client.submit(prompt_token_ids=[5, 6], max_tokens=4, ignore_eos=True)
                       .result(timeout=30).token_ids) == 4
        finally:
            client.close()


# -- 3. fuzzed frames -------------------------------------------------------------------------------------------------


BAD_KEY = "fuzz-not-a-key"


def _jid(rng: random.Random) -> str:
    return f"{rng.getrandbits(128):032x}"


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _corpus(rng: random.Random, key: str) -> list:
    """One valid instance of every message kind (client ones with ``key``)."""
    return [
        P.SubmitRequest(key, rng.randint(1, 8), prompt_token_ids=_ids(rng, rng.randint(1, 8)), tier="P3",
                        seed=rng.getrandbits(32), ignore_eos=True),
        P.SubmitRequest(key, 4, prompt="fuzz me", temperature=0.7, top_p=0.9, top_k=5, idempotency_key="k",
                        trace_context={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}),
        P.StreamRequest(key, _jid(rng), rng.randint(0, 5)), P.StatusRequest(key, _jid(rng)),
        P.CancelRequest(key, _jid(rng)), P.InfoRequest(key),
        P.SubmitReply(_jid(rng), "P3", 0.5, False), P.TokenChunk(_jid(rng), 0, _ids(rng, 3), "abc"),
        P.JobDone(_jid(rng), "done", "length", _ids(rng, 3), "x", 0.1, 0.2, 0.3, 0),
        P.StatusReply(_jid(rng), "queued", "P3", 1, 0.5, None), P.CancelReply(_jid(rng), True),
        P.InfoReply("gw-x", ["wk-x"], {"P0": 1}), P.ErrorReply("protocol", "boom"),
        P.WorkerHello("wk-phantom", "m", VOCAB, 2048, 4, 100), P.GatewayWelcome("gw-phantom"),
        P.WorkerLoad("wk-phantom", 1, 10, {"P0": 0}, {"P3": 1}, [_jid(rng)], 0.0),
        P.DispatchJob(_jid(rng), 1, "P3", "lab-co", _ids(rng, 4), 4, 0.0, 1.0, None, 7, "gw-phantom"),
        P.CancelJob(_jid(rng)), P.JobTokens(_jid(rng), 1, 0, _ids(rng, 2)),
        P.JobFinished(_jid(rng), 1, "done", "length", 2, 0.01, 0.02, 0),
    ]


_ODD_VALUES = [None, True, -1, 2**64 - 1, -(2**63), 1.5, float("nan"), float("inf"), "", "x" * 300, b"\x00\xff",
               [], [1, "a"], {}, {"a": [1]}, msgpack.ExtType(5, b"ext")]


def _pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _mutate(rng: random.Random, corpus: list) -> list[bytes]:
    """One fuzz case: a list of frame parts (usually one)."""
    msg = rng.choice(corpus)
    frame = P.encode(msg)
    raw = {"v": P.SCHEMA_VERSION, "k": type(msg).__name__,
           "b": {k: v for k, v in msgpack.unpackb(frame, raw=False)["b"].items()}}
    kind = rng.randrange(14)
    if kind == 0:  # random bytes
        return [rng.randbytes(rng.randint(0, 300))]
    if kind == 1:  # truncated valid frame
        return [frame[:rng.randrange(len(frame))]]
    if kind == 2:  # bit flips in a valid frame
        b = bytearray(frame)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return [bytes(b)]
    if kind == 3:  # wrong schema version
        raw["v"] = rng.choice([0, 2, -1, 255, "1", None, 1.5, [1]])
        return [_pack(raw)]
    if kind == 4:  # unknown kind
        raw["k"] = rng.choice(["", "Nope", "submitrequest", "SubmitRequest ", "__class__", "ProtocolError", 7,
                               None, ["SubmitRequest"], b"SubmitRequest"])
        return [_pack(raw)]
    if kind == 5:  # a field of the wrong type
        if raw["b"]:
            raw["b"][rng.choice(sorted(raw["b"]))] = rng.choice(_ODD_VALUES)
        return [_pack(raw)]
    if kind == 6:  # missing field, extra field
        if raw["b"] and rng.random() < 0.5:
            del raw["b"][rng.choice(sorted(raw["b"]))]
        else:
            raw["b"][rng.choice(["extra", "__init__", "v", "b"])] = 1
        return [_pack(raw)]
    if kind == 7:  # huge lists and strings (a few near the 8 MiB frame limit)
        scale = 50 if rng.random() < 0.03 else 1
        big = rng.choice([list(range(rng.randint(1_000, 4_000) * scale)), ["j" * 32] * (1_000 * scale),
                          "s" * (60_000 * scale), [[[]]] * (2_000 * scale)])
        lists = [k for k, v in raw["b"].items() if isinstance(v, list)] or sorted(raw["b"]) or ["x"]
        raw["b"][rng.choice(lists)] = big
        return [_pack(raw)]
    if kind == 8:  # multipart: extra parts
        return [frame] + [rng.choice([frame, b"", rng.randbytes(8)]) for _ in range(rng.randint(1, 3))]
    if kind == 9:  # empty frames
        return [b""] * rng.randint(1, 3)
    if kind == 10:  # not a map / body not a map / non-string keys
        return [rng.choice([_pack([1, 2, 3]), _pack(7), _pack(None), _pack("v"), _pack(b"bin"),
                            _pack({"v": 1, "k": raw["k"], "b": [1, 2]}), _pack({1: 2, "v": 1}),
                            _pack({"v": 1, "k": raw["k"], "b": {b"api_key": b"x"}}),
                            _pack({"v": 1, "k": raw["k"], "b": raw["b"], "x": 0})])]
    if kind == 11:  # deep nesting
        depth = rng.choice([100, 1_000, 100_000])
        return [b"\x83\xa1v\x01\xa1k" + _pack(raw["k"]) + b"\xa1b" + b"\x91" * depth + b"\xc0"]
    if kind == 12:  # a valid frame of a kind this socket does not take (or does)
        return [frame]
    # trailing garbage after a valid frame
    return [frame + rng.randbytes(rng.randint(1, 16))]


def _send(sock: zmq.Socket, parts: list[bytes], drain) -> None:
    for _ in range(1000):
        try:
            sock.send_multipart(parts, zmq.NOBLOCK)
            return
        except zmq.Again:
            drain()
    raise AssertionError("socket stayed full")


def _refusals(key: str, rng: random.Random) -> list[tuple[P.SubmitRequest, str, str | None]]:
    """Valid frames with a valid key that admission must refuse: (request, error code, field)."""
    def sub(**kw):
        base = dict(api_key=key, max_tokens=4, prompt_token_ids=[5, 6, 7])
        return P.SubmitRequest(**(base | kw))

    return [
        (sub(tier="P0"), "forbidden", None), (sub(tier="P9"), "invalid_request", "tier"),
        (sub(tier=""), "invalid_request", "tier"), (sub(max_tokens=0), "invalid_request", "max_tokens"),
        (sub(max_tokens=-5), "invalid_request", "max_tokens"), (sub(max_tokens=2**63), "invalid_request", "max_tokens"),
        (sub(prompt="both"), "invalid_request", "prompt"), (sub(prompt_token_ids=None), "invalid_request", "prompt"),
        (sub(prompt_token_ids=[]), "invalid_request", "prompt"),
        (sub(prompt_token_ids=[VOCAB]), "invalid_request", "prompt_token_ids"),
        (sub(prompt_token_ids=[-1]), "invalid_request", "prompt_token_ids"),
        (sub(prompt_token_ids=[2**64 - 1]), "invalid_request", "prompt_token_ids"),
        (sub(prompt_token_ids=[3] * 5000), "invalid_request", "prompt"),
        (sub(max_tokens=2047, prompt_token_ids=[3, 4]), "invalid_request", "max_tokens"),
        (sub(temperature=float("nan")), "invalid_request", "temperature"),
        (sub(temperature=float("inf")), "invalid_request", "temperature"),
        (sub(temperature=-0.5), "invalid_request", "temperature"),
        (sub(top_p=0.0), "invalid_request", "top_p"), (sub(top_p=1.5), "invalid_request", "top_p"),
        (sub(top_p=float("nan")), "invalid_request", "top_p"), (sub(top_k=0), "invalid_request", "top_k"),
        (sub(top_k=-3), "invalid_request", "top_k"), (sub(seed=-1), "invalid_request", "seed"),
        (sub(seed=2**63), "invalid_request", "seed"), (sub(idempotency_key=""), "invalid_request", "idempotency_key"),
        (sub(idempotency_key="k" * 201), "invalid_request", "idempotency_key"),
        (P.StreamRequest(key, _jid(rng), -10**9), "not_found", None), (P.StreamRequest(key, "", 0), "not_found", None),
        (P.StatusRequest(key, "../../etc"), "not_found", None), (P.CancelRequest(key, "*"), "not_found", None),
        (P.StatusRequest(key, "x" * 100_000), "not_found", None),
    ]


def _wait_for_frame(sock: zmq.Socket, want, timeout_s: float, sink: list | None = None):
    """Receive [identity, frame] messages on a ROUTER until ``want(msg)``; returns that message."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not sock.poll(int(max(1, (deadline - time.monotonic()) * 1000))):
            break
        parts = sock.recv_multipart()
        try:
            msg = P.decode(parts[-1])
        except P.ProtocolError as e:
            raise AssertionError(f"the worker sent an undecodable frame: {e}") from None
        if sink is not None:
            sink.append(msg)
        if want(msg):
            return msg
    raise AssertionError(f"timed out after {timeout_s}s waiting for a frame")


def test_fuzzed_frames_leave_every_process_up_and_serving(tmp_path, tiny_model_dir, reference):
    rng = random.Random(424242)
    ctx = zmq.Context.instance()
    # Workers connect out to gateways; to reach a worker's decoder, this test is the "gateway" of an extra
    # worker process: it binds a ROUTER and starts `python -m worker --gateway <that endpoint>`.
    fuzz_ep = f"tcp://127.0.0.1:{free_port()}"
    fake_gw = make_socket(ctx, zmq.ROUTER)
    fake_gw.bind(fuzz_ep)
    wlog = (tmp_path / "fuzz-worker.log").open("w")
    fuzz_worker = subprocess.Popen(
        [sys.executable, "-m", "worker", "--worker-id", "wk-fuzz", "--gateway", fuzz_ep, "--model",
         str(tiny_model_dir), "--max-num-seqs", "4", "--num-kv-blocks", "512"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), TS_WORKER_DRAIN_TIMEOUT_S="0",
                           TS_WORKER_TORCH_THREADS="1"),
        stdout=wlog, stderr=subprocess.STDOUT, start_new_session=True)
    cluster_dir = tmp_path / "cluster"
    cluster_dir.mkdir()
    try:
        with local_cluster(cluster_dir, tiny_model_dir, workers=1, max_running=2, http=False) as state:
            key = state["tenants"]["lab-co"]["api_key"]
            gw = state["gateways"][0]

            # -- the gateway's client socket: every single-part frame gets exactly one well-formed reply --
            client_sock = make_socket(ctx, zmq.DEALER)
            client_sock.connect(gw["endpoint"])
            replies: list = []

            def drain_client(block_ms: int = 0) -> None:
                while client_sock.poll(block_ms):
                    replies.append(P.decode(client_sock.recv()))
                    block_ms = 0

            fuzz_started = time.monotonic()
            corpus = _corpus(rng, BAD_KEY)
            expected = 0
            for i in range(8_000):
                parts = _mutate(rng, corpus)
                _send(client_sock, parts, drain_client)
                expected += len(parts) == 1
                if i % 250 == 249:
                    drain_client()
            refusals = _refusals(key, rng)
            before_refusals = expected
            for req, _, _ in refusals:
                _send(client_sock, [P.encode(req)], drain_client)
                expected += 1
            wait_for(lambda: drain_client() or len(replies) >= expected, 60,
                     f"{expected} replies from the gateway's client socket")
            drain_client(200)  # anything beyond one reply per frame would show here
            assert len(replies) == expected
            fuzz_replies, refusal_replies = replies[:before_refusals], replies[before_refusals:]
            bad = [r for r in fuzz_replies
                   if not (isinstance(r, P.ErrorReply) and r.code in ("protocol", "unauthorized"))]
            assert not bad, f"{len(bad)} unexpected replies to fuzz frames, e.g. {bad[:3]}"
            for (req, code, field), reply in zip(refusals, refusal_replies):
                assert isinstance(reply, P.ErrorReply) and (reply.code, reply.field) == (code, field), \
                    (str(req)[:200], reply)
            client_sock.close(linger=0)

            # -- the gateway's worker socket, as an unregistered peer (holding a listed key: CURVE lets it in) --
            worker_socks = []
            for n in range(2):
                s = make_socket(ctx, zmq.DEALER, identity=f"fuzz-wk-{n}".encode())
                curve_client(s, state["keys"]["gateway_public"], state["keys"]["worker_secrets"]["wk-0"])
                s.connect(gw["worker_endpoint"])
                worker_socks.append(s)
            worker_replies: list = []

            def drain_workers() -> None:
                for s in worker_socks:
                    while s.poll(0):
                        worker_replies.append(P.decode(s.recv()))

            corpus = _corpus(rng, BAD_KEY)
            for i in range(2_000):
                _send(worker_socks[i % 2], _mutate(rng, corpus), drain_workers)
                if i % 250 == 249:
                    drain_workers()
            # Over the 8 MiB limit: the gateway's ZeroMQ drops the connection, and nothing else happens.
            oversize = make_socket(ctx, zmq.DEALER)
            monitor = monitor_socket(oversize, zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            oversize.connect(gw["endpoint"])
            oversize.send(b"\x00" * (P.MAX_MESSAGE_BYTES + 1))
            events = []
            try:
                while zmq.EVENT_DISCONNECTED not in events:
                    assert monitor.poll(10_000), f"the gateway kept an oversized frame's connection: {events}"
                    events += monitor_events(monitor)
            finally:
                close_monitor(oversize, monitor)
            # A round trip on each worker socket proves everything before it was processed.
            for n, s in enumerate(worker_socks):
                s.send(_pack({"v": P.SCHEMA_VERSION, "k": f"Marker-{n}", "b": {}}))
            wait_for(lambda: drain_workers() or sum(
                isinstance(r, P.ErrorReply) and "'Marker-" in r.message for r in worker_replies) >= 2,
                     30, "the gateway to get through the worker-socket fuzz")
            assert all(isinstance(r, P.ErrorReply) for r in worker_replies), \
                [r for r in worker_replies if not isinstance(r, P.ErrorReply)][:3]
            internal = [r for r in worker_replies if r.code == "internal"]
            for s in worker_socks + [oversize]:
                s.close(linger=0)

            # -- the extra worker's decoder, through the ROUTER it connected to --
            hello = _wait_for_frame(fake_gw, lambda m: isinstance(m, P.WorkerHello), 90)
            assert hello.worker_id == "wk-fuzz"
            ident = b"wk-fuzz"
            fake_gw.send_multipart([ident, P.encode(P.GatewayWelcome("gw-fuzz"))])
            from_worker: list = []

            def drain_fake_gw() -> None:
                while fake_gw.poll(0):
                    frames = fake_gw.recv_multipart()
                    from_worker.append(m := P.decode(frames[-1]))
                    if isinstance(m, P.JobFinished):  # as a gateway does: else the worker holds it to send again
                        fake_gw.send_multipart([frames[0], P.encode(P.JobFinishedAck(m.job_id, m.attempt))])

            def dispatch(job_id, attempt=1, **kw):
                d = dict(job_id=job_id, attempt=attempt, tier="P3", tenant="lab-co", prompt_token_ids=[5, 6, 7],
                         max_tokens=4, temperature=0.0, top_p=1.0, top_k=None, seed=7, reply_to="gw-fuzz",
                         ignore_eos=True)
                return P.DispatchJob(**(d | kw))

            invalid = [dispatch("bad-tier", tier="P9"), dispatch("bad-ids", prompt_token_ids=[VOCAB]),
                       dispatch("empty", prompt_token_ids=[]), dispatch("neg", prompt_token_ids=[-1]),
                       dispatch("max0", max_tokens=0), dispatch("too-long", max_tokens=5000),
                       dispatch("temp", temperature=float("nan")), dispatch("top-p", top_p=0.0),
                       dispatch("top-k", top_k=0), dispatch("seed", seed=-1),
                       dispatch("huge", prompt_token_ids=[3] * 100_000), dispatch("", max_tokens=2)]
            for m in invalid:
                fake_gw.send_multipart([ident, P.encode(m)])
            # Odd but servable values must not crash a step.
            odd = [dispatch("tiny-temp", temperature=5e-324), dispatch("big-top-k", top_k=2**62),
                   dispatch("tiny-top-p", top_p=5e-324, temperature=1.0), dispatch("p0", tier="P0"),
                   dispatch("unknown-reply-to", reply_to="gw-nowhere")]
            for m in odd:
                fake_gw.send_multipart([ident, P.encode(m)])
            # A re-dispatch that the engine refuses must not leave the first attempt behind.
            fake_gw.send_multipart([ident, P.encode(dispatch("redo", max_tokens=1500))])
            fake_gw.send_multipart([ident, P.encode(dispatch("redo", attempt=2, max_tokens=0))])
            fake_gw.send_multipart([ident, P.encode(dispatch("cancel-me", max_tokens=1500))])
            fake_gw.send_multipart([ident, P.encode(P.CancelJob("cancel-me"))])
            corpus = [m for m in _corpus(rng, BAD_KEY) if not isinstance(m, P.DispatchJob)] + [
                dispatch(f"fz-{i}", max_tokens=rng.randint(1, 6), prompt_token_ids=_ids(rng, 3)) for i in range(4)]
            for _ in range(400):
                parts = _mutate(rng, corpus)
                _send(fake_gw, [ident] + parts, drain_fake_gw)
                drain_fake_gw()
            fuzz_s = time.monotonic() - fuzz_started
            # Every refused dispatch came back failed, naming why.
            want_failed = {m.job_id for m in invalid} | {"redo"}
            wait_for(lambda: drain_fake_gw() or want_failed <= {
                m.job_id for m in from_worker if isinstance(m, P.JobFinished) and m.state == "failed"}, 30,
                     "the worker to refuse every invalid dispatch")
            # ...and it drains: nothing it no longer runs is reported (such a job's lease would never expire).
            since = len(from_worker)

            def idle_report():
                drain_fake_gw()
                loads = [m for m in from_worker[since:] if isinstance(m, P.WorkerLoad)]
                return loads and not loads[-1].job_ids and loads[-1].free_slots == 4 and loads[-1]

            try:
                wait_for(idle_report, 30, "the fuzzed worker to report no jobs")
            except AssertionError:
                loads = [m for m in from_worker[since:] if isinstance(m, P.WorkerLoad)]
                raise AssertionError(f"the fuzzed worker reports jobs it does not run: {loads[-1:]}") from None
            # It still generates exactly the engine's tokens for a normal job.
            fake_gw.send_multipart([ident, P.encode(dispatch("final", prompt_token_ids=[11, 12, 13], max_tokens=24,
                                                             temperature=0.8, seed=99))])
            fin = _wait_for_frame(fake_gw, lambda m: isinstance(m, P.JobFinished) and m.job_id == "final", 30,
                                  from_worker)
            toks = sorted((m.index, m.token_ids) for m in from_worker
                          if isinstance(m, P.JobTokens) and m.job_id == "final")
            flat = [t for _, ids in toks for t in ids]
            assert fin.state == "done" and fin.num_tokens == 24 == len(flat)
            assert flat == reference([([11, 12, 13], 24, 0.8, 99)])[0]
            odd_done = {m.job_id: m for m in from_worker if isinstance(m, P.JobFinished) and m.job_id in
                        {o.job_id for o in odd}}
            assert {o.job_id: (m.state, m.num_tokens) for o in odd for m in [odd_done.get(o.job_id)] if m} == {
                o.job_id: ("done", 4) for o in odd}

            # -- afterwards: every process is up, and the cluster serves a normal job end to end --
            pids = state["gateway_pids"] + [w["pid"] for w in state["workers"]] + [fuzz_worker.pid]
            assert all(process_running(p) for p in pids), {p: process_running(p) for p in pids}
            lab = GatewayClient(gw["endpoint"], key, timeout_s=30)
            try:
                assert lab.info().workers == [w["id"] for w in state["workers"]]  # no phantom registered
                job = lab.submit(prompt_token_ids=[21, 22, 23], max_tokens=16, temperature=0.8, seed=5,
                                 ignore_eos=True)
                s = RawStream(gw["endpoint"], key, job.id)
                s.run()
                s.assert_exactly_once(16)
                assert s.streamed_tokens() == reference([([21, 22, 23], 16, 0.8, 5)])[0]
                assert job_hash(state, job.id)["attempt"] == "1"
            finally:
                lab.close()
            assert not internal, f"the gateway's handlers raised on {len(internal)} worker frames: {internal[:3]}"
    finally:
        stop_process(fuzz_worker, timeout=10)
        wlog.close()
        fake_gw.close(linger=0)
    assert fuzz_s < 60, f"the fuzzing itself took {fuzz_s:.1f}s"
