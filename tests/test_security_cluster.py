"""Security and bounds against a real cluster (scripts/up.py: redis-server with a password, a gateway
with CURVE worker authentication, a worker with its key), attacked as a stranger on the same network
would: workers without the right key, a peer that never said hello, another tenant, a flood of
unauthenticated 8 MB frames; and the Redis password looked for where it must not be."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from common import protocol as P
from common import keys as curve_keys
from common.keys import load_public
from common.ports import free_port
from common.redis_server import RedisServer
from common.sockets import curve_client, make_socket
from gateway.sdk import GatewayClient, NotFound
from tests.cluster_helpers import local_cluster, stop_process, wait_for

ROOT = Path(__file__).resolve().parent.parent
LONG = 600  # tokens: a job that is still running when the test acts on it


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("sec")
    with local_cluster(tmp, tiny_model_dir, workers=1, max_running=4) as state:
        yield state | {"test_dir": tmp}


def _client(cluster, tenant: str, timeout_s: float = 30) -> GatewayClient:
    return GatewayClient(cluster["gateway"], cluster["tenants"][tenant]["api_key"], timeout_s=timeout_s)


def _worker_peer(cluster, identity: bytes, *, secret_file=None, own_pair: bool = False, curve: bool = True):
    """A DEALER on the gateway's worker socket: no CURVE, CURVE with a fresh (unlisted) key pair, or CURVE
    with a listed worker's key file."""
    s = make_socket(zmq.Context.instance(), zmq.DEALER, identity=identity)
    s.setsockopt(zmq.LINGER, 0)
    if curve:
        curve_client(s, load_public(cluster["keys"]["gateway_public"]), None if own_pair else secret_file)
    s.connect(cluster["gateways"][0]["worker_endpoint"])
    return s


def _frames(sock, wait_ms: int) -> list:
    out = []
    while sock.poll(wait_ms):
        out.append(P.decode(sock.recv()))
        wait_ms = 0
    return out


def _hello(worker_id: str, vocab_size: int = 512, max_model_len: int = 2048, model: str | None = None
           ) -> P.WorkerHello:
    return P.WorkerHello(worker_id, model or "", vocab_size, max_model_len, 4, 512)


