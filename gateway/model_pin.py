"""The cluster's one model, pinned in its Redis (``model``, common/lua/model_pin.lua).

Each gateway pinned the model of the first worker it took, in its memory alone: two gateways that heard workers
of two models in another order each took one and refused the other, and a gateway restarted took whichever it
heard first. The jobs in their shared queues went to both models, every answer marked done. Now the first worker
any gateway takes pins its model in Redis; every gateway holds a hello to that pin, and each taken worker keeps it
alive (its hello, then its load reports, at most every quarter of the pin's lifetime). The pin lapses
2 x max(lease, worker timeout) after the last such report: with no worker of it left anywhere, the cluster may
serve another model (to change models: stop every worker, wait that long, start the new ones). While Redis does
not answer, a gateway's own memory decides, as it did; a worker so taken gets no job until a load report once Redis
answers finds its model the cluster's, and is dropped there if the pin refuses it (gateway/worker_link.py,
WorkerState.unconfirmed).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import redis

from common.redis_keys import KeySpace, load_scripts
from gateway.hello_policy import Pinned, scheme

log = logging.getLogger("gateway.security")

KEPT_MEMORY = 10_000  # worker ids whose last keep is remembered (ModelPin.due)
UNKNOWN = object()  # Redis was not asked (its back-off) or did not answer: this gateway's memory decides
# Redis answered with a pin this gateway cannot read (another version's, a hand edit): its memory decides too, but
# Redis answered: waiting for it to say more (as for UNKNOWN, WorkerState.unconfirmed) would wait for ever.
UNREADABLE = object()


class ModelPin:
    def __init__(self, client: redis.Redis, keys: KeySpace, ttl_s: float,
                 redis_down: Callable[[], bool] = lambda: False,
                 redis_failed: Callable[[Exception], None] = lambda e: None) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.client, self.keys = client, keys
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.redis_down, self.redis_failed = redis_down, redis_failed
        self._kept: OrderedDict[str, float] = OrderedDict()

    def read(self):
        """The cluster's pin (Pinned), None where none is, UNREADABLE or UNKNOWN."""
        return self._ask(lambda: self.client.hgetall(self.keys.model))

    def keep(self, hello):
        """Pin the model of ``hello`` (a worker this gateway took) where none is, and keep the pin alive; the
        cluster's pin after (Pinned), UNREADABLE or UNKNOWN."""
        digest = hello.weights_digest
        args = [str(self.ttl_ms), hello.model, str(hello.vocab_size), str(hello.max_model_len),
                scheme(digest) or "", digest or ""]
        pinned = self._ask(lambda: _as_hash(load_scripts(self.client)["model_pin"](keys=[self.keys.model],
                                                                                   args=args)))
        if pinned is not UNKNOWN:  # else not noted as kept: the next report asks (noted, it skipped a quarter TTL)
            self._kept[hello.worker_id] = time.monotonic()
            self._kept.move_to_end(hello.worker_id)
            while len(self._kept) > KEPT_MEMORY:
                self._kept.popitem(last=False)
        return pinned

    def due(self, worker_id: str) -> bool:
        """True if ``worker_id`` last kept the pin here a quarter of its lifetime ago or more."""
        return time.monotonic() - self._kept.get(worker_id, float("-inf")) >= self.ttl_ms / 4000

    def _ask(self, call: Callable[[], dict]):
        if self.redis_down():
            return UNKNOWN
        try:
            raw = call()
        except redis.RedisError as e:
            log.warning("the cluster's model pin is unreadable (%s); this gateway's memory decides", e)
            self.redis_failed(e)
            return UNKNOWN
        return _parse(raw)


def _as_hash(flat: list) -> dict:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}


def _parse(raw: dict):
    if not raw:
        return None
    fields = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in raw.items()}
    try:
        return Pinned(fields["model"], int(fields["vocab_size"]), int(fields["max_model_len"]),
                      {k.removeprefix("digest:"): v for k, v in fields.items() if k.startswith("digest:")})
    except (KeyError, ValueError):
        log.warning("the cluster's model pin is not one this gateway reads (%s); its memory decides", fields)
        return UNREADABLE
