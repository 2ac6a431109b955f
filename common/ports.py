"""Picking a free TCP port for a process we are about to start (tests, the local launcher).

A port is chosen here and bound by a child seconds later (a worker binds its /metrics only after
loading torch and a model). A port from the kernel's ephemeral range (``bind(port 0)`` draws from it)
can meanwhile become the local end of any outgoing connection on the machine (a Redis client, an
HTTP request), and the child then dies with "Address already in use". The kernel never hands out a
port below that range on its own, so one drawn there can only be taken by another explicit choice.

One such choice is this process's own: a launcher picks every port of a cluster (two per gateway, one per
worker, ...) before its children bind any, and a port still free at each pick could be handed out twice (2,000
picks in one process repeat some; a CI run saw a gateway of `scripts/up.py` die with "Address already in use" on
a port picked for it). So a port handed out is not handed out again while it is among the last ``_REMEMBERED``
this process gave.
"""

from __future__ import annotations

import random
import socket
import threading
from collections import deque
from pathlib import Path

_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default, also used where the file is absent
_LOWEST = 10_000  # below this sit many well-known services' ports
_DRAWS = 64
_rng = random.SystemRandom()  # not the caller's seeded `random`, nor a state a forked child shares: draws differ
_REMEMBERED = 4096  # ports handed out that are not handed out again (about a sixth of the room below 32768)
_given: deque[int] = deque(maxlen=_REMEMBERED)
_lock = threading.Lock()


def ephemeral_range(path: Path) -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (inclusive)."""
    try:
        low, high = (int(x) for x in path.read_text().split())
        return low, high
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))  # no SO_REUSEADDR: a port in TIME_WAIT counts as taken
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now, outside the ephemeral range (see the module's doc), and not one
    this process handed out lately.

    Falls back to one the kernel picks (inside the range) only where no such port below it is free after
    a bounded number of draws, or the range leaves no room below it.
    """
    low, _ = ephemeral_range(_EPHEMERAL_RANGE_FILE)
    with _lock:
        port = None
        if low - 1 >= _LOWEST:
            for _ in range(_DRAWS):
                draw = _rng.randint(_LOWEST, low - 1)
                if draw not in _given and _bindable(host, draw):
                    port = draw
                    break
        while port is None or port in _given:  # the kernel's choice is free now; not handed out lately either
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        _given.append(port)
        return port
