"""A gateway may take smaller frames than the protocol's 8 MiB (client_max_message_bytes). Its ZeroMQ drops the
connection that brings a larger one, so the SDK asks before it sends such a frame, and the caller gets
InvalidRequest naming the size, while the streams sharing the connection go on.

Real processes (scripts/up.py: redis-server, a gateway, a worker).
"""

from __future__ import annotations

import asyncio

import pytest

from common.errors import InvalidRequest
from gateway.sdk import AsyncGatewayClient, GatewayClient
from tests.cluster_helpers import job_ids, local_cluster, state_pids
from tests.sdk_helpers import SdkWarnings, refused_beside, refused_blocking

LIMIT = 64 * 2**10


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("frame-limit"), tiny_model_dir, workers=1, max_running=4, http=False,
                       env={"TS_GATEWAY_CLIENT_MAX_MESSAGE_BYTES": str(LIMIT)}) as c:
        yield c


def key(c: dict) -> str:
    return c["tenants"]["lab-co"]["api_key"]


def test_a_frame_over_the_gateways_own_limit_is_refused_by_size_and_streams_beside_it_go_on(cluster):
    """A prompt of 100 kB to a gateway taking frames of 64 KiB passed the SDK's own 8 MiB check and was sent: the
    gateway's ZeroMQ dropped the connection, the call failed after every retry with a TimeoutError (blaming a
    gateway that was up), and the stream beside it went silent until it failed over."""
    before = set(job_ids(cluster))
    n = 400
    too_big = [{"prompt_token_ids": [3] * 100_000}, {"prompt": "x" * 100_000}]

    async def main():
        async with AsyncGatewayClient(cluster["gateway"], key(cluster), timeout_s=3, retries=1) as client:

            async def under():
                # Under the gateway's limit but large enough to be asked about: sent, and judged by the gateway.
                with pytest.raises(InvalidRequest) as e:
                    await client.submit(max_tokens=4, prompt_token_ids=[3] * 30_000)
                return str(e.value)

            refusals, under, beside = await refused_beside(client, n, too_big,
                                                           lambda: client.status("j" * 100_000), under,
                                                           state_pids(cluster)["wk-0"])
            return refusals, under, beside.streamed, beside.result, beside.job.id

    with SdkWarnings() as warned:
        refusals, under, streamed, result, job_id = asyncio.run(main())
    assert [f for f, _, _ in refusals] == ["prompt_token_ids", "prompt", "job_id"], refusals
    assert all(str(LIMIT) in why and took < 2 for _, why, took in refusals), refusals
    assert "client_max_message_bytes" not in under, under
    assert streamed == result and len(result) == n
    assert not warned.messages, warned.messages  # no stream lost its gateway

    refused_blocking(cluster["gateway"], key(cluster), too_big, LIMIT)
    assert len(set(job_ids(cluster)) - before) == 2 and job_id in set(job_ids(cluster))  # the refused stored nothing


def test_a_large_submission_is_encoded_once_before_it_is_sent(cluster, monkeypatch):
    """The SDK measured a submission (its 8 MiB check), then encoded it again to decide whether to ask the gateway
    about its size, and a third time to word a refusal: ~70 ms of CPU each for a million-id prompt. Measured once,
    it is encoded once more only to be sent (with each attempt's request id)."""
    from common import protocol

    encoded: list[int] = []
    encode = protocol.encode

    def counted(msg):
        frame = encode(msg)
        if len(frame) > 20_000:
            encoded.append(len(frame))
        return frame

    monkeypatch.setattr(protocol, "encode", counted)

    async def main():
        async with AsyncGatewayClient(cluster["gateway"], key(cluster), timeout_s=10, retries=0) as client:
            for ids in ([3] * 30_000, [3] * 100_000):  # taken by the gateway (whose answer refuses it), and not
                with pytest.raises(InvalidRequest):
                    await client.submit(max_tokens=4, prompt_token_ids=ids)

    asyncio.run(main())
    asynced, encoded[:] = list(encoded), []
    with GatewayClient(cluster["gateway"], key(cluster), timeout_s=10, retries=0) as client:
        for ids in ([3] * 30_000, [3] * 100_000):
            with pytest.raises(InvalidRequest):
                client.submit(max_tokens=4, prompt_token_ids=ids)
    # 30,000 ids: measured, then sent; 100,000: measured, then refused by the gateway's answer to the question.
    assert len(asynced) == 3 and len(encoded) == 3, (asynced, encoded)
