"""What stands between the gateway's sockets and strangers: CURVE on both sockets, the worker
allow-list, per-peer byte bounds on the client socket, and the hello rules for workers.

``secure_sockets(gw, config)`` runs after the Gateway is built and before it binds (socket
options only take effect then). It refuses, with ``ConfigError``, a gateway that would accept
unauthenticated workers on anything but loopback.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Container

import redis
import zmq

from common import protocol as P
from common.errors import InvalidRequest
from common.keys import KeyFileError
from common.redis_keys import KeySpace
from common.settings import ConfigError
from common.sockets import (CLIENTS_DOMAIN, WORKERS_DOMAIN, Authenticator, SocketLimits, curve_server,
                            is_loopback_endpoint)

log = logging.getLogger("gateway.security")
HELLO_ASK_EVERY_S = 1.0
HELLO_ASK_MEMORY = 1024  # peers remembered as asked: a stranger's made-up identities cannot grow it further
WORKER_KEY_MEMORY = 4096  # worker ids remembered with their key, besides the registered ones (never forgotten)
_UNKNOWN = object()  # the cluster's binding could not be asked


def check_config(config) -> None:
    """Refuse (ConfigError) a configuration that would accept unauthenticated workers beyond loopback."""
    if config.authorized_workers_dir and config.insecure_workers:
        raise ConfigError("authorized_workers_dir and insecure_workers contradict each other: choose one")
    if not config.authorized_workers_dir:
        if not config.insecure_workers:
            raise ConfigError("no worker keys: set authorized_workers_dir and curve_secret_key_file (keys from "
                              "`python -m common.keys`), or --insecure-workers for a loopback-only worker socket")
        if not is_loopback_endpoint(config.worker_bind):
            raise ConfigError(f"--insecure-workers only binds loopback; worker_bind is {config.worker_bind}")
    if (config.authorized_workers_dir or config.client_curve) and not config.curve_secret_key_file:
        raise ConfigError("CURVE needs the gateway's key pair: set curve_secret_key_file")


def secure_sockets(gw, config) -> Authenticator | None:
    """CURVE and limits on ``gw.worker_sock`` and ``gw.clients``; the ZAP authenticator (or None)."""
    check_config(config)
    limits = SocketLimits.per_peer_bytes(config.client_queue_bytes_per_peer, config.client_max_message_bytes)
    gw.clients.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
    gw.clients.setsockopt(zmq.RCVHWM, limits.recv_hwm)
    if config.insecure_workers:
        log.warning("workers are NOT authenticated (insecure_workers): worker socket on %s", config.worker_bind)
    if not (config.authorized_workers_dir or config.client_curve):
        return None
    try:
        auth = Authenticator(gw.ctx, config.authorized_workers_dir or None)
    except KeyFileError as e:
        raise ConfigError(str(e)) from None
    try:
        if config.authorized_workers_dir:
            curve_server(gw.worker_sock, config.curve_secret_key_file, WORKERS_DOMAIN)
            # A binding outlives whatever its worker may hold: leases, and its registration on every gateway.
            ttl_s = 2 * max(config.lease_s, config.worker_timeout_s)
            gw.worker_keys = WorkerKeys(shared=SharedWorkerKeys(gw.queue.client, gw.queue.keys, ttl_s),
                                        redis_down=gw._redis_down, redis_failed=gw._redis_failed)
        if config.client_curve:
            curve_server(gw.clients, config.curve_secret_key_file, CLIENTS_DOMAIN)
    except KeyFileError as e:
        auth.stop()
        raise ConfigError(str(e)) from None
    return auth


class SharedWorkerKeys:
    """The cluster's binding of worker ids to CURVE keys, in Redis (``worker-key:<id>``): what each gateway's memory
    holds is only what it heard, so a gateway that restarted, or one a worker had not reached yet, would give a live
    worker's id to the first listed key that said hello with it. A binding expires ``ttl_s`` after its worker's last
    hello or load report (refreshed at most every quarter of it), so an id whose worker is gone for good is free
    again, and a worker moved to a new key under its old id is welcome once that time has passed."""

    def __init__(self, client: redis.Redis, keys: KeySpace, ttl_s: float) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.client, self.keys = client, keys
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self._refreshed: OrderedDict[str, float] = OrderedDict()

    def claim(self, worker_id: str, key: str) -> str | None:
        """Bind ``worker_id`` to ``key`` (or refresh the binding) if it is free or already this key's; else the key
        it is bound to. Raises redis.RedisError when Redis does not answer."""
        # Noted as asked before Redis is: a Redis that does not answer is asked again a quarter TTL later, not at
        # every load report (each a blocked call of the gateway's loop, beside the lease extension's own).
        self._refreshed[worker_id] = time.monotonic()
        self._refreshed.move_to_end(worker_id)
        while len(self._refreshed) > WORKER_KEY_MEMORY:
            self._refreshed.popitem(last=False)
        name = self.keys.worker_key(worker_id)
        for _ in range(3):  # each turn loses only to the binding expiring between two commands
            if self.client.set(name, key, nx=True, px=self.ttl_ms):
                break
            bound = self.client.get(name)
            if bound is None:
                continue
            if bound.decode(errors="replace") != key:
                return bound.decode(errors="replace")
            if self.client.pexpire(name, self.ttl_ms):
                break
        return None

    def due(self, worker_id: str) -> bool:
        """True if ``worker_id``'s binding was last asked for here a quarter of its TTL ago or more."""
        return time.monotonic() - self._refreshed.get(worker_id, float("-inf")) >= self.ttl_ms / 4000


