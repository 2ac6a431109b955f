"""The HTTP door while its gateways' Redis is down: real redis-server, gateway and worker processes
(tests/durable_cluster.py), a real `python -m gateway.http`, real HTTP."""

from __future__ import annotations

import httpx

from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster
from tests.test_http import assert_error, front_door


def test_a_request_while_redis_is_down_is_a_503_to_retry_not_a_502(tmp_path, tiny_model_dir):
    """The gateway answers "unavailable; nothing was stored, retry" (common.errors.Unavailable) while its Redis
    is unreachable; the SDK waits that out for up to the door's upstream_timeout_s, then raises it. The door
    answered it as any other error, a 502 upstream_error without Retry-After: a server fault to the client, not
    the retryable outage it is (503 with Retry-After, as for a gateway that does not answer)."""
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=1) as c, \
            front_door(tiny_model_dir, [c.endpoint()], tmp_path / "door.log",
                       env={"TS_HTTP_UPSTREAM_TIMEOUT_S": "2"}) as base:
        headers = {"Authorization": f"Bearer {c.key('api-co')}"}
        body = {"prompt": [5, 6], "max_tokens": 2}
        r = httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text  # the door knows the key: it is not asked about again
        c.kill("redis")
        for stream in (False, True):
            r = httpx.post(base + "/v1/completions", json=body | {"stream": stream}, headers=headers, timeout=60)
            err = assert_error(r, 503, "overloaded_error")
            assert err["code"] == "unavailable", err
            assert int(r.headers["Retry-After"]) >= 1, r.headers
        c.restart("redis")

        def served() -> bool:
            return httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=60).status_code == 200

        wait_for(served, 60, "the door to serve again once Redis is back", interval=0.5)
