"""A tenant removed from the gateways' tenants file (the gateway restarted with the new file) is a stranger to the
HTTP door too: 401, and no other answer, however the door had known the key before.

Real processes: redis-server, a gateway (tests/durable_cluster.py), a real `python -m gateway.http`, and httpx.
"""

from __future__ import annotations

import time

import httpx
import pytest

from gateway.http.upstream import AUTH_MAX_AGE_S
from gateway.sdk import GatewayClient
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster
from tests.test_http import front_door

pytestmark = pytest.mark.faults  # a gateway restarted on purpose: `make test-faults` runs these alone


def drop_tenant(c: DurableCluster, name: str) -> None:
    """The tenants file without ``name``'s entry (each entry begins with its [[tenant]] line)."""
    path = c.tmp / "tenants.toml"
    entries = path.read_text().split("[[tenant]]")
    kept = [e for e in entries[1:] if f'name = "{name}"' not in e]
    assert len(kept) == len(entries) - 2, "the tenant to drop was not in the file"
    path.write_text(entries[0] + "".join("[[tenant]]" + e for e in kept))


def gateway_answers(c: DurableCluster) -> bool:
    with GatewayClient(c.endpoint(), c.key("lab-co"), timeout_s=2.0, retries=0) as sdk:
        try:
            sdk.info()
            return True
        except Exception:
            return False


def test_a_revoked_key_is_refused_before_its_body_is_read(tmp_path, tiny_model_dir):
    """The door checked a key with a gateway once while it kept the key's client, and took it as known ever after:
    once the tenant was removed (and the gateway restarted), the key's requests were still read, validated and
    tokenized, and answered for the body (a 404 naming the model this server serves, a 400 naming a field) rather
    than 401; only a valid body reached a gateway, which refused it. A key is now taken as known for at most
    AUTH_MAX_AGE_S after a gateway last said it knew it."""
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=0) as c, \
            front_door(tiny_model_dir, [c.endpoint()], tmp_path / "door.log") as base:
        revoked = {"Authorization": f"Bearer {c.key('api-co')}"}
        kept = {"Authorization": f"Bearer {c.key('lab-co')}"}
        wrong_model = {"prompt": "x", "model": "no-such-model", "max_tokens": 1}
        r = httpx.post(base + "/v1/completions", json=wrong_model, headers=revoked, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text  # known, checked
        known_at = time.monotonic()

        drop_tenant(c, "api-co")
        c.kill("gw-0")
        c.restart("gw-0")
        wait_for(lambda: gateway_answers(c), 60, "the restarted gateway to answer")
        # The door's knowledge of the key is older than its bound (the restart alone takes longer, all but always).
        time.sleep(max(0.0, known_at + AUTH_MAX_AGE_S + 0.2 - time.monotonic()))

        for path, body in [("/v1/completions", wrong_model),
                           ("/v1/completions", {"prompt": "x", "max_tokens": 0}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                     "model": "no-such-model"})]:
            r = httpx.post(base + path, json=body, headers=revoked, timeout=60)
            assert r.status_code == 401, r.text
            err = r.json()["error"]
            assert err["type"] == "authentication_error" and "tiny-llama" not in err["message"], err
        # A tenant still in the file is served as before.
        r = httpx.post(base + "/v1/completions", json=wrong_model, headers=kept, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
