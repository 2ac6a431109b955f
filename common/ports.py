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

Processes that pick ports side by side on one host (parallel test runs, two launchers) cannot see each other's
picks: each may be given a range of its own in ``TS_PORT_RANGE`` (``LOW-HIGH``, inclusive), which its children
inherit; free_port then draws only there.
"""

from __future__ import annotations

import os
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
PORT_RANGE_ENV = "TS_PORT_RANGE"


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
    """A TCP port on ``host`` that is free now, outside the ephemeral range (see the module's doc) or in
    ``TS_PORT_RANGE`` where that is set, and not one this process handed out lately.

    Falls back to one the kernel picks (inside the range) only where no such port below it is free after
    a bounded number of draws, or the range leaves no room below it.
    """
    lowest, highest = draw_range()
    with _lock:
        port = None
        if highest >= lowest:
            for _ in range(_DRAWS):
                draw = _rng.randint(lowest, highest)
                if draw not in _given and _bindable(host, draw):
                    port = draw
                    break
        while port is None or port in _given:  # the kernel's choice is free now; not handed out lately either
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        _given.append(port)
        return port


def draw_range() -> tuple[int, int]:
    """The ports free_port draws from (inclusive): ``TS_PORT_RANGE`` where set, else those from ``_LOWEST`` to
    just below the kernel's ephemeral range (an empty range where it leaves no room: then the kernel picks)."""
    text = os.environ.get(PORT_RANGE_ENV, "").strip()
    if not text:
        return _below_ephemeral()
    try:
        low, high = (int(x) for x in text.split("-"))
    except ValueError:
        low = high = -1
    if not 1024 <= low <= high <= 65535:
        raise ValueError(f"{PORT_RANGE_ENV}={text!r}: expected LOW-HIGH, two ports with 1024 <= LOW <= HIGH <= 65535")
    return low, high


def split_range(index: int, count: int) -> str:
    """The ``index``-th of ``count`` disjoint shares of the default draw range, as a ``TS_PORT_RANGE`` value: for
    processes that pick ports side by side (tests/conftest.py gives each pytest-xdist worker one)."""
    lowest, highest = _below_ephemeral()
    size = (highest - lowest + 1) // count
    if size < 1:
        raise ValueError(f"no room for {count} port ranges in {lowest}-{highest}")
    low = lowest + index * size
    return f"{low}-{low + size - 1}"


def _below_ephemeral() -> tuple[int, int]:
    """The default draw range: from ``_LOWEST`` to just below the kernel's ephemeral range (inclusive)."""
    return _LOWEST, ephemeral_range(_EPHEMERAL_RANGE_FILE)[0] - 1
