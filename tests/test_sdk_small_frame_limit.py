"""A gateway whose client_max_message_bytes is below the 16 KiB under which the SDK used to send frames unasked: a
frame between its limit and 16 KiB dropped the connection, with every stream on it, as larger ones did before the
SDK asked about them (tests/test_sdk_frame_limit.py).

Real processes (scripts/up.py: redis-server, a gateway, a worker).
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.sdk import AsyncGatewayClient
from tests.cluster_helpers import job_ids, local_cluster, state_pids
from tests.sdk_helpers import SdkWarnings, refused_beside, refused_blocking

LIMIT = 4096


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("small-frame-limit"), tiny_model_dir, workers=1, max_running=4,
                       http=False, env={"TS_GATEWAY_CLIENT_MAX_MESSAGE_BYTES": str(LIMIT)}) as c:
        yield c


def key(c: dict) -> str:
    return c["tenants"]["lab-co"]["api_key"]


def test_a_frame_between_a_small_limit_and_16_KiB_is_refused_by_size_and_streams_beside_it_go_on(cluster):
    """A prompt of 8 kB to a gateway taking frames of 4 KiB was sent unasked (under 16 KiB): the gateway's ZeroMQ
    dropped the connection, the stream beside it went silent until it failed over, and the call failed after every
    retry with a TimeoutError instead of an InvalidRequest naming the limit."""
    before = set(job_ids(cluster))
    n = 400
    too_big = [{"prompt_token_ids": [3] * 8000}, {"prompt": "x" * 8000}]

    async def main():
        async with AsyncGatewayClient(cluster["gateway"], key(cluster), timeout_s=3, retries=1) as client:
            # Under the gateway's limit: sent once asked about, and admitted.
            refusals, taken, beside = await refused_beside(
                client, n, too_big, lambda: client.cancel("j" * 8000),
                lambda: client.submit(max_tokens=2, prompt_token_ids=[3] * 1500),
                state_pids(cluster)["wk-0"])
            return refusals, taken.id, beside.streamed, beside.result, beside.job.id

    with SdkWarnings() as warned:
        refusals, taken_id, streamed, result, job_id = asyncio.run(main())
    assert [f for f, _, _ in refusals] == ["prompt_token_ids", "prompt", "job_id"], refusals
    assert all(str(LIMIT) in why and took < 2 for _, why, took in refusals), refusals
    assert streamed == result and len(result) == n
    assert not warned.messages, warned.messages  # no stream lost its gateway

    refused_blocking(cluster["gateway"], key(cluster), too_big, LIMIT)
    assert set(job_ids(cluster)) - before >= {job_id, taken_id}
    assert len(set(job_ids(cluster)) - before) == 3  # the refused stored nothing
