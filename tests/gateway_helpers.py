"""A gateway built in this process as `python -m gateway` builds it (gateway/__main__.build), for tests that drive
its loop's parts directly: its real sockets, bound to free ports, on a redis-server of its own."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from common.redis_server import RedisServer
from gateway.__main__ import build
from gateway.config import GatewayConfig
from gateway.server import Gateway
from scripts.up import write_tenants


@contextmanager
def built_gateway(tmp_path: Path, prefix: str, worker_bind: str = "tcp://127.0.0.1:*",
                  ) -> Iterator[tuple[Gateway, dict, RedisServer]]:
    """(the gateway, the tenants scripts/up.py wrote to ``tmp_path``, its redis-server), under a key prefix of its own
    that begins with ``prefix``; closed after. ``worker_bind``: where workers reach it (a free port by default; one
    a worker already connects to, for a gateway that comes up after it)."""
    tenants = write_tenants(tmp_path / "tenants.toml")
    with RedisServer() as server:
        config = GatewayConfig(client_bind="tcp://127.0.0.1:*", worker_bind=worker_bind,
                               redis_url=server.url, tenants_file=str(tmp_path / "tenants.toml"),
                               key_prefix=f"{prefix}-{uuid.uuid4().hex[:8]}", insecure_workers=True)
        gw = build(config)
        gw.bind()
        try:
            yield gw, tenants, server
        finally:
            gw.close()
