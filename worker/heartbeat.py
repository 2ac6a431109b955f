"""The worker's heartbeat, on its own thread: leases must not depend on how long an engine step takes.

The step loop publishes a load snapshot (cheap, once per step at most every half interval, and
before a step whenever jobs came or went, so a job is listed before its first step, which may be
a prefill longer than its lease); this thread sends the latest snapshot every ``interval_s`` and a
WorkerHello every ``hello_every_s``.
A ZeroMQ socket is not thread-safe, so every use of the worker's sockets (here and in the step
loop) happens under one lock; the step itself runs without it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Heartbeat(threading.Thread):
    def __init__(self, lock: threading.Lock, beat: Callable[[], None], hello: Callable[[], None],
                 interval_s: float, hello_every_s: float) -> None:
        super().__init__(daemon=True, name="heartbeat")
        self.lock, self.beat, self.hello = lock, beat, hello
        self.interval_s, self.hello_every_s = interval_s, hello_every_s
        self.stopped = threading.Event()
        self.beats = 0  # heartbeats sent, for tests and the state log

    def run(self) -> None:
        last_hello = time.monotonic()
        while not self.stopped.wait(self.interval_s):
            with self.lock:
                self.beat()
                self.beats += 1
                if time.monotonic() - last_hello >= self.hello_every_s:
                    last_hello = time.monotonic()
                    self.hello()

    def stop(self) -> None:
        self.stopped.set()
        if self.is_alive():
            self.join(timeout=5)
