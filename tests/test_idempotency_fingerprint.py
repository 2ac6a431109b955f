"""What an idempotency key's fingerprint counts as one request (gateway/admission.fingerprint): the request its client
sent, not how the cluster resolved it, nor how a number happened to be packed. Real redis-server, gateway and
workers (tests/durable_cluster.py), a real `python -m gateway.http` door, real HTTP and ZeroMQ clients."""

from __future__ import annotations

import uuid

import pytest
import zmq

from common import protocol as P
from common.tiers import Tier
from gateway import admission
from gateway.sdk._common import submit_request
from tests.durable_cluster import DurableCluster


def _submit(sock, key: str, idem: str, request_id: str, **numbers):
    sock.send(P.encode(P.SubmitRequest(key, 4, prompt_token_ids=[5, 6, 7], tier="P3", idempotency_key=idem,
                                       request_id=request_id, **numbers)))
    assert sock.poll(30_000), "no answer from the gateway"
    return P.decode(sock.recv())


@pytest.mark.parametrize("first,then", [
    ({"temperature": 0.0}, {"temperature": 0}),
    ({"top_p": 1}, {"top_p": 1.0}),
    ({"temperature": 1, "top_p": 0.5}, {"temperature": 1.0, "top_p": 0.5}),
])
def test_a_raw_client_retrying_with_an_int_for_a_float_is_the_same_request(tmp_path, tiny_model_dir, first, then):
    """temperature and top_p were packed into the fingerprint as sent: a raw ZeroMQ client (the SDK converts to
    float) that sent 0.0 and retried with 0 was told its key was used for another request."""
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=0) as c:
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


def test_the_fingerprint_of_what_the_sdk_sends_is_unchanged():
    """Keys live 24 h across an upgrade: a request the SDK sends keeps the fingerprint stored before (these values
    are the fingerprints of the release before)."""
    req = submit_request("k", None, [5, 6, 7], 12, 0, 1, None, None, "P2", "key-1", False)
    assert admission.fingerprint(req, admission.Admission(None, Tier.P2, [5, 6, 7])) == \
        "2eb81eb11baccd91fb629ad5f6099302"
    req = submit_request("k", None, [1, 2, 3, 4], 40, 0.7, 0.9, 20, 12, "P1", "key-2", True)
    assert admission.fingerprint(req, admission.Admission(None, Tier.P1, [1, 2, 3, 4])) == \
        "fd6a50959203799961299650d2cb994b"
