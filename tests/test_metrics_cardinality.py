"""No label is built from what a client sends: a flood of distinct unknown API keys, paths, models, tiers, job ids
and idempotency keys, through the HTTP door and the gateway's own socket, creates no series on any /metrics page of
a real cluster once each kind of refusal has been counted once (Prometheus keeps every series it ever saw: one per
bad value would be a memory leak there, and a dashboard no one can read)."""

from __future__ import annotations

import httpx
import pytest

from common.errors import ServingError
from gateway.sdk import GatewayClient
from tests.cluster_helpers import local_cluster
from tests.test_metrics import scrape


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("metrics-cardinality"), tiny_model_dir, workers=1) as c:
        yield c


def series(c: dict) -> set[tuple]:
    """Every (page, sample name, labels) of every process's /metrics."""
    return {(i, name, labels) for i, url in enumerate(c["metrics"]) for name, samples in scrape(url).items()
            if name != "__types__" for labels in samples}


def flood(c: dict, round_: int, n: int) -> None:
    """``n`` distinct bad values of each kind a client controls, refused at the door or the gateway."""
    good = c["tenants"]["chat-co"]["api_key"]
    base = c["http"]
    with httpx.Client(base_url=base, timeout=30) as http:
        for i in range(n):
            tag = f"{round_}x{i}"
            http.get(f"/no-such-{tag}")
            http.post(f"/v1/completions/{tag}", json={})
            http.request("PATCH", "/v1/models")
            http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                      headers={"Authorization": f"Bearer bad-{tag}"})
            http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "model": f"model-{tag}"},
                      headers={"Authorization": f"Bearer {good}"})
            http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                      headers={"Authorization": f"Bearer {good}", "X-Priority": tag})
            http.post("/v1/chat/completions", content=b"{" + tag.encode(), headers={"Authorization": f"Bearer {good}"})
    for i in range(n):
        tag = f"{round_}x{i}"
        with GatewayClient(c["gateway"], f"bad-{tag}", timeout_s=10, retries=0) as stranger:
            with pytest.raises(ServingError):
                stranger.submit(prompt_token_ids=[1], max_tokens=1)
        with GatewayClient(c["gateway"], good, timeout_s=10, retries=0) as chat:
            with pytest.raises(ServingError):
                chat.submit(prompt_token_ids=[1], max_tokens=1, tier=f"P{tag}")
            with pytest.raises(ServingError):
                chat.status(f"no-job-{tag}")
            with pytest.raises(ServingError):
                chat.submit(prompt_token_ids=[1, 2], max_tokens=10 ** 9, idempotency_key=f"k-{tag}")


def test_a_flood_of_distinct_bad_values_creates_no_series(cluster):
    flood(cluster, 0, 2)  # each kind of refusal counted once: its series exists now
    series(cluster)  # the scrapes' own (the door counts its /metrics route)
    before = series(cluster)
    flood(cluster, 1, 25)
    after = series(cluster)
    assert after - before == set(), sorted(after - before)[:20]
