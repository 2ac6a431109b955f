"""The cluster's tokenizer, pinned in its Redis.

Gateways share one Redis, and a job queued there holds the token ids the admitting gateway (or the HTTP door)
made with its tokenizer; any gateway may dispatch it. A gateway that refuses workers of another tokenizer
(gateway/hello_policy.py) still dispatched the jobs a gateway started with another tokenizer had queued, to
its own workers, whose model then ran ids another tokenizer made. So the first gateway started with a tokenizer
pins its digest in Redis, a gateway started with another refuses to start, and one without a tokenizer takes
the pinned digest as the one its workers must have.
"""

from __future__ import annotations

import redis

from common.redis_keys import KeySpace
from common.settings import ConfigError


def claim(client: redis.Redis, keys: KeySpace, digest: str | None) -> str | None:
    """Pin ``digest`` (this gateway's tokenizer's; None: it has none) unless one is pinned; return the pinned one
    (None: none yet). Raises ConfigError when the pinned one is not ``digest``, redis.RedisError when Redis does not
    answer (gateway/redis_startup.py tries again)."""
    if digest is not None:
        client.set(keys.tokenizer, digest, nx=True)
    held = client.get(keys.tokenizer)
    pinned = held.decode() if held is not None else None
    if digest is not None and pinned is not None and pinned != digest:
        raise ConfigError(
            f"this gateway's tokenizer ({digest[:19]}) is not the one the jobs in this Redis were tokenized with "
            f"({pinned[:19]}), under key prefix {keys.prefix!r}: start it with the cluster's --tokenizer; to serve "
            f"another model, use another key_prefix, or drain the queues and delete {keys.tokenizer!r}")
    return pinned
