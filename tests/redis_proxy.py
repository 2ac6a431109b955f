"""A TCP proxy in front of a real redis-server that can hold back one command: a Redis that stalls (SIGSTOP, a
long fork, a full network buffer) exactly while one chosen command is on its way, then executes it."""

from __future__ import annotations

import socket
import threading
import time

from common.ports import free_port


class HoldingProxy:
    """Forwards every connection to ``upstream_port``. Once ``hold(marker, s)`` is armed, the first chunk a client
    sends that contains ``marker`` reaches Redis only ``s`` seconds later, even if the client has given up and
    closed its connection meanwhile (the kernel of a stalled Redis keeps what was sent the same way); and so does
    whatever any connection sends meanwhile, after it: Redis stood still for everyone."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port, self.port = upstream_port, free_port()
        self._marker: bytes | None = None
        self._hold_s = 0.0
        self.held = threading.Event()  # set once the marked chunk has been held back
        self.released = threading.Event()  # set once it has reached Redis
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._stop = False
        self._gate = threading.Lock()  # held while Redis "stands still"
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def hold(self, marker: bytes, seconds: float) -> None:
        self._marker, self._hold_s = marker, seconds

    def close(self) -> None:
        self._stop = True
        self._server.close()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, to_redis: bool) -> None:
        try:
            while True:
                chunk = src.recv(65536)
                if not chunk:
                    break
                if to_redis and self._marker is not None and self._marker in chunk:
                    self._marker = None
                    with self._gate:
                        self.held.set()
                        time.sleep(self._hold_s)
                        dst.sendall(chunk)
                    self.released.set()
                    continue
                if to_redis:
                    with self._gate:
                        dst.sendall(chunk)
                else:
                    dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_WR if s is dst else socket.SHUT_RD)
                except OSError:
                    pass
