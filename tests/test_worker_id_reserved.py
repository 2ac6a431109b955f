"""A hello under the worker id the metrics keep for their overflow series (gateway/metrics.OTHER_WORKERS) is refused.

ts_dispatch_handoff_seconds has one series per registered worker up to HANDOFF_WORKERS, and the rest's under the
worker label "_other_workers". A worker whose id was literally that was welcomed like any other, and its hand-offs
were mixed, unseen, with the overflow's. Real parts: a gateway built as `python -m gateway` builds it on a real
redis-server, and a real DEALER saying hello under that id.
"""

from __future__ import annotations

import zmq

from common import protocol as P
from gateway.metrics import OTHER_WORKERS
from tests.gateway_helpers import built_gateway


def _hello(endpoint: str, worker_id: str, gw, model: str = "tiny"):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, worker_id.encode())
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send(P.encode(P.WorkerHello(worker_id, model, 512, 256, 2, 64)))
        for _ in range(2000):
            gw._drain(gw.worker_sock, gw._worker_handlers)
            if s.poll(5):
                return P.decode(s.recv())
        raise AssertionError(f"no answer to the hello of {worker_id}")
    finally:
        s.close()


def test_a_hello_under_the_overflow_series_id_is_refused_and_changes_nothing(tmp_path):
    with built_gateway(tmp_path, "reserved-id") as (gw, _, _):
        endpoint = gw.worker_sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        refused = _hello(endpoint, OTHER_WORKERS, gw, model="another-model")
        assert isinstance(refused, P.ErrorReply) and refused.code == "forbidden", refused
        assert OTHER_WORKERS in refused.message
        assert gw.workers.workers == {} and gw.counters["hello_refused"] == 1
        # It pinned no model either: the first acceptable hello still does.
        assert _hello(endpoint, "wk-a", gw) == P.GatewayWelcome(gw.config.gateway_id)
        assert list(gw.workers.workers) == ["wk-a"] and gw.hello_policy.model == "tiny"
