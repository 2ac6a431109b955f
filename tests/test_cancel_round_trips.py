"""A cancel of a queued job costs no Redis read after cancel.lua: the time its queue-wait span ends at is the one
cancel.lua returns (the record's finished_at_ms), not read back with a second round trip.

The gateway read the job's finished_at_ms with an HGET after cancel.lua had already returned it: one more blocking
round trip for every cancel of a queued job (and, with Redis standing still, another socket timeout). A gateway built
as `python -m gateway` builds it, on a real redis-server watched with MONITOR (commands run by a script apart); a real
DEALER as the client.
The span's end is checked exact against the record in tests/test_tracing_clocks.py.
"""

from __future__ import annotations

import msgpack
import zmq

from common import protocol as P
from common.tiers import Tier
from tests.gateway_helpers import built_gateway


def test_a_queued_job_s_cancel_reads_nothing_back(tmp_path):
    with built_gateway(tmp_path, "cancel-trips") as (gw, tenants, server):
        gw.queue.admit(job_id="job-q", tenant="batch-co", tier_requested=Tier.P3, tier=Tier.P3,
                       payload=msgpack.packb({"prompt_token_ids": [5, 6], "max_tokens": 2}),
                       idempotency_key=None, quota=None, drain_rate_per_s={}, estimate_s=0.0)
        redis = server.client()
        client = zmq.Context.instance().socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(gw.clients.getsockopt(zmq.LAST_ENDPOINT).decode())
        with redis.monitor() as monitor:
            try:
                client.send(P.encode(P.CancelRequest(tenants["batch-co"]["api_key"], "job-q", request_id="r-1")))
                for _ in range(2000):
                    gw._drain(gw.clients, gw._client_handlers)
                    if client.poll(5):
                        break
                else:
                    raise AssertionError("no answer to the cancel")
                reply = P.decode(client.recv())
            finally:
                client.close()
            redis.echo("end-of-cancel")
            sent = []  # the commands clients sent (a script's own are told apart as "lua")
            while (c := monitor.next_command())["command"] != "ECHO end-of-cancel":
                if c["client_type"] != "lua":
                    sent.append(c["command"])
        assert reply == P.CancelReply("job-q", True, request_id="r-1"), reply
        record = gw.queue.get("job-q")
        assert record.state.value == "cancelled" and record.finished_at_ms is not None
        cancels = [i for i, c in enumerate(sent) if c.startswith("EVALSHA") and " cancelled by the client" in c]
        assert cancels, sent  # the cancel itself was seen (twice where Redis had yet to load the script: NOSCRIPT)
        job_key = gw.queue.keys.job("job-q")
        read_after = [c for c in sent[cancels[-1] + 1:] if c.split()[0] in ("HGET", "HMGET", "HGETALL") and job_key in c]
        assert read_after == [], sent  # its finished_at_ms came back with cancel.lua's reply
