"""A worker that is a raw socket speaking the wire protocol as worker/service.py does (hello, load reports, the
frames a test sends), so that the test chooses what a worker sends and when; the gateway and Redis stay real."""

from __future__ import annotations

import time

import zmq

from common import protocol as P
from common.sockets import make_socket


class RawWorker:
    def __init__(self, endpoint: str, worker_id: str = "wk-raw", **hello) -> None:
        """``hello``: WorkerHello fields past the required ones (default: it resumes jobs)."""
        self.worker_id = worker_id
        self._hello = {"resumes": True} | hello
        self.sock = make_socket(zmq.Context.instance(), zmq.DEALER, identity=worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.held: list[str] = []
        self.hello()

    def send(self, msg) -> None:
        self.sock.send(P.encode(msg))

    def hello(self) -> None:
        self.send(P.WorkerHello(self.worker_id, "raw", 512, 2048, 1, 1024, **self._hello))
        self.beat()

    def beat(self) -> None:
        self.send(P.WorkerLoad(self.worker_id, 0 if self.held else 1, 1024, {}, {}, list(self.held), 0.0))

    def recv(self, kind: type, timeout_s: float):
        """The first ``kind`` frame within ``timeout_s`` (reporting the held jobs meanwhile), else None."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.beat()
            if self.sock.poll(200):
                msg = P.decode(self.sock.recv())
                if isinstance(msg, kind):
                    return msg
        return None

    def close(self) -> None:
        self.sock.close(linger=0)
