"""Which gateways a worker can reach now, from ZeroMQ's own connection events (a monitor socket per gateway).

A job's tokens go to the gateway that dispatched it; that gateway forwards them to its clients and writes them
to the job's Redis stream, which every other gateway follows. When that gateway dies for good, nobody wrote the
stream any more: clients that failed over to another gateway saw the job stall until its completion (which goes
to every gateway) brought every token at once. ZeroMQ reports the lost connection at once (a killed process's
socket is closed by its kernel), so the worker moves the streams of that gateway's jobs to one it is connected
to, sending every token so far first; that gateway holds no lease record of its own, reads the lease from Redis,
finds this worker's, and from then on streams and logs the tokens. A gateway that restarts gets its streams back
only for jobs dispatched after; any gateway streams any job.

A gateway that hangs (its process stopped) or whose host is lost keeps its TCP connection open for hours. ZeroMQ's
own heartbeats (ZMTP PING, answered by the peer's I/O thread, so a gateway busy in Python still answers) close
such a connection after HEARTBEAT_TIMEOUT_MS; it counts as up again only once a handshake completes (a stopped
process accepts the TCP connection through its kernel, and never greets).
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

_UP = (zmq.EVENT_HANDSHAKE_SUCCEEDED,)
_DOWN = (zmq.EVENT_DISCONNECTED,)
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000


class GatewayRoutes:
    def __init__(self, sockets: list[zmq.Socket]) -> None:
        """Before the sockets connect: the heartbeats are set, and the first handshakes seen."""
        for sock in sockets:
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        events = 0
        for e in (*_UP, *_DOWN):
            events |= e
        self.monitors = {sock.get_monitor_socket(events): sock for sock in sockets}
        self.up: list[zmq.Socket] = []  # connected now, in the order they came up

    def register(self, poller: zmq.Poller) -> None:
        for mon in self.monitors:
            poller.register(mon, zmq.POLLIN)

    def read(self, mon: zmq.Socket) -> list[zmq.Socket]:
        """Take ``mon``'s waiting events; the gateway sockets that went down (and are not back up)."""
        sock = self.monitors[mon]
        went_down = False
        while mon.poll(0):
            event = recv_monitor_message(mon)["event"]
            if event in _UP and sock not in self.up:
                self.up.append(sock)
            elif event in _DOWN:
                went_down = True
                if sock in self.up:
                    self.up.remove(sock)
        return [sock] if went_down and sock not in self.up else []

    def other_than(self, sock: zmq.Socket) -> zmq.Socket | None:
        """A gateway socket connected now, not ``sock``; the one connected longest (likely the steadiest)."""
        return next((s for s in self.up if s is not sock), None)

    def close(self) -> None:
        for mon, sock in self.monitors.items():
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass  # the socket is already closed
            mon.close(linger=0)
        self.monitors.clear()
