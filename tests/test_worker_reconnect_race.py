"""A gateway that restarted during a worker's long step, and answered it before the step ended, was heard since its
connection dropped: a later silence (its Redis frozen) must not connect to it anew.

worker/routes.py connects anew to a gateway silent for SILENT_RECONNECT_S only if nothing was heard from it since its
connection last dropped: connected anew, a gateway that holds the connection (waiting out a frozen Redis) keeps the
old pipe and drops the new one as a duplicate, and the worker is stranded there. After a long step, the new
gateway's first answer and the old connection's drop came out of one poll: the frame was read first, and the drop
then took the time of that frame as the last heard before it, so the gateway counted as silent since the drop.
Real redis-server and gateway processes (the gateway killed and started again on its port); a real WorkerService on
the tiny model whose loop passes the test makes, one at a time (between them, a step); its clock is the test's.
"""

from __future__ import annotations

import time

import pytest
import zmq

from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster

pytestmark = pytest.mark.faults


def test_a_gateway_that_answered_after_a_restart_in_a_long_step_is_not_connected_to_anew(
        tmp_path, bench_model_dir, tiny_model_dir):
    from worker import Engine, EngineConfig
    from worker.routes import SILENT_RECONNECT_S
    from worker.service import WorkerService
    from worker.service_config import WorkerConfig

    with DurableCluster(tmp_path, bench_model_dir, gateways=1, workers=0) as c:
        now = [time.monotonic()]
        engine = Engine.from_pretrained(str(tiny_model_dir), EngineConfig(max_num_seqs=2))
        svc = WorkerService(WorkerConfig(gateways=[c.gateways["gw-0"][1]], model="tiny", worker_id="wk-race"),
                            engine, clock=lambda: now[0])
        try:
            svc.connect()
            (sock,) = svc.sockets
            (mon,) = svc.routes.monitors
            poller = svc._poller()
            assert sock.poll(30_000, zmq.POLLIN), "the gateway never welcomed the worker"
            wait_for(lambda: (svc._take_waiting(poller, 50), svc.routes.up == [sock])[1], 30, "the connection")
            svc._take_waiting(poller, 200)  # and whatever came after the welcome

            # A long step: the loop reads nothing while the gateway is killed and started again; meanwhile the
            # heartbeat thread's hello reaches the new one, and its welcome waits in the socket.
            now[0] += 1.0
            c.kill("gw-0")
            c.restart("gw-0")
            c.wait_workers("gw-0")
            svc._hello()
            assert sock.poll(30_000, zmq.POLLIN), "the new gateway never answered"
            assert mon.poll(0), "the dropped connection was never reported"

            now[0] += 1.0
            answered = now[0]
            svc._take_waiting(poller, 0)  # the step is over: the drop and the answer, in one pass
            assert svc.routes.heard[sock] == answered
            assert svc.routes.up == [sock]

            # The new gateway then answers nothing (its Redis frozen) for longer than the silence limit, its
            # connection up all along.
            now[0] += SILENT_RECONNECT_S + 1.0
            svc._take_waiting(poller, 0)
            assert svc.routes.reconnects == 0, "connected anew to a gateway heard since its connection dropped"

            # Whereas one silent since a drop is connected anew, once (and again only a silence limit later).
            svc._hello()
            assert sock.poll(30_000, zmq.POLLIN), "the gateway no longer answers"
            svc._take_waiting(poller, 0)  # heard now
            c.kill("gw-0")
            wait_for(lambda: (svc._take_waiting(poller, 50), not svc.routes.up)[1], 30, "the connection to drop")
            now[0] += SILENT_RECONNECT_S + 1.0
            svc._take_waiting(poller, 0)
            svc._take_waiting(poller, 0)
            assert svc.routes.reconnects == 1
        finally:
            svc.close()
