"""A worker's frame for a job it does not hold is dropped, counted, and changes nothing. A gateway that did not know
the job (it did not dispatch it, or it restarted) read its lease from Redis and took that lease for its own, whoever
had sent the frame: from then on it waited for the holder's tokens, which go to the gateway that dispatched the job,
and no longer followed the job's token log, so every client streaming the job through it stalled until the job
ended. Real parts: a redis-server, two `python -m gateway` processes on one key prefix with CURVE on their worker
sockets, raw CURVE DEALERs playing the workers, and the SDK."""

from __future__ import annotations

import threading
import time
import tomllib

from common import protocol as P
from gateway.sdk import GatewayClient
from tests.cluster_helpers import wait_for
from tests.test_security_worker_keys import _first_reply, _hello
from tests.test_security_worker_keys_shared import two_gateways  # noqa: F401 (a fixture)


def _tokens(dispatch: P.DispatchJob, index: int, ids: list[int]) -> P.JobTokens:
    return P.JobTokens(dispatch.job_id, dispatch.attempt, index, ids)


def test_a_frame_for_a_job_another_worker_holds_does_not_stall_its_streams_elsewhere(two_gateways):  # noqa: F811
    (gw1, gw2), (tmp, _, _, _), _ = two_gateways
    key = tomllib.loads((tmp / "tenants.toml").read_text())["tenant"][0]["api_key"]
    holder, hi = _first_reply(gw1, "wk-a", "wk-a", _hello("wk-a"))
    assert isinstance(hi, P.GatewayWelcome), hi
    holder_at_2, hi = _first_reply(gw2, "wk-a", "wk-a", _hello("wk-a"))
    assert isinstance(hi, P.GatewayWelcome), hi
    other, hi = _first_reply(gw2, "wk-b", "wk-b", _hello("wk-b"))
    assert isinstance(hi, P.GatewayWelcome), hi
    submitter, watcher = GatewayClient(gw1["client"], key, timeout_s=30), GatewayClient(gw2["client"], key,
                                                                                        timeout_s=30)
    got: list[tuple[int, list[int], float]] = []
    try:
        holder.send(P.encode(P.WorkerLoad("wk-a", 1, 512, {}, {}, [], 0.0)))  # a slot free, at gw-1 only
        job = submitter.submit(prompt_token_ids=[1, 2, 3], max_tokens=6, tier="P3", ignore_eos=True)
        assert holder.poll(10_000), "no job dispatched to wk-a"
        dispatch = P.decode(holder.recv())
        assert isinstance(dispatch, P.DispatchJob) and dispatch.job_id == job.id, dispatch

        def watch():
            for c in watcher.job(job.id).stream(timeout=30):
                got.append((c.index, list(c.token_ids), time.monotonic()))

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        holder.send(P.encode(_tokens(dispatch, 0, [11, 12])))
        wait_for(lambda: [i for c in got for i in c[1]] == [11, 12], 10, "the first tokens through gw-2")

        # wk-b, registered at gw-2, sends a frame for wk-a's job (a bug, a late copy of an attempt it lost).
        other.send(P.encode(_tokens(dispatch, 2, [99])))
        other.send(P.encode(P.JobFinished(dispatch.job_id, dispatch.attempt, "done", "length", 1, 0.0, 0.0, 0,
                                          token_ids=[99])))
        assert other.poll(10_000), "no answer to wk-b's JobFinished"
        assert P.decode(other.recv()) == P.JobFinishedAck(dispatch.job_id, dispatch.attempt)

        holder.send(P.encode(_tokens(dispatch, 2, [13, 14])))
        sent = time.monotonic()
        wait_for(lambda: [i for c in got for i in c[1]] == [11, 12, 13, 14], 10,
                 "the holder's next tokens through gw-2, in time (they stalled until the job's end)")
        assert got[-1][2] - sent < 5, got
        assert watcher.status(job.id).state == "dispatched"

        holder.send(P.encode(P.JobFinished(dispatch.job_id, dispatch.attempt, "done", "length", 6, 0.1, 0.0, 0,
                                           token_ids=[11, 12, 13, 14, 15, 16])))
        assert job.result(timeout=30).token_ids == [11, 12, 13, 14, 15, 16]
        t.join(30)
        assert [i for c in got for i in c[1]] == [11, 12, 13, 14, 15, 16]
    finally:
        submitter.close()
        watcher.close()
        for s in (holder, holder_at_2, other):
            s.close()
