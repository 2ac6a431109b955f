"""What an idempotency key's fingerprint counts as one request (gateway/admission.fingerprint): the request its client
sent, not how the cluster resolved it, nor how a number happened to be packed. Real redis-server, gateway and
workers (tests/durable_cluster.py), a real `python -m gateway.http` door, real HTTP and ZeroMQ clients."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid

import httpx
import msgpack
import pytest
import zmq

from common import protocol as P
from common.tiers import Tier
from gateway import admission
from gateway.http.sizing import LIMITS_MAX_AGE_S
from gateway.sdk import AsyncGatewayClient
from gateway.sdk._common import submit_request
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster
from tests.test_http import front_door


class _TwoSizes(DurableCluster):
    """One gateway; workers started by the test: wk-small with 4 KV blocks of 16 tokens, wk-big the default pool."""

    def __init__(self, tmp_path, model_dir) -> None:
        super().__init__(tmp_path, model_dir, gateways=1, workers=0)

    def _cmd(self, name: str) -> list[str]:
        return super()._cmd(name) + (["--num-kv-blocks", "4"] if name == "wk-small" else [])

    def add_worker(self, name: str) -> None:
        self.worker_ids.append(name)
        self.start_process(name)
        self.wait_workers("gw-0")


def _limit(c: DurableCluster, tenant: str, tier: str) -> int:
    with c.client(tenant, timeout_s=10) as sdk:
        return sdk.info(limits=True).tier_token_limits[tier]


def test_a_retry_without_max_tokens_is_the_same_request_after_the_limits_moved(tmp_path, tiny_model_dir):
    """The door fills in a missing max_tokens from the room the gateway's limits leave the prompt; the fingerprint
    held the resolved number. A worker of another size joined between a request and its retry (same key, same
    body): the retry resolved another max_tokens and was refused 422, idempotency key reused, for the very request
    that key had started."""
    with _TwoSizes(tmp_path, tiny_model_dir) as c:
        c.add_worker("wk-small")
        small = _limit(c, "api-co", "P1")  # api-co's highest tier: the door's default
        prompt = [5] * (small - 4)  # room 4, under a completion's default of 16
        with front_door(tiny_model_dir, [c.endpoint()], tmp_path / "door.log") as base:
            headers = {"Authorization": f"Bearer {c.key('api-co')}", "Idempotency-Key": uuid.uuid4().hex}
            body = {"prompt": prompt, "ignore_eos": True}
            first = httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=120)
            assert first.status_code == 200, first.text
            assert first.json()["usage"]["completion_tokens"] == 4
            c.add_worker("wk-big")
            wait_for(lambda: _limit(c, "api-co", "P1") > small + 16, 30, "the big worker's limits")
            time.sleep(LIMITS_MAX_AGE_S + 0.5)  # the door asks the gateway's limits of now: room for 16
            again = httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=120)
            assert again.status_code == 200, again.text
            assert again.headers["X-Request-Id"] == first.headers["X-Request-Id"]
            assert again.headers["Idempotent-Replayed"] == "true"
            assert again.json()["choices"] == first.json()["choices"]
            # An explicit max_tokens is the client's: another one under the key is another request.
            other = httpx.post(base + "/v1/completions", json=body | {"max_tokens": 5}, headers=headers, timeout=120)
            assert other.status_code == 422, other.text
            assert other.json()["error"]["code"] == "idempotency_key_reused"
            # Sent without the key, the same body now gets the room of now: the limits did move.
            plain = httpx.post(base + "/v1/completions", json=body, headers={"Authorization": headers["Authorization"]},
                               timeout=120)
            assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 16, plain.text


def _submit(sock, key: str, idem: str, request_id: str, **fields):
    sock.send(P.encode(P.SubmitRequest(key, fields.pop("max_tokens", 4), prompt_token_ids=[5, 6, 7], tier="P3",
                                       idempotency_key=idem, request_id=request_id, **fields)))
    assert sock.poll(30_000), "no answer from the gateway"
    return P.decode(sock.recv())


@pytest.fixture(scope="module")
def raw_cluster(tmp_path_factory, tiny_model_dir):
    """One gateway, no worker: the raw-client tests below each use keys of their own (uuid4), and jobs that stay
    queued; a cluster each cost ~4 s of start and stop."""
    with DurableCluster(tmp_path_factory.mktemp("raw"), tiny_model_dir, gateways=1, workers=0) as c:
        yield c


@pytest.mark.parametrize("first,then", [
    ({"temperature": 0.0}, {"temperature": 0}),
    ({"top_p": 1}, {"top_p": 1.0}),
    ({"temperature": 1, "top_p": 0.5}, {"temperature": 1.0, "top_p": 0.5}),
])
def test_a_raw_client_retrying_with_an_int_for_a_float_is_the_same_request(raw_cluster, first, then):
    """temperature and top_p were packed into the fingerprint as sent: a raw ZeroMQ client (the SDK converts to
    float) that sent 0.0 and retried with 0 was told its key was used for another request."""
    c = raw_cluster
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.connect(c.endpoint())
        idem = uuid.uuid4().hex
        a = _submit(sock, c.key("lab-co"), idem, "r1", **first)
        assert isinstance(a, P.SubmitReply) and not a.duplicate, a
        b = _submit(sock, c.key("lab-co"), idem, "r2", **then)
        assert isinstance(b, P.SubmitReply), b
        assert b.job_id == a.job_id and b.duplicate
        c3 = _submit(sock, c.key("lab-co"), idem, "r3", **(then | {"temperature": 0.5}))
        assert isinstance(c3, P.ErrorReply) and c3.field == "idempotency_key", c3
    finally:
        sock.close(linger=0)


def test_a_retry_sending_minus_zero_is_the_same_request(raw_cluster):
    """-0.0 == 0.0, but msgpack packs them apart: a client of its own (not P.encode, which leaves a field equal to its
    default out) whose encoder wrote -0.0 on a retry was refused, its key used for another request."""
    c = raw_cluster
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.connect(c.endpoint())
        idem = uuid.uuid4().hex
        a = _submit(sock, c.key("lab-co"), idem, "r1", temperature=0.5)
        assert isinstance(a, P.SubmitReply) and not a.duplicate, a
        b = _submit(sock, c.key("lab-co"), idem, "r2", temperature=0.0)  # another request: refused
        assert isinstance(b, P.ErrorReply) and b.field == "idempotency_key", b
        idem = uuid.uuid4().hex
        a = _submit(sock, c.key("lab-co"), idem, "r3", temperature=0.0, top_p=0.5)
        assert isinstance(a, P.SubmitReply) and not a.duplicate, a
        body = {"api_key": c.key("lab-co"), "max_tokens": 4, "prompt_token_ids": [5, 6, 7], "temperature": -0.0,
                "top_p": 0.5, "tier": "P3", "idempotency_key": idem, "request_id": "r4"}
        sock.send(msgpack.packb({"v": P.SCHEMA_VERSION, "k": "SubmitRequest", "b": body}, use_bin_type=True))
        assert sock.poll(30_000), "no answer from the gateway"
        b = P.decode(sock.recv())
        assert isinstance(b, P.SubmitReply), b
        assert b.job_id == a.job_id and b.duplicate
    finally:
        sock.close(linger=0)


def test_the_fingerprint_of_what_the_sdk_sends_is_unchanged():
    """Keys live 24 h across an upgrade: a request the SDK sends keeps the fingerprint stored before (these values
    are the fingerprints of the release before)."""
    req = submit_request("k", None, [5, 6, 7], 12, 0, 1, None, None, "P2", "key-1", False)
    assert admission.fingerprint(req, admission.Admission(None, Tier.P2, [5, 6, 7])) == \
        "2eb81eb11baccd91fb629ad5f6099302"
    req = submit_request("k", None, [1, 2, 3, 4], 40, 0.7, 0.9, 20, 12, "P1", "key-2", True)
    assert admission.fingerprint(req, admission.Admission(None, Tier.P1, [1, 2, 3, 4])) == \
        "fd6a50959203799961299650d2cb994b"
    # -0.0 == 0.0: a client whose encoder writes -0.0 asks for what the SDK's 0.0 asks for.
    minus = submit_request("k", None, [5, 6, 7], 12, -0.0, 1, None, None, "P2", "key-1", False)
    assert minus.temperature == 0.0 and str(minus.temperature) == "-0.0"
    assert admission.fingerprint(minus, admission.Admission(None, Tier.P2, [5, 6, 7])) == \
        "2eb81eb11baccd91fb629ad5f6099302"


# The gateway of the release before SubmitRequest.max_tokens_defaulted: the real gateway, run with SubmitRequest as it
# was then (the field unknown to its decoder, so refused as a protocol error) and that release's fingerprint.
OLDER_GATEWAY = """
import dataclasses, hashlib, runpy, sys
import msgpack
from common import client_messages as m, protocol as P
from gateway import admission
fields = [(f.name, f.type, f) for f in dataclasses.fields(m.SubmitRequest) if f.name != "max_tokens_defaulted"]
Older = dataclasses.make_dataclass("SubmitRequest", fields, frozen=True, namespace={"max_tokens_defaulted": False})
m.SubmitRequest = P.SubmitRequest = P.MESSAGES["SubmitRequest"] = Older
def fingerprint(req, adm):
    asked = [adm.prompt_token_ids, req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed,
             adm.tier_requested.value, bool(req.ignore_eos)]
    return hashlib.sha256(msgpack.packb(asked)).hexdigest()[:32]
