"""The gateways, seen from the front door: one async SDK client per API key in use.

The SDK's client speaks for one API key, and the front door serves every tenant, so it holds
a client per key that has asked recently (bounded: the least recently used idle client is
closed past ``max_clients``, a client being idle once no answer of a job it submitted is still
being sent; a key the gateway refuses is forgotten at once, so strangers
cannot fill the table). A key is checked with a gateway before the door reads the request that
came with it (``check``; again once the gateway's word is AUTH_MAX_AGE_S old): a stranger, or a
tenant the gateways no longer know, gets 401 and no other answer. Nothing here outlives a
restart: jobs live in the gateways' Redis.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from common import protocol as P
from common.errors import Unauthorized
from common.keys import KeyFileError
from common.settings import ConfigError
from common.sockets import public_key
from gateway.sdk import AsyncGatewayClient, GatewayClient

# How long a gateway's word that it knows a key stands (its latest info answer for the key): a tenant removed from
# the gateways' tenants file (and the gateways restarted) is a stranger to the door once this has passed, and the
# door reads nothing of its requests. Shorter than a gateway takes to restart; an active key is asked once a second.
AUTH_MAX_AGE_S = 1.0


class _Entry:
    def __init__(self, client: AsyncGatewayClient) -> None:
        self.client = client
        self.users = 0
        self.known = False  # a gateway said it knows this key
        self.info: P.InfoReply | None = None  # a gateway's latest answer to this key's info call
        self.info_at = -math.inf  # when it came (monotonic)


class Upstream:
    def __init__(self, endpoints: list[str], timeout_s: float, max_clients: int = 1024,
                 server_public_key: str | None = None) -> None:
        if not endpoints:
            raise ValueError("at least one gateway endpoint is needed")
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        try:  # read once, at start: a bad one failed each API key's first request, as a 400 of the SDK's
            self.server_public_key = public_key(server_public_key) if server_public_key else None
        except KeyFileError as e:
            raise ConfigError(f"gateway_public_key: {e}") from None
        self.max_clients = max_clients
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def _new_client(self, api_key: str) -> AsyncGatewayClient:
        # Every gateway: the SDK fails over between them.
        return AsyncGatewayClient(self.endpoints, api_key, timeout_s=self.timeout_s,
                                  server_public_key=self.server_public_key)

    def blocking_client(self, api_key: str) -> GatewayClient:
        """A blocking client of ``api_key`` with the async ones' settings, for a call made off the event loop
        (gateway/http/submission.py); the caller closes it."""
        return GatewayClient(self.endpoints, api_key, timeout_s=self.timeout_s,
                             server_public_key=self.server_public_key)

    @asynccontextmanager
    async def client(self, api_key: str) -> AsyncIterator[_Entry]:
        entry, release = self.hold(api_key)
        try:
            yield entry
        finally:
            release()

    def hold(self, api_key: str) -> tuple[_Entry, Callable[[], None]]:
        """The key's client, kept from eviction until the returned release is called (later calls do nothing).
        A job streams through the client that submitted it after the submission returns: closing that client
        left the job's stream silent until the SDK took the gateway for dead (upstream_timeout_s)."""
        entry = self._entries.get(api_key)
        if entry is None:
            entry = self._entries[api_key] = _Entry(self._new_client(api_key))
        self._entries.move_to_end(api_key)
        entry.users += 1
        # Only once counted: with every other client busy, the new one was the idle one evicted (a 500, KeyError).
        self._evict()
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                entry.users -= 1

        return entry, release

    async def check(self, api_key: str) -> None:
        """Raise Unauthorized if the gateway does not know ``api_key``. Asked again once the gateway's latest word on
        the key is AUTH_MAX_AGE_S old: taken as known for as long as the door kept its client, a key whose tenant
        was removed had its requests read, validated and tokenized (a 404 naming the served model, not a 401)
        until one reached a gateway. Any other error (TimeoutError, Unavailable while Redis is down) is raised as
        well and leaves the key unchecked: it is asked again next time."""
        entry = self._entries.get(api_key)
        if entry is not None and entry.known and time.monotonic() - entry.info_at <= AUTH_MAX_AGE_S:
            self._entries.move_to_end(api_key)
            return
        try:
            await self.info(api_key, max_age_s=0.0)
        except Unauthorized:
            if entry is not None:
                entry.known = False  # kept while a job of the key still streams through it
            self.forget(api_key)
            raise

    async def info(self, api_key: str, max_age_s: float) -> P.InfoReply:
        """A gateway's info for ``api_key`` (its token limits: gateway/http/submission.py), asked again when the one
        held is older than ``max_age_s``. Raises as check does."""
        entry = self._entries.get(api_key)
        if entry is not None and entry.info is not None and time.monotonic() - entry.info_at <= max_age_s:
            return entry.info
        async with self.client(api_key) as entry:
            info = await entry.client.info(limits=True, tokenizer=True)
            entry.known, entry.info, entry.info_at = True, info, time.monotonic()
            return info

    def tokenizer_digest(self, api_key: str) -> str | None:
        """The cluster's tokenizer digest in the latest info answer for ``api_key`` (None: not asked yet, or the
        gateway does not know it)."""
        entry = self._entries.get(api_key)
        return entry.info.tokenizer_digest if entry is not None and entry.info is not None else None

    def forget(self, api_key: str) -> None:
        """Drop the client of a key the gateway did not know."""
        entry = self._entries.get(api_key)
        if entry is not None and entry.users == 0:
            del self._entries[api_key]
            entry.client.close()

    def _evict(self) -> None:
        for key in list(self._entries):
            if len(self._entries) <= self.max_clients:
                return
            entry = self._entries[key]
            if entry.users == 0:
                del self._entries[key]
                entry.client.close()

    def close(self) -> None:
        for entry in self._entries.values():
            entry.client.close()
        self._entries.clear()
