"""Security and bounds, the parts that need no cluster: the codec's order of work, tenant-file rules,
key files, the Redis password's path, incremental detokenisation (counted, not timed)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import zmq

from common import keys
from common import protocol as P
from common.redis_server import RedisServer, config_line, redact_url
from common.settings import ConfigError
from common.sockets import is_loopback_endpoint
from gateway.config import GatewayConfig
from gateway.detokenize import IncrementalText
from gateway.security import check_config
from gateway.streams import StreamTable
from gateway.tenants import TenantDirectory, key_digest

ROOT = Path(__file__).resolve().parent.parent


# --- the codec: the API key before anything expensive ------------------------------------------------------

def _frame(body: dict, kind: str = "SubmitRequest") -> bytes:
    return msgpack.packb({"v": P.SCHEMA_VERSION, "k": kind, "b": body}, use_bin_type=True)


def test_an_unknown_key_is_refused_before_the_rest_of_the_body_is_read():
    seen = []
    # A body of 12 entries whose first is the key and the rest not even msgpack: had the decoder read past
    # the key, the error would be a parse error.
    head = b"\x83" + msgpack.packb("v") + msgpack.packb(1) + msgpack.packb("k") + msgpack.packb("SubmitRequest") + \
        msgpack.packb("b") + b"\x8c" + msgpack.packb("api_key") + msgpack.packb("stranger")
    frame = head + b"\xc1" * (P.MAX_MESSAGE_BYTES - len(head))  # 0xc1 is never valid msgpack
    with pytest.raises(P.Unauthenticated, match="unknown API key"):
        P.decode(frame, authorize=lambda k: seen.append(k) and False)
    assert seen == ["stranger"]
    # Without an authorize step (other sockets) the same frame is a plain protocol error.
    with pytest.raises(P.ProtocolError) as e:
        P.decode(frame)
    assert not isinstance(e.value, P.Unauthenticated)


def test_the_key_must_come_first_when_it_is_checked():
    frame = _frame({"max_tokens": 4, "prompt_token_ids": [1, 2], "api_key": "k"})
    with pytest.raises(P.Unauthenticated, match="must come first"):
        P.decode(frame, authorize=lambda k: True)
    assert P.decode(frame).api_key == "k"  # the order rule is only for the authorized socket
    assert P.decode(P.encode(P.SubmitRequest("k", 4, prompt_token_ids=[1])), authorize=lambda k: True).api_key == "k"
    assert P.Unauthenticated.code == "unauthorized" and P.ProtocolError.code == "protocol"


def test_a_message_that_carries_no_key_is_refused_unread_on_the_client_socket():
    """A worker's or a reply's kind carries no API key: on the client socket it is a stranger's frame, refused
    before its body is read (it used to be unpacked whole, and only then refused as not accepted there)."""
    head = b"\x83" + msgpack.packb("v") + msgpack.packb(1) + msgpack.packb("k") + msgpack.packb("JobTokens") + \
        msgpack.packb("b") + b"\x84"
    frame = head + b"\xc1" * (P.MAX_MESSAGE_BYTES - len(head))
    with pytest.raises(P.Unauthenticated, match="no API key"):
        P.decode(frame, authorize=lambda k: True)
    with pytest.raises(P.ProtocolError, match="not a valid msgpack"):  # elsewhere it is read as before
        P.decode(frame)


def _nested(n: int) -> bytes:
    """n lists of seven empty lists: eight containers every eight bytes."""
    return b"\xdd" + n.to_bytes(4, "big") + (b"\x97" + b"\x90" * 7) * n


_HEAD = b"\x83" + msgpack.packb("v")


@pytest.mark.parametrize("frame", [
    _HEAD + _nested(2**17),  # where the schema version goes
    _HEAD + msgpack.packb(1) + msgpack.packb("k") + msgpack.packb("SubmitRequest") + msgpack.packb("b") + b"\x82"
    + _nested(2**17),  # where the API key's name goes
    _HEAD + msgpack.packb(1) + msgpack.packb("k") + msgpack.packb("SubmitRequest") + msgpack.packb("b") + b"\x83"
    + msgpack.packb("api_key") + msgpack.packb("known") + msgpack.packb("prompt_token_ids") + _nested(2**17)
    + msgpack.packb("max_tokens") + msgpack.packb(4),  # a field's value, behind a valid key
], ids=["header", "key-name", "field"])
def test_nested_lists_are_refused_before_they_are_built(frame):
    """1 MiB of nested empty lists is a million list objects (60 MiB; an 8 MiB frame took 580 MiB and 2.5 s of
    the gateway's loop), however the frame is refused after: the decoder stops at a cap on lists and maps."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(P.ProtocolError):
            P.decode(frame, authorize=lambda k: k == "known")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * 2**20, f"decoding took {peak / 2**20:.0f} MiB"


def test_a_refused_frame_is_read_again_for_its_request_id_under_the_same_caps():
    """A refusal goes back with the frame's request id, so the gateway reads a small refused frame (<= 64 KiB)
    again for it: that read built 64 K lists of a frame of nested empty lists, 14 ms of the loop per stranger's
    frame that the decoder itself refused in microseconds."""
    import tracemalloc

    from gateway.server import _request_id_of

    n = (64 * 1024 - 32) // 8
    frame = _HEAD + b"\xdd" + n.to_bytes(4, "big") + (b"\x97" + b"\x90" * 7) * n
    tracemalloc.start()
    try:
        assert _request_id_of(frame) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 512 * 2**10, f"reading it again took {peak / 2**10:.0f} KiB"
    stranger = P.encode(P.SubmitRequest("stranger", 4, prompt_token_ids=[1] * 1000, request_id="r-7"))
    assert _request_id_of(stranger) == "r-7"


@pytest.mark.parametrize("body,why", [
    ({"job_id": "j", "attempt": 1, "index": 0, "token_ids": [1, True]}, "wrong type"),  # a bool is no token id
    ({"job_id": "j", "attempt": 1, "index": 0, "token_ids": [1, 2.0]}, "wrong type"),
    ({"job_id": "j", "attempt": 1, "index": 0, "token_ids": [1, "2"]}, "wrong type"),
    ({"job_id": "j", "attempt": 1, "index": 0, "token_ids": [0] * (P.MAX_LIST_LEN + 1)}, "max_array_len"),
])
def test_list_elements_are_checked_in_one_pass_and_lengths_capped_first(body, why):
    with pytest.raises(P.ProtocolError, match=why):
        P.decode(_frame(body, "JobTokens"))


def test_maps_extra_bytes_and_binary_are_refused():
    with pytest.raises(P.ProtocolError, match="max_map_len"):
        P.decode(_frame({"api_key": "k", "max_tokens": 1,
                         "trace_context": {str(i): "x" for i in range(P.MAX_MAP_LEN + 1)}}))
    with pytest.raises(P.ProtocolError, match="extra bytes"):
        P.decode(P.encode(P.InfoRequest("k")) + b"\x00")
    with pytest.raises(P.ProtocolError, match="max_bin_len"):
        P.decode(_frame({"api_key": b"k"}, "InfoRequest"))
    token_ids = list(range(1000))
    assert P.decode(P.encode(P.JobTokens("j", 1, 0, token_ids))).token_ids == token_ids


# --- tenants file ---------------------------------------------------------------------------------------------

def _tenants(tmp_path, body: str) -> TenantDirectory:
    path = tmp_path / "tenants.toml"
    path.write_text(body)
    return TenantDirectory.from_file(path)


def test_an_upper_case_key_digest_matches(tmp_path):
    digest = key_digest("the-key").upper()
    d = _tenants(tmp_path, f'[[tenant]]\nname = "a"\napi_key_sha256 = "{digest}"\ntiers = ["P3"]\n')
    assert d.lookup("the-key").name == "a"
    with pytest.raises(ConfigError, match="64 hexadecimal"):
        _tenants(tmp_path, '[[tenant]]\nname = "a"\napi_key_sha256 = "abc"\ntiers = ["P3"]\n')


@pytest.mark.parametrize("rate", ["0", "0.0", "-1", "true", '"2"', "inf"])
def test_a_p0_rate_of_zero_is_refused_not_unlimited(tmp_path, rate):
    with pytest.raises(ConfigError, match="p0_rate_per_s must be a number > 0"):
        _tenants(tmp_path, f'[[tenant]]\nname = "a"\napi_key = "k"\ntiers = ["P0"]\np0_rate_per_s = {rate}\n')


def test_two_tenants_with_one_key_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="same API key"):
        _tenants(tmp_path, '[[tenant]]\nname = "a"\napi_key = "k"\ntiers = ["P3"]\n'
                           f'[[tenant]]\nname = "b"\napi_key_sha256 = "{key_digest("k")}"\ntiers = ["P3"]\n')


