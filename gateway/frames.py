"""The frames of the gateway's two sockets: drained in bounded bursts, decoded once, handed to the handler for their
kind; replies sent without blocking.

A malformed frame, or one of a kind the socket does not take, gets an ErrorReply and is counted, never crashes the
loop; a handler's Redis error starts the back-off (redis_backoff.py) and refuses the client, a handler's bug is
logged and answered 'internal'. While Redis is in its back-off, clients hear 'unavailable' and worker frames that
need Redis are kept aside (outage.py).

A mixin of gateway.server.Gateway: it uses the gateway's sockets, handler tables, tenants, keepalives and counters.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import redis
import zmq

from common import protocol as P
from common.errors import Forbidden, InvalidRequest, Unauthorized
from gateway import metrics, security
from gateway.redis_queue import out_of_memory

log = logging.getLogger("gateway")

# Where a client reply goes: the client's routing id and the request id to echo on every frame of the reply.
# Client handlers receive one instead of a bare routing id; stream subscribers are keyed by it, so one
# connection can hold several streams (even of the same job) at once.
Peer = tuple[bytes, "str | None"]
# Client frames handled in a row while a dispatch is pending. An admission costs milliseconds (its wait estimate),
# and a burst of them drained at once kept freed slots idle for as long, a lag no estimate counted.
CLIENT_DRAIN_BUDGET_S = 0.01


class Frames:
    """Receiving, decoding and dispatching frames to handlers; sending replies and refusals."""

    def _drain(self, sock: zmq.Socket, handlers: dict) -> None:
        started = time.monotonic()
        for _ in range(1000):  # bounded, so one busy socket cannot starve the other
            if sock is self.worker_sock and self.holding_back() and self.kept.full():
                # Redis is known down: most worker frames need it (a report extends leases, a completion is
                # stored), and each would stand the loop still for Redis's socket timeout, one after another
                # (reports come every 0.5 s per worker): no client heard even 'unavailable', no stream a keepalive.
                # They are kept aside for the end of the back-off (outage.py); with no room left to keep them, they
                # wait in the socket, behind the kept ones (a completion is also sent again until confirmed).
                return
            if sock is self.clients and self._dirty and time.monotonic() - started >= CLIENT_DRAIN_BUDGET_S:
                return  # a slot may be free: dispatch first (the rest wait in the socket, and the loop comes back)
            try:
                if sock is self.worker_sock and self.worker_keys is not None:
                    frames, self.frame_key = security.recv_with_key(sock)
                else:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                if sock is self.clients:
                    self._clients_answered()
                return
            if len(frames) != 2:
                self.counters["malformed"] += 1
                continue
            ident, frame = frames
            try:
                msg = P.decode(frame, authorize=self.tenants.lookup if sock is self.clients else None)
                handler = handlers.get(type(msg))
                if handler is None:
                    raise P.ProtocolError(f"{type(msg).__name__} is not accepted on this socket")
            except P.ProtocolError as e:
                self.counters["malformed"] += 1
                to = ident
                if sock is self.clients:
                    metrics.refused(e.code)  # e.g. an unknown API key, refused before the frame is decoded
                    rid = _request_id_of(frame)
                    to = (ident, rid) if rid is not None else ident
                self._send(sock, to, P.ErrorReply(e.code, str(e)))
                continue
            to = ident
            if sock is self.clients:
                rid = msg.request_id
                if rid is not None and not 0 < len(rid) <= P.MAX_REQUEST_ID_LEN:
                    self.counters["malformed"] += 1
                    self._send(sock, ident, P.ErrorReply(
                        "protocol", f"request_id must be 1 to {P.MAX_REQUEST_ID_LEN} characters", field="request_id"))
                    continue
                to = (ident, rid)
            if sock is self.clients and self._redis_down() and not self.answers_without_redis(msg):
                self._refuse(to, msg, self._unavailable())
                continue
            if sock is self.worker_sock and self.holding_back() and not self.needs_no_redis(ident, msg):
                self.keep_aside(ident, msg, frame)
                continue
            self._handle(sock, to, msg, handler)

    def _handle(self, sock: zmq.Socket, to: bytes | Peer, msg, handler: Callable) -> None:
        """``handler(to, msg)``: a Redis error starts the back-off (and refuses a client), a bug is logged."""
        try:
            handler(to, msg)
        except redis.RedisError as e:
            self._redis_failed(e)
            if sock is self.clients:
                self._refuse(to, msg, P.ErrorReply("overloaded", "the queue store (Redis) is full; retry later")
                             if out_of_memory(e) else self._unavailable())
        except Exception:  # a handler bug must not take the gateway down with it
            self.counters["handler_errors"] += 1
            log.exception("handler for %s failed", type(msg).__name__)
            self._send(sock, to, P.ErrorReply("internal", "internal error"))

    def _send(self, sock: zmq.Socket, to: bytes | Peer, msg) -> None:
        ident = to
        if isinstance(to, tuple):  # a client: echo its request id, and note that its stream is alive
            ident, rid = to
            if rid is not None:
                msg = dataclasses.replace(msg, request_id=rid)
            self.keepalives.sent(to, self.clock(), final=isinstance(msg, (P.JobDone, P.ErrorReply)))
        try:
            sock.send_multipart([ident, P.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self.counters["unroutable"] += 1  # peer gone or its queue full; it can re-subscribe
            if isinstance(to, tuple):
                self.keepalives.sent(to, 0.0, final=True)
                if e.errno == zmq.EHOSTUNREACH:
                    # Its connection is gone (the blocking client closes a stream's socket when its caller stops
                    # reading), and a connection never comes back: a re-subscription comes on a new one. Kept, the
                    # subscription had every token batch of its job sent into the void until the job ended.
                    self.streams.forget_peer(to)

    def _refuse(self, to: Peer, msg, reply: P.ErrorReply) -> None:
        """A client request refused for the queue store's sake; a submission's refusal is counted as on_submit's."""
        if isinstance(msg, P.SubmitRequest):
            metrics.refused(reply.code)
        self._send(self.clients, to, reply)

    def _error_for(self, e: Exception, job_id: str | None = None) -> P.ErrorReply:
        code = {Unauthorized: "unauthorized", Forbidden: "forbidden", InvalidRequest: "invalid_request"}.get(
            type(e), "invalid_request")
        self.counters[f"refused_{code}"] += 1
        return P.ErrorReply(code, str(e), field=getattr(e, "field", None), in_reply_to=job_id)

    def _reply_error(self, ident: bytes, e: Exception, job_id: str | None = None) -> None:
        self._send(self.clients, ident, self._error_for(e, job_id))


def _request_id_of(frame: bytes) -> str | None:
    """The request id of a client frame refused before it was decoded, so the error reaches its caller.
    Only small frames are read again, and under the decoder's caps: a flood of large ones, or of nested lists,
    costs no more than before."""
    if len(frame) > 64 * 1024:
        return None
    try:
        body = P.loads(frame, max_containers=16).get("b")  # a request holds a few (its body, ids, trace context)
        rid = body.get("request_id") if isinstance(body, dict) else None
    except Exception:  # noqa: BLE001 - unreadable: the error goes out without an id
        return None
    return rid if isinstance(rid, str) and 0 < len(rid) <= P.MAX_REQUEST_ID_LEN else None
