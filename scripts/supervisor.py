"""Keep a set of named processes running: restart whichever dies, with the same command, and back off when
one keeps dying.

Each process is restarted by its own ``start`` function (same identity, ports and data directory: the
caller's business), at once the first time, then after 0.5, 1, 2, ... up to MAX_BACKOFF_S while it keeps
dying within STABLE_S of its start, so a crash loop costs little CPU and fills no log. ``on_change`` gets
the current pids after every restart (up.py rewrites its state file with them).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

STABLE_S = 10.0  # a process that ran this long is healthy again: its next restart is immediate
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0


class Process(Protocol):
    pid: int

    def poll(self) -> int | None: ...


@dataclass
class _Entry:
    name: str
    start: Callable[[], Process]
    proc: Process
    started_at: float
    quick_deaths: int = 0  # deaths in a row, each within STABLE_S of its start
    restart_at: float | None = None  # when a dead process is due to start again
    restarts: int = 0
    exit_code: int | None = None


class Supervisor:
    def __init__(self, on_change: Callable[[dict[str, int]], None], log=sys.stderr,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._entries: dict[str, _Entry] = {}
        self._on_change = on_change
        self._log = log
        self._clock = clock

    def add(self, name: str, proc: Process, start: Callable[[], Process]) -> None:
        """Supervise ``proc`` (already started) under ``name``; ``start()`` starts a replacement."""
        self._entries[name] = _Entry(name, start, proc, self._clock())

    def pids(self) -> dict[str, int]:
        return {name: e.proc.pid for name, e in self._entries.items()}

    def restarts(self) -> dict[str, int]:
        return {name: e.restarts for name, e in self._entries.items()}

    def check(self) -> None:
        """One supervision tick: notice deaths, start what is due. Call it a few times a second."""
        changed = False
        for e in self._entries.values():
            now = self._clock()
            if e.restart_at is None:
                code = e.proc.poll()
                if code is None:
                    continue
                e.exit_code = code
                e.quick_deaths = e.quick_deaths + 1 if now - e.started_at < STABLE_S else 1
                delay = 0.0 if e.quick_deaths == 1 else min(MAX_BACKOFF_S,
                                                             FIRST_BACKOFF_S * 2 ** (e.quick_deaths - 2))
                e.restart_at = now + delay
                self._say(f"{e.name} (pid {e.proc.pid}) exited with code {code}; restarting"
                          + (f" in {delay:.1f}s ({e.quick_deaths} quick exits in a row)" if delay else ""))
            if now < e.restart_at:
                continue
            try:
                proc = e.start()
            except Exception as exc:  # e.g. its port taken meanwhile: try again later, backing off
                e.quick_deaths += 1
                e.restart_at = now + min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (e.quick_deaths - 2))
                self._say(f"{e.name} could not be restarted: {exc}")
                continue
            e.proc, e.started_at, e.restart_at = proc, self._clock(), None
            e.restarts += 1
            changed = True
            self._say(f"{e.name} restarted as pid {proc.pid} (restart {e.restarts})")
        if changed:
            self._on_change(self.pids())

    def _say(self, text: str) -> None:
        print(f"up.py: {text}", file=self._log, flush=True)
