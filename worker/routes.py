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

import logging

import zmq

from common import handshakes
from common.handshakes import Advice, Handshakes
from common.monitors import close_monitor, monitor_event_values, monitor_socket

log = logging.getLogger("worker.routes")

_UP = (zmq.EVENT_HANDSHAKE_SUCCEEDED,)
_DOWN = (zmq.EVENT_DISCONNECTED,)
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
SILENT_RECONNECT_S = 15.0  # three hellos unanswered
REFUSAL_LOG_S = 60.0  # a gateway that goes on refusing this worker's handshake is named again this often


class GatewayRoutes:
    def __init__(self, sockets: list[zmq.Socket], endpoints: list[str] | None = None, curve: bool = False) -> None:
        """Before the sockets connect: the heartbeats are set, and the first handshakes seen. ``endpoints`` (the
        sockets' gateways, in order) and ``curve`` (this worker holds the gateways' public key) name a gateway that
        refuses the handshake in the log (common/handshakes): a worker whose keys do not match idled unexplained."""
        for sock in sockets:
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        # Read between steps: unbounded (common/monitors), as a full queue froze the worker's every socket in a step.
        self.monitors = {monitor_socket(sock, zmq.EVENT_DISCONNECTED | handshakes.EVENTS): sock for sock in sockets}
        self.endpoints = dict(zip(sockets, endpoints or [], strict=False))
        self.curve = curve
        self.handshakes = {sock: Handshakes() for sock in sockets}
        self._refusal_logged: dict[zmq.Socket, tuple[int, float]] = {}  # the refusal's event said, and when
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
        for event, value in monitor_event_values(mon):
            self.handshakes[sock].on_event(event, value)
            if event in _UP and sock not in self.up:
                self.up.append(sock)
            elif event in _DOWN:
                went_down = True
                # Taken now, not when ``silent`` next looks: by then a frame the new connection brought (a gateway
                # that restarted during a long step answered) is heard, and was taken for the last before the drop.
                self._silent_since[sock] = self.heard.setdefault(sock, now)
                if sock in self.up:
                    self.up.remove(sock)
        self._log_refusal(sock, now)
        return [sock] if went_down and sock not in self.up else []

    def _log_refusal(self, sock: zmq.Socket, now: float) -> None:
        h = self.handshakes[sock]
        said = self._refusal_logged.get(sock)
        endpoint = self.endpoints.get(sock, "?")
        if not h.refused:
            if said is not None and h.failed is None:
                log.info("gateway %s took this worker's handshake", endpoint)
                del self._refusal_logged[sock]
            return
        if said is not None and said[0] == h.failed[0] and now - said[1] < REFUSAL_LOG_S:
            return
        self._refusal_logged[sock] = (h.failed[0], now)  # its value (an errno) may vary from one refusal to the next
        log.warning("gateway %s %s", endpoint, h.reason(self.curve, _ADVICE))

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


_ADVICE = Advice(
    who="worker", port="a gateway's worker port",
    curve_peer="requires CURVE on its worker socket: set gateway_public_key (the gateways' .key file) and "
               "curve_secret_key_file (this worker's .key_secret, whose .key is in the gateway's "
               "authorized_workers_dir)",
    plain_peer="does not use CURVE on its worker socket, and this worker has gateway_public_key: leave it and "
               "curve_secret_key_file out for this gateway",
    key_refused=": put the public half of its curve_secret_key_file (its .key file) in the gateway's "
                "authorized_workers_dir",
    closed_curve="is gateway_public_key this gateway's public key, and this a gateway's worker port?",
    closed_plain="is this a gateway's worker port, and does it need gateway_public_key?")
