"""What every long-running process of the cluster shares: its command line, its stop signal, and (started by a
launcher) its death with that launcher."""

from __future__ import annotations

import argparse
import atexit
import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

from common import settings


def parser(prog: str, doc: str, config_cls: type, env_prefix: str) -> argparse.ArgumentParser:
    """--config and --log-level, with every configuration key listed in --help."""
    ap = argparse.ArgumentParser(
        prog=prog, description=doc.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"configuration keys (TOML file or {env_prefix}<KEY>):\n" + settings.describe(config_cls))
    ap.add_argument("--config", help="TOML configuration file")
    ap.add_argument("--log-level", default="INFO")
    return ap


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def serve_until_signalled(serve: Callable[[Callable[[], bool]], None], close: Callable[[], None],
                          drain: Callable[[], None] | None = None) -> int:
    """Run ``serve(should_stop)`` until SIGTERM or SIGINT, then ``close()``; the exit status (0). With ``drain``, a
    signal calls it instead, and ``serve`` decides when to return (a worker finishing its jobs: worker/drain.py)."""
    stop = {"now": False}

    def on_signal(signum, frame) -> None:
        if drain is None:
            stop["now"] = True
        else:
            drain()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        serve(lambda: stop["now"])
    finally:
        close()
    return 0


def exit_now(status: int) -> NoReturn:
    """End the process as the interpreter would, less its final teardown: other threads joined (threading's own
    exit hooks, thread pools', first), atexit handlers run (spans flushed, logging closed), stdio flushed. The
    teardown left out (freeing every module and object) took 1-1.5 s of CPU with torch and transformers loaded,
    at every stop and restart of a gateway or worker, and writes nothing: no file or socket of ours is left to
    it (zmq stops at exit without closing sockets either)."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is None:  # not CPython's threading: the slow exit, but a whole one
        sys.exit(status)
    shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(status if isinstance(status, int) else 0 if status is None else 1)  # as sys.exit reads it


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for Popen: the child is sent ``signum`` when this process dies, even by SIGKILL, so a
    launcher killed outright orphans nothing. None (the child outlives a killed parent) off Linux, and off the
    main thread: Linux sends the signal when the forking *thread* ends, and a helper thread's end would stop the
    child of a process that lives on."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the prctl took: nobody will send the signal
            os._exit(1)
    return preexec
