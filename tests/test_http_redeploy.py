"""The HTTP door during a redeploy of workers of different sizes: a request only the worker being redeployed fits is
told to come back (503, Retry-After), as the gateway tells an SDK client, not that it is invalid (400).

Real processes: redis-server, a gateway, a small and a big real worker (tests/durable_cluster.py), a real
`python -m gateway.http`, and the official openai client.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from gateway.http.sizing import LIMITS_MAX_AGE_S
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster
from tests.test_http import front_door

pytestmark = pytest.mark.faults  # real clusters: `make test-faults` runs these alone

# KV blocks of 16 tokens: every tier of the small worker holds 64 tokens a job, of the big one 1024.
KV_BLOCKS = {"wk-small": 4, "wk-big": 64}


class UnevenCluster(DurableCluster):
    """One gateway, a small and a big real worker."""

    def __init__(self, tmp_path, model_dir) -> None:
        super().__init__(tmp_path, model_dir, gateways=1, workers=0)
        self.worker_ids = list(KV_BLOCKS)

    def _cmd(self, name: str) -> list[str]:
        extra = ["--num-kv-blocks", str(KV_BLOCKS[name])] if name in KV_BLOCKS else []
        return super()._cmd(name) + extra

    def stored(self) -> dict[bytes, object]:
        """Every job, token stream, idempotency key and quota bucket (with its state), and every queue's length."""
        found: dict[bytes, object] = {}
        for pattern in ("job", "tok", "idem", "quota", "tenant-jobs"):
            for k in self.redis.keys(f"ts:{{c}}:{pattern}:*"):
                found[k] = self.redis.dump(k)
        for k in self.redis.keys("ts:{c}:q:*"):
            found[k] = self.redis.zcard(k)
        return found


def openai_client(base: str, api_key: str):
    import openai

    # No retries of its own: the test sees each answer (the library retries a 503 after its Retry-After).
    return openai.OpenAI(base_url=base + "/v1", api_key=api_key, max_retries=0, timeout=120)


def big_limit(c: UnevenCluster) -> int | None:
    with c.client("chat-co", timeout_s=10.0) as sdk:
        return (sdk.info(limits=True).tier_token_limits or {}).get("P0")


def test_a_request_only_the_redeployed_worker_fits_is_told_to_retry_not_that_it_is_invalid(tmp_path,
                                                                                          tiny_model_dir):
    """The big worker is SIGTERMed (a redeploy) beside the small one. The door refused a 100-token prompt with a 400
    (its prompt "leaves no room", by the small worker's limit, the only one serving), where the gateway answers an
    SDK client overloaded (retryable) for as long as it remembers the drained worker: a client of the openai library
    was told its valid request was invalid, and not to retry it, seconds before the worker came back. The door lets
    the gateway judge such a prompt now: 503 with Retry-After, nothing stored or charged; once the worker is back
    the request runs; a prompt past every worker seen is still a 400."""
    import openai

    with UnevenCluster(tmp_path, tiny_model_dir) as c, \
            front_door(tiny_model_dir, [c.endpoint()], tmp_path / "door.log") as base:
        chat = openai_client(base, c.key("chat-co"))  # P0, with a quota: a charge would show in Redis
        api = openai_client(base, c.key("api-co"))
        prompt = [5] * 100  # past the small worker's 64 tokens, well within the big one's 1024
        wait_for(lambda: big_limit(c) == 1024, 60, "the gateway to say the big worker's limit")
        keyed = dict(model="tiny-llama", prompt=prompt, extra_body={"ignore_eos": True},
                     extra_headers={"Idempotency-Key": "before-the-redeploy"})
        ran = api.completions.create(**keyed)
        assert ran.usage.completion_tokens == 16  # openai's default for a completion, the room being larger
        asked_at = time.monotonic()  # the door's limits, held for LIMITS_MAX_AGE_S, are the big worker's

        os.kill(c.procs["wk-big"].pid, signal.SIGTERM)
        c.procs["wk-big"].wait(30)
        with c.client("lab-co", timeout_s=10.0) as sdk:
            wait_for(lambda: "wk-big" not in sdk.info().workers, 30, "the gateway to drop the drained worker")
        assert big_limit(c) == 64  # the small worker's, the only one serving
        time.sleep(max(0.0, asked_at + LIMITS_MAX_AGE_S + 0.5 - time.monotonic()))  # the door asks for them again

        before = c.stored()
        for kwargs in ({}, {"max_tokens": 20}):  # sized by the door, or by the client
            with pytest.raises(openai.APIStatusError) as e:
                chat.completions.create(model="tiny-llama", prompt=prompt, extra_body={"ignore_eos": True}, **kwargs)
            assert e.value.status_code == 503, e.value.response.text
            assert e.value.response.headers["Retry-After"] == "5"
            assert e.value.body["code"] == "overloaded", e.value.body
        with pytest.raises(openai.BadRequestError) as e:  # past the big worker too: invalid whenever it comes back
            chat.completions.create(model="tiny-llama", prompt=[5] * 1100)
        assert e.value.body["param"] == "prompt", e.value.body
        # The retry of a request admitted before the redeploy, its answer lost: its job (the key's promise), not a 400.
        again = api.completions.with_raw_response.create(**keyed)
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.parse().id == ran.id and again.parse().choices[0].text == ran.choices[0].text
        assert c.stored() == before  # no job, no stream, no key, no quota charged

        c.restart("wk-big")  # back from its redeploy, same id and size
        wait_for(lambda: big_limit(c) == 1024, 120, "the gateway to hear the big worker again")
        for kwargs, tokens in (({}, 16), ({"max_tokens": 20}, 20)):  # openai's default for a completion is 16
            done = chat.completions.create(model="tiny-llama", prompt=prompt, extra_body={"ignore_eos": True},
                                           **kwargs)
            assert done.usage.completion_tokens == tokens
