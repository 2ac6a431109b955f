"""A gateway's first Redis calls, made again while Redis does not answer yet.

Once serving, a gateway waits out a Redis that does not answer (gateway/redis_backoff.py). Before, at start, it
exited at the first refused connection or timeout: a gateway restarted while Redis restarted, loaded its AOF or
stood still for a moment (a supervisor's restart of both, a chaos run's kill of one and freeze of the other) was
gone for good where nothing restarts it. A refused password or ACL is no blip: it exits at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from common.settings import ConfigError

log = logging.getLogger("gateway")
T = TypeVar("T")
RETRY_EVERY_S = 0.5


def until_redis_answers(call: Callable[[], T], wait_s: float, failure: str) -> T:
    """``call()``, made again every RETRY_EVERY_S while Redis is unreachable, for up to ``wait_s``; then, as for any
    other Redis error (an answer, a refused password), ConfigError ``failure: <the error>``."""
    deadline = time.monotonic() + wait_s
    waited = False
    while True:
        try:
            return call()
        except (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError) as e:
            raise ConfigError(f"{failure}: {e}") from None
        except (redis.ConnectionError, redis.TimeoutError) as e:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConfigError(f"{failure}: {e}" + (f" (waited {wait_s:g} s)" if waited else "")) from None
            if not waited:
                log.warning("%s (%s); trying again for up to %g s (redis_startup_wait_s)", failure, e, wait_s)
            waited = True
            time.sleep(min(RETRY_EVERY_S, left))
        except redis.RedisError as e:  # an answer (WRONGTYPE, READONLY ...): no blip to wait out
            raise ConfigError(f"{failure}: {e}") from None
