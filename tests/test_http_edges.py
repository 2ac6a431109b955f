"""The HTTP door where clients and operators meet its edges, against a real local cluster (scripts/up.py) over real
HTTP (httpx): a header sent twice with different values, /health asked with a key nobody knows, and a stream that
ends in an error event after its 200."""

from __future__ import annotations

import httpx
import pytest

from tests.cluster_helpers import assert_unchanged, local_cluster, snapshot
from tests.test_http import assert_error, front_door, key


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("http-edges"), tiny_model_dir, workers=1, max_running=4) as c:
        yield c


def post(c: dict, headers: list[tuple[str, str]], body: dict | None = None) -> httpx.Response:
    # A list of pairs: httpx sends each, so a header can be sent twice.
    return httpx.post(c["http"] + "/v1/completions", json=body or {"prompt": [5, 6], "max_tokens": 2},
                      headers=headers, timeout=120)


def auth(c: dict, tenant: str) -> tuple[str, str]:
    return "Authorization", f"Bearer {key(c, tenant)}"


@pytest.mark.parametrize("name", ["Authorization", "X-Priority", "Idempotency-Key"])
def test_a_header_sent_twice_with_different_values_is_refused_and_changes_nothing(cluster, name):
    """The first value was taken, silently: another tenant's key, a P0 that charged the quota where the second
    said P1, or a job under one of two keys. chat-co is entitled to P0 and P1 (P0 charges its quota)."""
    pairs = {"Authorization": [auth(cluster, "chat-co"), auth(cluster, "api-co")],
             "X-Priority": [("X-Priority", "P0"), ("X-Priority", "P1")],
             "Idempotency-Key": [("Idempotency-Key", "first"), ("Idempotency-Key", "second")]}[name]
    headers = ([] if name == "Authorization" else [auth(cluster, "chat-co")]) + pairs
    before = snapshot(cluster)
    err = assert_error(post(cluster, headers), 400, "invalid_request_error")
    assert err["code"] == "conflicting_headers" and name in err["message"], err
    assert_unchanged(before, snapshot(cluster))
    # The same value twice is one value.
    same = ([] if name == "Authorization" else [auth(cluster, "chat-co")]) + [pairs[0], pairs[0]]
    r = post(cluster, same)
    assert r.status_code == 200, r.text


def test_health_says_its_key_is_unknown_not_that_the_gateway_is_down(cluster, tiny_model_dir, tmp_path):
    """Without health_api_key /health asks with the caller's bearer token; a token nobody knows was reported as
    "unavailable: Unauthorized", an outage that was not there."""
    with front_door(tiny_model_dir, [cluster["gateway"]], tmp_path / "door.log") as base:
        r = httpx.get(base + "/health", headers={"Authorization": "Bearer nobody"}, timeout=30)
        assert r.status_code == 503 and r.json()["status"] == "unknown", r.text
        assert "bearer token" in r.json()["reason"] and "Unauthorized" not in r.json()["reason"], r.text
        r = httpx.get(base + "/health", headers={"Authorization": f"Bearer {key(cluster, 'lab-co')}"}, timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        r = httpx.get(base + "/health", headers=[auth(cluster, "lab-co"), ("Authorization", "Bearer nobody")],
                      timeout=30)
        assert_error(r, 400, "invalid_request_error")
    with front_door(tiny_model_dir, [cluster["gateway"]], tmp_path / "door2.log", health_key="wrong") as base:
        r = httpx.get(base + "/health", timeout=30)
        assert r.status_code == 503 and r.json()["status"] == "unknown", r.text
        assert "health_api_key" in r.json()["reason"], r.text