def _gateway_log(cluster) -> str:
    return (Path(cluster["logs"]) / "gateway-0.log").read_text()


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_workers_without_the_right_key_get_no_job_and_cannot_touch_a_stream(cluster):
    plain = _worker_peer(cluster, b"wk-plain", curve=False)
    stranger = _worker_peer(cluster, b"wk-stranger", own_pair=True)
    model = cluster["logs"]  # any model name: what matters is that nothing is accepted from these peers
    def send(sock, msg) -> None:
        try:  # a DEALER whose handshake never completes may have no pipe to queue on: then it stays here
            sock.send(P.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass

    for s, wid in ((plain, "wk-plain"), (stranger, "wk-stranger")):
        send(s, _hello(wid, model=model))
    client = _client(cluster, "lab-co")
    try:
        jobs = [client.submit(prompt_token_ids=[5, 6, 7], max_tokens=8, ignore_eos=True) for _ in range(4)]
        for s in (plain, stranger):
            for job in jobs:  # tokens and an end for every job, had they got through
                send(s, P.JobTokens(job.id, 1, 0, [9] * 8))
                send(s, P.JobFinished(job.id, 1, "done", "length", 8, 0.0, 0.0, 0))
        results = [job.result(timeout=60) for job in jobs]
        assert all(len(r.token_ids) == 8 and r.token_ids != [9] * 8 for r in results), results
        assert client.info().workers == ["wk-0"]
        assert _frames(plain, 500) == [] and _frames(stranger, 0) == []  # no welcome, no job
        # The unlisted key was refused at the handshake (ZAP), and said so in the gateway's log.
        wait_for(lambda: "refused a CURVE handshake on workers" in _gateway_log(cluster), 10, "the refusal log")
    finally:
        client.close()
        plain.close()
        stranger.close()


def test_a_peer_that_never_said_hello_cannot_inject_tokens(cluster):
    """Even holding a listed worker's key: frames from a peer that has not completed hello are dropped."""
    intruder = _worker_peer(cluster, b"wk-intruder", secret_file=cluster["keys"]["worker_secrets"]["wk-0"])
    client = _client(cluster, "lab-co")
    try:
        job = client.submit(prompt_token_ids=[11, 12, 13], max_tokens=LONG, ignore_eos=True, seed=3)
        stream = job.stream(timeout=60)
        first = next(stream)  # the job is running: its stream is live in the gateway
        intruder.send(P.encode(P.JobTokens(job.id, 1, 0, [9] * (LONG + 50))))
        intruder.send(P.encode(P.JobFinished(job.id, 1, "done", "stop", LONG + 50, 0.0, 0.0, 0)))
        rest = list(stream)
        result = job.result(timeout=120)
        streamed = first.token_ids + [t for c in rest for t in c.token_ids]
        assert len(result.token_ids) == LONG == len(streamed) and result.finish_reason == "length"
        assert streamed == result.token_ids and result.token_ids[-50:] != [9] * 50
        wait_for(lambda: "never said hello" in _gateway_log(cluster), 10, "the dropped-frames log")
    finally:
        client.close()
        intruder.close()


def test_a_worker_the_gateway_does_not_know_is_asked_to_say_hello_at_most_once_a_second(cluster, tiny_model_dir):
    """A restarted gateway (or one the worker timed out at) drops the worker's frames until it says hello; it asks
    for one at once (ErrorReply hello_first) rather than leave the worker's reports and completions unheard until
    its periodic hello. Asked at most once a second however many frames come, and never a peer whose hello it
    refused: that would only repeat the refusal."""
    listed = cluster["keys"]["worker_secrets"]["wk-0"]
    peer = _worker_peer(cluster, b"wk-new", secret_file=listed)
    refused = _worker_peer(cluster, b"wk-refused", secret_file=listed)
    load = P.WorkerLoad("wk-new", 0, 512, {}, {}, [], 0.0)  # no free slot: it must be sent no job
    try:
        for _ in range(20):
            peer.send(P.encode(load))
        (asked,) = _frames(peer, 5_000)
        assert isinstance(asked, P.ErrorReply) and asked.code == P.HELLO_FIRST, asked
        time.sleep(1.1)
        peer.send(P.encode(load))
        (again,) = _frames(peer, 5_000)
        assert again.code == P.HELLO_FIRST
        peer.send(P.encode(_hello("wk-new", model=str(tiny_model_dir))))
        (welcome,) = _frames(peer, 5_000)
        assert isinstance(welcome, P.GatewayWelcome), welcome
        peer.send(P.encode(load))
        assert _frames(peer, 1_500) == []  # known now: its report is taken, nothing to say
        refused.send(P.encode(_hello("wk-refused", model="another-model")))
        (no,) = _frames(refused, 5_000)
        assert no.code == "forbidden"
        time.sleep(1.1)
        refused.send(P.encode(P.WorkerLoad("wk-refused", 4, 512, {}, {}, [], 0.0)))
        assert _frames(refused, 1_500) == []
    finally:
        peer.close()
        refused.close()
        # Gone quiet, wk-new times out here (worker_timeout_s) before any later test's job could be sent to it.
        with _client(cluster, "lab-co") as client:
            wait_for(lambda: client.info().workers == ["wk-0"], 30, "the gateway to forget wk-new")


def test_a_hello_cannot_change_what_admission_accepts(cluster, tiny_model_dir):
    listed = cluster["keys"]["worker_secrets"]["wk-0"]
    small = _worker_peer(cluster, b"wk-small", secret_file=listed)
    client = _client(cluster, "lab-co")
    try:
        for hello, why in ((_hello("wk-small", 4, model=str(tiny_model_dir)), "vocab_size"),
                           (_hello("wk-small", max_model_len=8, model=str(tiny_model_dir)), "max_model_len"),
                           (_hello("wk-small", model="another-model"), "model")):
            small.send(P.encode(hello))
            (reply,) = _frames(small, 10_000)
            assert isinstance(reply, P.ErrorReply) and reply.code == "forbidden", reply
            assert reply.message.startswith(f"hello refused: {why} "), reply
        assert client.info().workers == ["wk-0"]
        # Ids and lengths the small hello would have refused are still admitted and served.
        job = client.submit(prompt_token_ids=[500, 501, 502], max_tokens=32, ignore_eos=True)
        assert len(job.result(timeout=60).token_ids) == 32
    finally:
        client.close()
        small.close()


def _stream_reply(cluster, api_key: str, job_id: str):
    s = make_socket(zmq.Context.instance(), zmq.DEALER)
    s.connect(cluster["gateway"])
    try:
        s.send(P.encode(P.StreamRequest(api_key, job_id, 0)))
        assert s.poll(30_000), "no reply to a StreamRequest"
        return P.decode(s.recv())
    finally:
        s.close(linger=0)


def test_another_tenant_gets_not_found_for_status_stream_and_cancel(cluster):
    owner, other = _client(cluster, "lab-co"), _client(cluster, "batch-co")
    other_key = cluster["tenants"]["batch-co"]["api_key"]
    try:
        job = owner.submit(prompt_token_ids=[21, 22, 23], max_tokens=LONG, ignore_eos=True)
        next(job.stream(timeout=60))  # live: streamed by this gateway, the fast path of StreamRequest
        for state in ("live", "finished"):
            with pytest.raises(NotFound):
                other.status(job.id)
            with pytest.raises(NotFound):
                other.cancel(job.id)
            reply = _stream_reply(cluster, other_key, job.id)
            assert isinstance(reply, P.ErrorReply) and reply.code == "not_found", (state, reply)
            if state == "live":
                assert owner.status(job.id).state in ("dispatched", "queued")
                job.result(timeout=120)
        assert owner.status(job.id).state == "done"  # the other tenant's cancel changed nothing
        assert len(job.result(timeout=5).token_ids) == LONG
    finally:
        owner.close()
        other.close()


def _oversized_frames(n: int) -> list[bytes]:
    """Unauthenticated frames just under the limit, in turn: key-first with a huge text prompt; a million token
    ids placed before the key (as a stranger who knows the decoder would order them); and a million lists of
    seven empty lists (eight million list objects had they been built), as the body of a kind that carries no
    key (a worker's JobTokens) and where the frame's schema version goes."""
    text = P.encode(P.SubmitRequest("stranger", 4, prompt="x" * (P.MAX_MESSAGE_BYTES - 300)))
    import msgpack

    ids_first = msgpack.packb({"v": P.SCHEMA_VERSION, "k": "SubmitRequest", "b": {
        "prompt_token_ids": [70_000] * P.MAX_LIST_LEN, "prompt": "y" * (P.MAX_MESSAGE_BYTES - 5 * P.MAX_LIST_LEN - 300),
        "api_key": "stranger", "max_tokens": 4}})
    lists = P.MAX_LIST_LEN - 64
    nested = b"\xdd" + lists.to_bytes(4, "big") + (b"\x97" + b"\x90" * 7) * lists
    head = b"\x83" + msgpack.packb("v")
    no_key = head + msgpack.packb(P.SCHEMA_VERSION) + msgpack.packb("k") + msgpack.packb("JobTokens") + \
        msgpack.packb("b") + b"\x81" + msgpack.packb("token_ids") + nested
    in_header = head + nested
    frames = [text, ids_first, no_key, in_header]
    assert all(8_000_000 < len(f) <= P.MAX_MESSAGE_BYTES for f in frames), [len(f) for f in frames]
    return [frames[i % len(frames)] for i in range(n)]


def test_forty_unauthenticated_8mb_frames_cost_other_clients_nothing(cluster):
    pid = cluster["gateway_pids"][0]
    frames = _oversized_frames(40)
    client = _client(cluster, "api-co", timeout_s=2)  # "answered within 2 s": a slower answer is a TimeoutError
    client.info()
    before = _rss_bytes(pid)
    peak = [before]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak.append(_rss_bytes(pid))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    flood = make_socket(zmq.Context.instance(), zmq.DEALER)
    flood.connect(cluster["gateway"])
    answered = []
    try:
        sender = threading.Thread(target=lambda: [flood.send(f, copy=False) for f in frames], daemon=True)
        sender.start()
        replies = []
        deadline = time.monotonic() + 120
        while len(replies) < len(frames) and time.monotonic() < deadline:
            t0 = time.monotonic()
            answered.append(client.info().gateway_id)  # raises TimeoutError past 2 s
            answered[-1] = time.monotonic() - t0
            while flood.poll(0):
                replies.append(P.decode(flood.recv()))
        sender.join(timeout=60)
        assert len(replies) == len(frames), f"{len(replies)} of {len(frames)} refusals came back"
        assert all(isinstance(r, P.ErrorReply) and r.code in ("unauthorized", "protocol") for r in replies), replies[:4]
        assert [r.code for r in replies[:4]] == ["unauthorized"] * 3 + ["protocol"], replies[:4]
        job = client.submit(prompt_token_ids=[1, 2, 3], max_tokens=4, ignore_eos=True)
        assert len(job.result(timeout=60).token_ids) == 4
    finally:
        stop.set()
        sampler.join(timeout=5)
        flood.close(linger=0)
        client.close()
    grown = max(peak) - before
    assert grown < 100 * 2**20, f"the gateway grew by {grown / 2**20:.0f} MiB under the flood"
    assert answered, "no request of the other client was made during the flood"


def test_the_redis_password_is_in_no_log_and_no_command_line(cluster):
    from urllib.parse import urlsplit

    password = urlsplit(cluster["redis"]).password
    assert password and len(password) >= 32
    redis_pid = int(cluster["redis_client"].info("server")["process_id"])
    for pid in [redis_pid, *cluster["gateway_pids"], *(w["pid"] for w in cluster["workers"])]:
        assert password.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
    logs = list(Path(cluster["logs"]).glob("*.log")) + [cluster["test_dir"] / "up.log"]
    assert len(logs) == 4  # gateway, worker, the HTTP front door, up.py
    for log in logs:
        assert password not in log.read_text(errors="replace"), log
    state_file = cluster["test_dir"] / "cluster.json"
    assert not (state_file.stat().st_mode & 0o077), "the state file holds the Redis URL: owner-only"


# --- gateways that must not start ------------------------------------------------------------------------------

def _run_gateway(tmp_path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "a"\napi_key = "k"\ntiers = ["P3"]\n')
    return subprocess.run([sys.executable, "-m", "gateway", "--tenants-file", str(tenants),
                           "--client-bind", f"tcp://127.0.0.1:{free_port()}", *args], cwd=ROOT,
                          # Redis at a port where nothing listens unless ``env`` names one: a check that let the
                          # configuration through is then a refusal at once, not a gateway serving against whatever
                          # listens at the default URL (or the caller's TS_GATEWAY_REDIS_URL) until the timeout.
                          env=dict(os.environ, PYTHONPATH=str(ROOT), OTEL_SDK_DISABLED="true",
                                   TS_GATEWAY_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0") | (env or {}),
                          capture_output=True, text=True, timeout=60)


def test_a_gateway_without_worker_keys_refuses_to_start(tmp_path):
    done = _run_gateway(tmp_path, "--worker-bind", f"tcp://127.0.0.1:{free_port()}")
    assert done.returncode == 2 and "no worker keys" in done.stderr, done.stderr
    done = _run_gateway(tmp_path, "--insecure-workers", "--worker-bind", f"tcp://0.0.0.0:{free_port()}")
    assert done.returncode == 2 and "only binds loopback" in done.stderr, done.stderr


def test_a_wrong_redis_password_is_not_printed(tmp_path):
    with RedisServer(password="right-password-1234") as server:
        url = f"redis://:wrong-password-5678@127.0.0.1:{server.port}/0"
        done = _run_gateway(tmp_path, "--insecure-workers", "--worker-bind", f"tcp://127.0.0.1:{free_port()}",
                            env={"TS_GATEWAY_REDIS_URL": url})
    assert done.returncode == 2 and "cannot reach Redis" in done.stderr, done.stderr
    assert "wrong-password-5678" not in done.stderr + done.stdout and "***" in done.stderr


@pytest.mark.parametrize("case", ["unlisted key", "wrong gateway key", "no keys"])
def test_a_worker_whose_keys_do_not_match_says_why_in_its_log(cluster, tiny_model_dir, tmp_path, case):
    """A worker a gateway refuses at the handshake used to idle with nothing in its log: the operator learnt of it
    only from the gateway's side, if at all. Its log now names the gateway and the setting to fix; it gets no job."""
    own = curve_keys.generate(tmp_path / "keys", ["wk-odd"])
    secret, gateway_key = {
        "unlisted key": (own["worker:wk-odd"], cluster["keys"]["gateway_public"]),
        "wrong gateway key": (cluster["keys"]["worker_secrets"]["wk-0"], own["gateway_public"]),
        "no keys": ("", ""),
    }[case]
    says = {"unlisted key": "refused this worker's CURVE key",
            "wrong gateway key": "closed the connection during the CURVE handshake",
            "no keys": "requires CURVE on its worker socket"}[case]
    endpoint = cluster["gateways"][0]["worker_endpoint"]
    log_path = tmp_path / "worker.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT), TS_WORKER_CURVE_SECRET_KEY_FILE=str(secret),
               TS_WORKER_GATEWAY_PUBLIC_KEY=str(gateway_key), TS_WORKER_TORCH_THREADS="1")
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "worker", "--worker-id", "wk-odd", "--model",
                                 str(tiny_model_dir), "--gateway", endpoint], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        def told() -> bool:
            assert proc.poll() is None, log_path.read_text()
            return says in log_path.read_text()
        wait_for(told, 60, f"the worker to say {says!r}")
        line = next(ln for ln in log_path.read_text().splitlines() if says in ln)
        assert endpoint in line, line
        time.sleep(2)  # a refusing gateway is reconnected to every ~0.1 s: ~20 refusals more
        assert log_path.read_text().count(says) == 1, log_path.read_text()  # said once (a minute), not each time
        with _client(cluster, "lab-co") as client:
            assert client.info().workers == ["wk-0"]
    finally:
        stop_process(proc, timeout=15)
