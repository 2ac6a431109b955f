"""When scripts/up.py's cluster counts as up: every gateway knows every worker, and the HTTP front door answers as
itself. Each wait polls with a deadline and gives up at once when ``check`` (a started process exited) raises."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable


def port_free(port: int) -> bool:
    """Whether a server could listen on ``port`` now (SO_REUSEADDR, as uvicorn: a port in TIME_WAIT is free)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_gateway(endpoint: str, key: str, workers: int, timeout: float, check: Callable[[], None],
                 logs: Path) -> None:
    """Until the gateway at ``endpoint`` knows ``workers`` workers."""
    from gateway.sdk import GatewayClient

    deadline = time.monotonic() + timeout
    # retries=0: a probe; a gateway still starting is this loop's business, not a warning in the log.
    client = GatewayClient(endpoint, key, timeout_s=2.0, retries=0)
    try:
        while time.monotonic() < deadline:
            check()
            try:
                if len(client.info().workers) >= workers:
                    return
            except TimeoutError:
                pass
            time.sleep(0.1)  # polling a condition with a deadline, not synchronising on time
        raise RuntimeError(f"cluster not ready within {timeout}s; see the logs in {logs}")
    finally:
        client.close()


def wait_http(base: str, timeout: float, check: Callable[[], None], log: Path) -> None:
    """Until the front door at ``base`` serves, as ours."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check()
        try:  # the front door itself (the gateways and workers were waited for already)
            with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
                models = json.loads(r.read()) if r.status == 200 else {}
            # Ours says so: a server that took the port meanwhile answers too, while ours dies.
            if any(m.get("owned_by") == "tiered-serve" for m in models.get("data", [])):
                return
        except (urllib.error.URLError, OSError, ValueError, AttributeError, TypeError):
            pass
        time.sleep(0.1)  # polling a condition with a deadline
    raise RuntimeError(f"HTTP front door {base} not serving within {timeout}s; see {log}")
