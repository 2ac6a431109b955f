"""The `worker` label of ts_dispatch_handoff_seconds is bounded: only workers registered now have series, and at
most gateway/metrics.HANDOFF_WORKERS of them; past that, their hand-offs are counted under one OTHER_WORKERS value.

In insecure mode (no CURVE) a worker's id is whatever its hello claims. Each id a job was handed to kept its series
for the gateway's life, so a peer (or worker churn: every restart under a new id) made new label values without end:
Prometheus keeps every series it ever saw. A real gateway process, peers on its real worker socket claiming distinct
ids in waves, and the label values read from its real /metrics page, checked exactly.
"""

from __future__ import annotations

import time

from common import protocol as P
from common.ports import free_port
from gateway.metrics import HANDOFF_WORKERS, OTHER_WORKERS
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster
from tests.test_durability import Adversary
from tests.test_metrics import scrape

HANDOFF = "ts_dispatch_handoff_seconds_count"


def labelled(url: str) -> dict[str, float]:
    """worker label value -> hand-offs counted under it (busy and idle together), from one scrape."""
    out: dict[str, float] = {}
    for labels, n in scrape(url).get(HANDOFF, {}).items():
        worker = dict(labels)["worker"]
        out[worker] = out.get(worker, 0.0) + n
    return out


# The test's thread beats every peer every 0.5 s; under load (other suites and three busy loops beside it) the
# longest gap between two beats of a flock was 0.92 s, so a 2 s timeout could drop a wave the test still holds,
# and with it the series it checks. Its waves' own time-out waits this long.
WORKER_TIMEOUT_S = 5


class Flock:
    """Peers that say hello under ids of their own, each taking one job and reporting its prefill start."""

    def __init__(self, endpoint: str, ids: list[str]) -> None:
        self.peers = {w: Adversary(endpoint, w) for w in ids}
        self.beat(free=1)

    def beat(self, free: int = 0, served: set[str] = frozenset()) -> None:
        """A load report from each (the gateway times a worker out after WORKER_TIMEOUT_S unheard); ``free`` slots
        each, but none for the ``served``."""
        for w, p in self.peers.items():
            p.load([], free=0 if w in served else free)

    def serve_one_job_each(self, client, others: list[Flock]) -> None:
        jobs = [client.submit(prompt_token_ids=[1, 2], max_tokens=1, tier="P3", seed=i) for i in range(len(self.peers))]
        served: set[str] = set()
        deadline = beat_at = time.monotonic()
        deadline += 120
        while len(served) < len(self.peers):
            assert time.monotonic() < deadline, f"{len(served)} of {len(self.peers)} peers were sent a job"
            if time.monotonic() >= beat_at:  # a job sent meanwhile is pending: a report of a free slot adds none
                beat_at = time.monotonic() + 0.5
                self.beat(free=1, served=served)
                for other in others:
                    other.beat()  # registered all along: their series are kept
            for w, p in self.peers.items():
                if w in served or not p.sock.poll(0):
                    continue
                msg = P.decode(p.sock.recv())
                if isinstance(msg, P.DispatchJob):
                    p.send(P.JobTokens(msg.job_id, msg.attempt, 0, [7], 0.0, 0.0))
                    p.send(P.JobFinished(msg.job_id, msg.attempt, "done", "length", 1, 0.01, 0.01, 0, None, [7]))
                    p.load([], free=0)  # one job each: a distinct id for every hand-off
                    served.add(w)
            time.sleep(0.01)
        for j in jobs:
            assert j.result(timeout=60).token_ids == [7]

    def close(self) -> None:
        for p in self.peers.values():
            p.close()


def test_only_registered_workers_have_handoff_series_and_at_most_a_bounded_number(tmp_path, tiny_model_dir):
    bind = f"127.0.0.1:{free_port()}"
    url = f"http://{bind}/metrics"
    wave = 40
    env = {"TS_GATEWAY_METRICS_BIND": bind, "TS_GATEWAY_WORKER_TIMEOUT_S": str(WORKER_TIMEOUT_S)}
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=0, process_env={"gw-0": env}) as c:
        endpoint = c.gateways["gw-0"][1]
        flocks: list[Flock] = []
        try:
            with c.client("lab-co", timeout_s=30.0) as client:
                first = Flock(endpoint, [f"flood-a-{i}" for i in range(wave)])
                flocks.append(first)
                wait_for(lambda: (first.beat(free=1), len(client.info().workers))[1] == wave, 30,
                         "the gateway to know the first wave")
                first.serve_one_job_each(client, [])
                assert labelled(url) == {w: 1.0 for w in first.peers}
                # The first wave goes silent and times out; a second wave under new ids takes its place.
                first.close()
                wait_for(lambda: client.info().workers == [], 30, "the first wave to time out")
                second = Flock(endpoint, [f"flood-b-{i}" for i in range(wave)])
                flocks.append(second)
                wait_for(lambda: (second.beat(free=1), len(client.info().workers))[1] == wave, 30,
                         "the gateway to know the second wave")
                second.serve_one_job_each(client, [])
                assert labelled(url) == {w: 1.0 for w in second.peers}  # before: the first wave's 40 as well
                # A third wave beside the second, past the bound: the ones beyond it share one value.
                beyond = 3
                third = Flock(endpoint, [f"flood-c-{i}" for i in range(HANDOFF_WORKERS - wave + beyond)])
                flocks.append(third)
                wait_for(lambda: (second.beat(), third.beat(free=1), len(client.info().workers))[2] ==
                         HANDOFF_WORKERS + beyond, 30, "the gateway to know the third wave")
                third.serve_one_job_each(client, [second])
                seen = labelled(url)
                assert len(seen) == HANDOFF_WORKERS + 1 and seen.pop(OTHER_WORKERS) == beyond, sorted(seen)
                assert set(seen) <= set(second.peers) | set(third.peers) and set(seen.values()) == {1.0}
        finally:
            for f in flocks:
                f.close()