class WorkerKeys:
    """The CURVE key each worker id first said hello with, on this gateway. ZeroMQ's ROUTER refuses a second
    connection with an identity in use, but not a later one: without this, a holder of any listed key could connect
    as a worker whose connection was gone (restarted, cut off) and, with or without a hello, hold its leases and
    send its jobs' results. Bounded: the oldest ids not registered are forgotten past ``memory``. With ``shared``,
    a hello is also held to the cluster's binding (SharedWorkerKeys); if Redis does not answer, to this
    gateway's memory alone."""

    def __init__(self, memory: int = WORKER_KEY_MEMORY, shared: SharedWorkerKeys | None = None,
                 redis_down: Callable[[], bool] = lambda: False,
                 redis_failed: Callable[[Exception], None] = lambda e: None) -> None:
        self.memory = memory
        self.shared = shared
        # The gateway's back-off: while it lasts the binding is not asked for (each ask would wait out the socket
        # timeout before the handler's own Redis call did again), and an ask that fails starts it.
        self.redis_down, self.redis_failed = redis_down, redis_failed
        self.keys: OrderedDict[str, str] = OrderedDict()

    def claim(self, worker_id: str, key: str | None, registered: Container[str]) -> str | None:
        """Bind ``worker_id`` to ``key`` if it is free or already bound to it; else the key it is bound to. The
        cluster's binding decides when Redis answers (it outlives this gateway's memory, and frees an id whose
        worker is gone for good); this gateway's memory when it does not."""
        shared = self._shared_claim(worker_id, key)
        if shared is _UNKNOWN:
            bound = self.keys.get(worker_id)
            if bound is not None and bound != key:
                return bound
        elif shared is not None:
            return shared
        self.keys[worker_id] = key
        self.keys.move_to_end(worker_id)
        if len(self.keys) > self.memory:
            for old in [w for w in self.keys if w not in registered][:len(self.keys) - self.memory]:
                del self.keys[old]
        return None

    def refresh(self, worker_id: str, key: str | None) -> None:
        """Keep a registered worker's cluster binding alive (its load reports call this; Redis is asked only when
        the binding is due)."""
        if self.shared is not None and key is not None and self.shared.due(worker_id):
            if isinstance(bound := self._shared_claim(worker_id, key), str):
                log.warning("worker %s is registered here with key %s, but the cluster binds its id to %s",
                            worker_id, key, bound)

    def _shared_claim(self, worker_id: str, key: str | None):
        """The cluster's answer to ``claim``: None (bound to ``key``), the key it is bound to, or _UNKNOWN (no
        shared binding here, no key to bind, or Redis did not answer)."""
        if self.shared is None or key is None or self.redis_down():
            return _UNKNOWN
        try:
            return self.shared.claim(worker_id, key)
        except redis.RedisError as e:
            log.warning("worker %s: the cluster's key binding is unreadable (%s); this gateway's memory decides",
                        worker_id, e)
            self.redis_failed(e)
            return _UNKNOWN

    def matches(self, worker_id: str, key: str | None) -> bool:
        return key is not None and self.keys.get(worker_id) == key


