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

A gateway that hung longer than that timeout never heard this worker again once it went on: ZeroMQ's ROUTER still
held the old connection's pipe under the worker's identity when the new connection said who it was, and drops a
peer with a duplicate identity without a word (the worker saw the handshake succeed). A gateway answers every hello
(sent every few seconds) with a welcome, so a socket that has heard nothing for SILENT_RECONNECT_S since its
connection dropped is connected anew: the new connection finds the identity free. Only since a drop: a gateway
waiting out a frozen Redis reads no worker frame (they wait in its socket) and so answers no hello, but its I/O
thread answers the heartbeats and the connection stays; connected anew, the old pipe, full of unread frames, held
the identity until the gateway read them, the new connection was dropped as a duplicate, and everything the worker
sent went into nothing for another SILENT_RECONNECT_S after Redis came back (the gateway timed the worker out).
"""

from __future__ import annotations

import zmq

from common.monitors import close_monitor, monitor_events, monitor_socket

_UP = (zmq.EVENT_HANDSHAKE_SUCCEEDED,)
_DOWN = (zmq.EVENT_DISCONNECTED,)
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
SILENT_RECONNECT_S = 15.0  # three hellos unanswered


class GatewayRoutes:
    def __init__(self, sockets: list[zmq.Socket]) -> None:
        """Before the sockets connect: the heartbeats are set, and the first handshakes seen."""
        for sock in sockets:
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        events = 0
        for e in (*_UP, *_DOWN):
            events |= e
        # Read between steps: unbounded (common/monitors), as a full queue froze the worker's every socket in a step.
        self.monitors = {monitor_socket(sock, events): sock for sock in sockets}
        self.up: list[zmq.Socket] = []  # connected now, in the order they came up
        self.heard: dict[zmq.Socket, float] = {}  # when a frame last came from each gateway (or it was connected)
        self._silent_since: dict[zmq.Socket, float] = {}  # ``heard`` when the connection last dropped
        self.reconnects = 0

    def register(self, poller: zmq.Poller) -> None:
        for mon in self.monitors:
            poller.register(mon, zmq.POLLIN)

    def read(self, mon: zmq.Socket, now: float) -> list[zmq.Socket]:
        """Take ``mon``'s waiting events; the gateway sockets that went down (and are not back up). Read before the
        frames that came with them: a frame read after a drop counts as heard since (see ``silent``)."""
        sock = self.monitors[mon]
        went_down = False
        for event in monitor_events(mon):
            if event in _UP and sock not in self.up:
                self.up.append(sock)
            elif event in _DOWN:
                went_down = True
                # Taken now, not when ``silent`` next looks: by then a frame the new connection brought (a gateway
                # that restarted during a long step answered) is heard, and was taken for the last before the drop.
                self._silent_since[sock] = self.heard.setdefault(sock, now)
                if sock in self.up:
                    self.up.remove(sock)
        return [sock] if went_down and sock not in self.up else []

    def other_than(self, sock: zmq.Socket) -> zmq.Socket | None:
        """A gateway socket connected now, not ``sock``; the one connected longest (likely the steadiest)."""
        return next((s for s in self.up if s is not sock), None)

    def silent(self, endpoints: dict[zmq.Socket, str], now: float) -> list[zmq.Socket]:
        """Connect anew every socket that has heard nothing for SILENT_RECONNECT_S, its connection having dropped
        meanwhile; those reconnected. What was queued for that gateway is dropped: completions and hand-backs are
        sent again, and tokens replayed."""
        out = []
        for sock, endpoint in endpoints.items():
            heard = self.heard.setdefault(sock, now)
            if now - heard < SILENT_RECONNECT_S or self._silent_since.get(sock) != heard:
                continue  # heard lately, or since its connection last dropped: no stale pipe can hold its identity
            sock.disconnect(endpoint)
            sock.connect(endpoint)
            self.heard[sock] = self._silent_since[sock] = now  # the gateway may still hold the old pipe: again later
            self.reconnects += 1
            out.append(sock)
        return out

    def close(self) -> None:
        for mon, sock in self.monitors.items():
            close_monitor(sock, mon)
        self.monitors.clear()
