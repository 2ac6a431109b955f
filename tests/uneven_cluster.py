"""A cluster of uneven workers: one gateway, a real small worker (4 KV blocks of 16 tokens: 64 a job) and a big one
played by a peer on the gateway's worker socket (BigWorker), so a test can make it drain, fall silent and come back
with the same id, as a redeploy does. Real processes (tests/durable_cluster.py) but the big worker."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import zmq

from common import protocol as P
from common.sockets import make_socket
from tests.durable_cluster import DurableCluster


class BigWorker:
    """A peer on the gateway's worker socket, as a worker with a big KV cache: it says hello (every tier may hold
    ``limit`` tokens there), reports every half second from a thread, offers its one slot only once ``free`` is set,
    and finishes what it is sent at once (``token`` x max_tokens). ``stop()`` ends it without a word, as a kill."""

    def __init__(self, endpoint: str, model: str, worker_id: str = "wk-big", limit: int = 2048) -> None:
        self.worker_id, self.model, self.limit = worker_id, model, limit
        self.sock = make_socket(zmq.Context.instance(), zmq.DEALER, identity=worker_id.encode())
        self.sock.connect(endpoint)
        self.free = threading.Event()
        self.draining = threading.Event()  # set: its reports say it drains (told to stop: a redeploy's SIGTERM)
        self.received: list[P.DispatchJob] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        limits = {t: self.limit for t in ("P0", "P1", "P2", "P3")}
        self.sock.send(P.encode(P.WorkerHello(self.worker_id, self.model, 512, 2048, 1, 128, limits, 256)))
        while not self._stop.is_set():
            free = 1 if self.free.is_set() else 0
            self.sock.send(P.encode(P.WorkerLoad(self.worker_id, free, 128, {} if free else {"P3": 1}, {}, [], 0.0,
                                                 draining=self.draining.is_set())))
            while self.sock.poll(500):
                msg = P.decode(self.sock.recv())
                if isinstance(msg, P.DispatchJob):
                    self.received.append(msg)
                    self.sock.send(P.encode(P.JobFinished(msg.job_id, msg.attempt, "done", "length", msg.max_tokens,
                                                          0.01, 0.01, 0, None, [7] * msg.max_tokens)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sock.close(linger=0)


class SmallWorkerCluster(DurableCluster):
    """One gateway; its real workers (started later by the test) have 4 KV blocks of 16 tokens: 64 a job."""

    def __init__(self, tmp_path, model_dir) -> None:
        super().__init__(tmp_path, model_dir, gateways=1, workers=0)

    def _cmd(self, name: str) -> list[str]:
        return super()._cmd(name) + (["--num-kv-blocks", "4"] if name.startswith("wk-") else [])


def start_small_worker(c: SmallWorkerCluster) -> None:
    c.worker_ids.append("wk-0")
    c.start_process("wk-0")
    c.wait_workers("gw-0")


@dataclass
class Uneven:
    """The running cluster and its big worker (the one now playing it: ``redeploy`` replaces it)."""

    cluster: SmallWorkerCluster
    big: BigWorker
    model: str

    def redeploy(self) -> BigWorker:
        """A new big worker with the same id and size (the old one stopped first, if the test has not)."""
        self.big.stop()
        self.big = BigWorker(self.cluster.gateways["gw-0"][1], self.model, self.big.worker_id, self.big.limit)
        return self.big


@contextmanager
def uneven_cluster(tmp_path, model_dir, *, limit: int = 2048, draining: bool = False, free: bool = False,
                   small: bool = True) -> Iterator[Uneven]:
    """The cluster with the big worker seen by the gateway (draining and free as asked before that) and, with
    ``small``, the small worker too (without: the test starts it, start_small_worker). The big worker playing at the
    end is stopped, however the test ends."""
    with SmallWorkerCluster(tmp_path, model_dir) as c:
        setup = Uneven(c, BigWorker(c.gateways["gw-0"][1], str(model_dir), limit=limit), str(model_dir))
        try:
            if draining:
                setup.big.draining.set()
            if free:
                setup.big.free.set()
            c.worker_ids.append("wk-big")
            c.wait_workers("gw-0")
            if small:
                start_small_worker(c)
            yield setup
        finally:
            setup.big.stop()
