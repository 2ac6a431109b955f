"""The one ZeroMQ socket factory: every socket gets finite high-water marks, a linger
bound and a maximum message size, so a slow or hostile peer meets back-pressure and
an explicit "full" instead of unbounded memory. And CURVE: encryption and, on the
gateway's worker socket, authentication of the peer's key against an allow-list."""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from common.keys import KeyFileError, load_allow_list, load_pair, load_public
from common.protocol import MAX_MESSAGE_BYTES

log = logging.getLogger("sockets")

WORKERS_DOMAIN = "workers"  # ZAP domain of the gateway's worker socket: allow-listed keys only
CLIENTS_DOMAIN = "clients"  # ZAP domain of the gateway's client socket: any key (encryption; API keys authenticate)


@dataclass(frozen=True)
class SocketLimits:
    send_hwm: int = 10_000  # messages queued per peer before sends block or fail
    recv_hwm: int = 10_000
    linger_ms: int = 500  # how long close() may wait to flush
    max_message_bytes: int = MAX_MESSAGE_BYTES

    @classmethod
    def per_peer_bytes(cls, budget: int, max_message_bytes: int = MAX_MESSAGE_BYTES, **kw) -> SocketLimits:
        """Limits under which one peer's queued inbound frames hold at most ``budget`` bytes.

        ZeroMQ's high-water marks count messages, so the byte bound is budget // max message size
        messages (at least 1): a peer that sends faster than the loop reads meets TCP back-pressure.
        """
        return cls(recv_hwm=max(1, budget // max_message_bytes), max_message_bytes=max_message_bytes, **kw)


def make_socket(ctx: zmq.Context, kind: int, limits: SocketLimits = SocketLimits(),
                identity: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, limits.send_hwm)
    sock.setsockopt(zmq.RCVHWM, limits.recv_hwm)
    sock.setsockopt(zmq.LINGER, limits.linger_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        # An unroutable reply (peer gone) raises instead of vanishing silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sock


def curve_server(sock: zmq.Socket, secret_file: str | Path, domain: str) -> None:
    """Make ``sock`` (before bind) a CURVE server with the key pair in ``secret_file``; its ZAP domain
    decides which client keys are let in (see ``Authenticator``)."""
    public, secret = load_pair(secret_file)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True
    sock.zap_domain = domain.encode()


def curve_client(sock: zmq.Socket, server_public_key: bytes | str, secret_file: str | Path | None = None) -> None:
    """Make ``sock`` (before connect) a CURVE client of the server whose public key is given (z85, or a
    ``.key`` file path). Without ``secret_file`` an ephemeral pair is used: encryption, no identity."""
    server_key = public_key(server_public_key)
    if secret_file is not None:
        public, secret = load_pair(secret_file)
    else:
        public, secret = zmq.curve_keypair()
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_serverkey = server_key


def public_key(value: bytes | str) -> bytes:
    """The z85 CURVE public key ``value`` is (40 z85 characters) or names (the path of a .key file)."""
    raw = value.encode() if isinstance(value, str) else value
    if len(raw) == 40:
        try:
            zmq.utils.z85.decode(raw)
            return raw
        except (ValueError, KeyError):
            pass
    if isinstance(value, str) and value and Path(value).is_file():
        return load_public(value)
    what = "no such file" if isinstance(value, str) and ("/" in value or value.endswith(".key")) else \
        f"{len(raw)} characters, not a key"
    raise KeyFileError(f"a CURVE public key is 40 z85 characters or the path of a .key file ({what})")


def check_worker_keys(secret_file: str, gateway_public_key: str) -> None:
    """Both or neither (KeyFileError, a ValueError, otherwise); both must be readable."""
    if bool(secret_file) != bool(gateway_public_key):
        raise KeyFileError("CURVE needs both curve_secret_key_file and gateway_public_key (or neither)")
    if secret_file:
        load_pair(secret_file)
        public_key(gateway_public_key)


def secure_worker_sockets(socks: list[zmq.Socket], secret_file: str, gateway_public_key: str) -> None:
    """CURVE on every socket a worker connects to gateways with (before connect)."""
    check_worker_keys(secret_file, gateway_public_key)
    if not secret_file:
        log.warning("no CURVE keys: only a gateway started with --insecure-workers will accept this worker")
        return
    for sock in socks:
        curve_client(sock, gateway_public_key, secret_file)


class Authenticator:
    """The ZAP handler of one process's context: worker keys on an allow-list, client keys all accepted.

    pyzmq's ``configure_curve(location=CURVE_ALLOW_ANY)`` would open *every* domain, so both domains go
    through one credentials callback instead. ``reload()`` re-reads the allow-list (key rotation).
    """

    def __init__(self, ctx: zmq.Context, allow_list_dir: str | Path | None) -> None:
        self.allow_list_dir = allow_list_dir
        self.worker_keys: set[bytes] = load_allow_list(allow_list_dir) if allow_list_dir else set()
        self.denied = 0  # handshakes refused (counted in the authenticator's thread)
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("zap"))
        self._auth.start()
        for domain in (WORKERS_DOMAIN, CLIENTS_DOMAIN):
            self._auth.configure_curve_callback(domain, credentials_provider=self)

    def callback(self, domain: str, client_key: bytes) -> bool:
        ok = domain == CLIENTS_DOMAIN or (domain == WORKERS_DOMAIN and client_key in self.worker_keys)
        if not ok:
            self.denied += 1
            log.warning("refused a CURVE handshake on %s from key %s", domain, client_key.decode(errors="replace"))
        return ok

    def reload(self) -> int:
        if self.allow_list_dir:
            self.worker_keys = load_allow_list(self.allow_list_dir)
        return len(self.worker_keys)

    def stop(self) -> None:
        self._auth.stop()


def is_loopback_endpoint(endpoint: str) -> bool:
    """``tcp://127.x.x.x:port``, ``tcp://[::1]:port``, ``tcp://localhost:port`` or an ipc/inproc endpoint."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    # libzmq reads "source;destination" in any tcp address, a bind's too, and binds the destination: judged by
    # the whole text, "tcp://127.0.0.1:0;0.0.0.0:5556" passed for loopback and bound every interface.
    host = rest.rpartition(";")[2].rsplit(":", 1)[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # an interface name, a wildcard, a host name: not known to be loopback
        return False