# --- keys -------------------------------------------------------------------------------------------------------

def test_keygen_command_writes_pairs_and_an_allow_list_of_public_keys(tmp_path):
    out = tmp_path / "keys"
    done = subprocess.run([sys.executable, "-m", "common.keys", "--out", str(out), "--workers", "wk-a", "wk-b"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    allow = keys.load_allow_list(out / keys.ALLOW_LIST_DIR)
    pub_a, sec_a = keys.load_pair(out / "workers" / "wk-a.key_secret")
    assert pub_a in allow and len(allow) == 2 and sec_a not in allow
    assert not list((out / keys.ALLOW_LIST_DIR).glob("*secret*"))
    for secret in [out / "gateway.key_secret", *(out / "workers").glob("*.key_secret")]:
        assert stat.S_IMODE(os.stat(secret).st_mode) & 0o077 == 0, secret
    # Run again: nothing is overwritten (a key in use keeps working).
    subprocess.run([sys.executable, "-m", "common.keys", "--out", str(out), "--workers", "wk-a"], cwd=ROOT,
                   check=True, capture_output=True, timeout=60)
    assert keys.load_pair(out / "workers" / "wk-a.key_secret") == (pub_a, sec_a)
    helped = subprocess.run([sys.executable, "-m", "common.keys", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert helped.returncode == 0 and "authorized_workers" in helped.stdout


def test_loopback_endpoints():
    assert all(map(is_loopback_endpoint, ["tcp://127.0.0.1:1", "tcp://localhost:2", "tcp://[::1]:3", "ipc:///x"]))
    assert not any(map(is_loopback_endpoint, ["tcp://0.0.0.0:1", "tcp://*:2", "tcp://10.0.0.1:3", "tcp://gw:4"]))


# --- the Redis password ------------------------------------------------------------------------------------------

def test_an_endpoint_called_loopback_binds_only_loopback():
    """libzmq reads "source;destination" in a bind's address too and binds the destination: the first of these
    bound every interface while --insecure-workers took it for loopback. Each is bound for real here, and must be
    called loopback exactly when what it bound is."""
    from common.ports import free_port

    ctx = zmq.Context.instance()
    for template in ("tcp://127.0.0.1:0;0.0.0.0:{}", "tcp://127.0.0.1:0;*:{}", "tcp://127.0.0.1:{}",
                     "tcp://0.0.0.0:0;127.0.0.1:{}", "tcp://0.0.0.0:{}", "tcp://[::1]:0;[::1]:{}"):
        endpoint = template.format(free_port())
        sock = ctx.socket(zmq.ROUTER)
        try:
            if "[" in endpoint:
                sock.setsockopt(zmq.IPV6, 1)
            try:
                sock.bind(endpoint)
            except zmq.ZMQError:  # no IPv6 here: nothing bound, nothing to compare
                continue
            bound = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            assert is_loopback_endpoint(endpoint) == is_loopback_endpoint(bound), (endpoint, bound)
        finally:
            sock.close(linger=0)
    with pytest.raises(ConfigError, match="only binds loopback"):
        check_config(GatewayConfig(insecure_workers=True, worker_bind="tcp://127.0.0.1:0;0.0.0.0:5556"))


def test_the_redis_password_is_in_no_argv_and_redacted_from_urls():
    password = 'a "quoted\\ pass$word'
    with RedisServer(password=password) as server:
        cmdline = Path(f"/proc/{server._proc.pid}/cmdline").read_bytes()
        assert password.encode() not in cmdline
        conf = server.dir / "redis.conf"
        assert stat.S_IMODE(conf.stat().st_mode) == 0o600
        assert server.client().ping()
        assert password not in redact_url(f"cannot reach {server.url}: refused")
    assert redact_url("redis://user:pw@h:1/0 rediss://:x%40y@h/1") == "redis://user:***@h:1/0 rediss://:***@h/1"
    assert config_line("requirepass", 'a"b') == 'requirepass "a\\"b"\n'


# --- streamed text: linear in the output ------------------------------------------------------------------------

class CountingTokenizer:
    """The real tokenizer, counting every token any decode is given (the backend's DecodeStream steps
    are counted by IncrementalText itself)."""

    def __init__(self, tokenizer) -> None:
        self.inner = tokenizer
        self.backend_tokenizer = tokenizer.backend_tokenizer
        self.decoded_tokens = 0

    def decode(self, ids, **kw):
        self.decoded_tokens += len(ids)
        return self.inner.decode(ids, **kw)


def test_a_2048_token_stream_decodes_each_token_once(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = CountingTokenizer(AutoTokenizer.from_pretrained(tiny_model_dir))
    made: list[IncrementalText] = []

    def incremental():
        made.append(IncrementalText(tok))
        return made[-1]

    table = StreamTable(lambda ids: tok.decode(ids, skip_special_tokens=True), incremental)
    s = table.get_or_create("job")
    s.subscribers[b"client"] = 0
    n = 2048
    ids = [(i * 7919) % 500 + 3 for i in range(n)]
    texts = []
    for i in range(n):  # one token per chunk: the worst case for the old prefix re-decoding
        assert table.add_tokens("job", i, ids[i:i + 1], now=float(i))
        for _, start, chunk in table.pending_chunks("job"):
            texts.append(table.chunk_text("job", start))
    stepped = sum(d.tokens_decoded for d in made)
    assert stepped + tok.decoded_tokens == n, (stepped, tok.decoded_tokens)  # re-decoding would be ~n*n
    assert len(texts) == n
    # The final text (what JobDone carries) is the chunks joined, computed in one more linear pass.
    final = table.text(ids, [])
    assert final == "".join(texts)
    assert sum(d.tokens_decoded for d in made) + tok.decoded_tokens == 2 * n
    # ...and it agrees with decoding everything at once, up to an unfinished UTF-8 tail.
    whole = tok.inner.decode(ids, skip_special_tokens=True)
    assert whole.startswith(final) and not whole[len(final):].strip("\ufffd")


def test_zmq_has_curve():
    assert zmq.has("curve")


@pytest.mark.parametrize("name", ["5", "true", '""', '["a"]'])
def test_a_tenant_name_that_is_not_a_string_is_refused(tmp_path, name):
    # Jobs are owned by the name as Redis holds it, a string: name = 5 and name = "5" were two tenants in the file
    # and one in Redis, each seeing and cancelling the other's jobs; and a tenant named 5 could not read its own.
    with pytest.raises(ConfigError, match="name must be a non-empty string") as e:
        _tenants(tmp_path, f'[[tenant]]\nname = {name}\napi_key = "k"\ntiers = ["P3"]\n')
    assert str(e.value).count("tenant #1") == 1, "where it is, once"