def recv_with_key(sock: zmq.Socket) -> tuple[list[bytes], str | None]:
    """``recv_multipart(NOBLOCK)``, and the CURVE key (z85, the ZAP handler's User-Id) the message came with. Only
    the body is received as a zmq.Frame: a whole message so costs as much as before (the ids are short)."""
    parts = [sock.recv(zmq.NOBLOCK)]
    last = None
    while sock.rcvmore:
        last = sock.recv(copy=False)
        parts.append(last.bytes)
    if last is None:
        return parts, None
    try:
        return parts, last.get("User-Id")
    except zmq.ZMQError:  # no ZAP reply gave one: no key, and so no worker id of anyone's
        return parts, None


def is_registered_worker(gw, ident: bytes) -> bool:
    """True if ``ident`` is a worker that completed hello with the key it sends with now (gw.frame_key)."""
    worker_id = ident.decode(errors="replace")
    w = gw.workers.workers.get(worker_id)
    return w is not None and w.identity == ident and (gw.worker_keys is None or
                                                      gw.worker_keys.matches(worker_id, gw.frame_key))


def from_registered_worker(gw, ident: bytes) -> bool:
    """True if ``ident`` is a worker that completed hello; anything else is dropped and counted, and the peer
    asked (at most once a second) to say hello: a worker this gateway forgot, by a restart or a worker timeout,
    would otherwise wait for its next periodic hello while its frames and its jobs' leases went unheard."""
    if is_registered_worker(gw, ident):
        return True
    gw.counters["dropped_no_hello"] += 1
    if _now_and_then(gw.counters["dropped_no_hello"]):
        log.warning("dropped %d frame(s) from worker-socket peers that never said hello",
                    gw.counters["dropped_no_hello"])
    gw._ask_hello(ident, "this gateway does not know you (it restarted, or you timed out): say hello")
    return False


def room_for_worker(gw, ident: bytes, worker_id: str) -> bool:
    """True if the worker registry takes a hello from ``worker_id`` (gateway/workers.MAX_WORKERS); else the hello is
    refused, counted and answered (the worker says hello again with its periodic one, by when room may be made)."""
    if gw.workers.has_room(worker_id):
        return True
    gw.counters["hello_refused"] += 1
    gw.counters["hello_refused_full"] += 1
    if _now_and_then(gw.counters["hello_refused_full"]):
        log.warning("refused hello from %s: %d workers registered, each reporting (gateway/workers.MAX_WORKERS); "
                    "%d such hellos refused", worker_id, len(gw.workers.workers), gw.counters["hello_refused_full"])
    gw._send(gw.worker_sock, ident, P.ErrorReply("forbidden", "hello refused: this gateway holds as many workers "
                                                              "as it may, each reporting"))
    return False


def forgot_worker(gw, forgotten: str, newcomer: str) -> None:
    """``forgotten`` said hello, never reported, and made room for ``newcomer`` (gateway/workers.MAX_WORKERS)."""
    gw.counters["workers_forgotten"] += 1
    if _now_and_then(gw.counters["workers_forgotten"]):
        log.warning("forgot worker %s, which said hello and never reported, to make room for %s "
                    "(gateway/workers.MAX_WORKERS); %d forgotten so", forgotten, newcomer,
                    gw.counters["workers_forgotten"])


def _now_and_then(count: int) -> bool:
    """Log at the 1st, 10th, 100th, 1000th and every 10,000th time: a peer's flood must not flood the log."""
    return count in (1, 10, 100, 1000) or count % 10_000 == 0


@functools.lru_cache(maxsize=4)
def longest_token_chars(tokenizer) -> int:
    """Most characters of text one token can stand for: the longest token string in the vocabulary.

    Byte-level BPE spells each byte as one character and SentencePiece each space as one, so a token's
    string is never shorter than the text it covers; a prompt longer than max_model_len times this
    cannot fit the context, whatever it tokenizes to.
    """
    return max(1, max((len(t) for t in tokenizer.get_vocab()), default=1))


def bounded_tokenize(tokenizer, max_model_len: int):
    """``tokenize(text)`` that refuses, before tokenizing, a text too long to fit ``max_model_len`` tokens."""
    limit = max_model_len * longest_token_chars(tokenizer)

    def tokenize(text: str) -> list[int]:
        if len(text) > limit:
            raise InvalidRequest(f"the prompt ({len(text)} characters) cannot fit the model's context of "
                                 f"{max_model_len} tokens", field="prompt")
        return tokenizer(text).input_ids

    return tokenize