admission.fingerprint = admission.fingerprint_before = fingerprint
sys.argv = ["gateway"] + sys.argv[1:]
runpy.run_module("gateway", run_name="__main__")
"""


class _OlderAndNewer(DurableCluster):
    """gw-0 of the release before, gw-1 of this one, on one Redis: a rolling upgrade."""

    def __init__(self, tmp_path, model_dir) -> None:
        super().__init__(tmp_path, model_dir, gateways=2, workers=0)

    def _cmd(self, name: str) -> list[str]:
        cmd = super()._cmd(name)
        return [sys.executable, "-c", OLDER_GATEWAY, *cmd[3:]] if name == "gw-0" else cmd


def test_keys_stored_by_the_release_before_still_name_their_requests(tmp_path, tiny_model_dir):
    """An upgrade must not turn a retry into a 422: a key the release before stored (24 h) holds its fingerprint,
    which left nothing out, and a new SDK's request must still reach an older gateway."""
    with _OlderAndNewer(tmp_path, tiny_model_dir) as c:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        try:
            sock.connect(c.endpoint("gw-0"))
            key = c.key("lab-co")
            refused = _submit(sock, key, uuid.uuid4().hex, "r0", max_tokens_defaulted=True)
            assert isinstance(refused, P.ErrorReply) and refused.code == "protocol", refused  # as an older one does
            # The older door sent the max_tokens it sized, and a raw client an int temperature.
            idem, ints = uuid.uuid4().hex, uuid.uuid4().hex
            first = _submit(sock, key, idem, "r1")
            raw = _submit(sock, key, ints, "r2", temperature=0, top_p=1)
            assert isinstance(first, P.SubmitReply) and isinstance(raw, P.SubmitReply), (first, raw)
            sock.disconnect(c.endpoint("gw-0"))
            sock.connect(c.endpoint("gw-1"))
            again = _submit(sock, key, idem, "r3", max_tokens_defaulted=True)
            assert isinstance(again, P.SubmitReply) and again.duplicate and again.job_id == first.job_id, again
            raw_again = _submit(sock, key, ints, "r4", temperature=0, top_p=1)
            assert isinstance(raw_again, P.SubmitReply) and raw_again.job_id == raw.job_id, raw_again
            other = _submit(sock, key, idem, "r5", max_tokens=5)  # another max_tokens, the client's: refused
            assert isinstance(other, P.ErrorReply) and other.field == "idempotency_key", other
        finally:
            sock.close(linger=0)
        # The SDK, told of a defaulted max_tokens, sends it again without the field to a gateway that refuses it.
        with c.client("lab-co", gw="gw-0", timeout_s=10) as sdk:
            job = sdk.submit(prompt_token_ids=[5, 6], max_tokens=3, tier="P3", idempotency_key=uuid.uuid4().hex,
                             max_tokens_defaulted=True)
            assert not job.duplicate and c.state(job.id) == "queued"

        async def submit_async():
            async with AsyncGatewayClient(c.endpoint("gw-0"), key, timeout_s=10) as sdk:
                return await sdk.submit(prompt_token_ids=[5, 6], max_tokens=3, tier="P3", max_tokens_defaulted=True)

        assert c.state(asyncio.run(submit_async()).id) == "queued"
