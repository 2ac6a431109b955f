"""Issue 9, gateway and worker side: one test per numbered defect 1-8, on real processes.

Each test starts its own cluster (tests/durable_cluster.py: redis-server with AOF, gateway and
worker processes on loopback) and breaks it the way the issue describes: a gateway restarted
with the same id, a dropped token frame, Redis killed, a stream or cancel through the other
gateway, a stranger's frames, a gateway clock 12 s fast, full workers, an aged job. Where a
defect needs a misbehaving worker, the test speaks the wire protocol from a raw ZeroMQ socket
(the adversary); everything else is the real thing. Token contents are checked against the
engine run in this process (the reference; see tests/test_cluster_robustness.py).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
import zmq

from common import protocol as P
from common.ports import free_port
from common.sockets import make_socket
from gateway.sdk import GatewayClient
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster, settle, wait_states

pytestmark = pytest.mark.faults  # real clusters, several each: `make test-faults` runs these alone


def final_via(cluster: DurableCluster, gw: str, tenant: str, job_id: str, from_index: int = 0,
              timeout_s: float = 120.0) -> tuple[list[tuple[int, list[int]]], P.JobDone]:
    """Stream ``job_id`` through gateway ``gw`` with a raw socket: (chunks, JobDone)."""
    sock = make_socket(zmq.Context.instance(), zmq.DEALER)
    sock.connect(cluster.endpoint(gw))
    chunks = []
    try:
        sock.send(P.encode(P.StreamRequest(cluster.key(tenant), job_id, from_index)))
        # `unavailable` is the retryable answer of a gateway still waiting out its Redis back-off (up to 2 s
        # after Redis is back); as the SDK does, ask again after the pause it names, for a bounded time.
        retry_until = time.monotonic() + 10
        while True:
            assert sock.poll(int(timeout_s * 1000)), f"no frame for job {job_id} from {gw} in {timeout_s}s"
            msg = P.decode(sock.recv())
            if isinstance(msg, P.TokenChunk):
                chunks.append((msg.index, list(msg.token_ids)))
            elif isinstance(msg, P.JobDone):
                return chunks, msg
            elif isinstance(msg, P.ErrorReply) and msg.code == "unavailable" and not chunks \
                    and time.monotonic() < retry_until:
                time.sleep(msg.retry_after_s or 0.1)
                sock.send(P.encode(P.StreamRequest(cluster.key(tenant), job_id, from_index)))
            else:
                raise AssertionError(f"{gw} answered {msg}")
    finally:
        sock.close(linger=0)


def assert_whole(cluster: DurableCluster, tenant: str, job_id: str, want: list[int]) -> None:
    """Done in Redis with exactly ``want``, and the same through every gateway, streamed once each."""
    assert cluster.state(job_id) == "done", cluster.job(job_id)
    assert cluster.stored_tokens(job_id) == want
    for gw in cluster.gateways:
        chunks, done = final_via(cluster, gw, tenant, job_id)
        assert done.state == "done" and done.token_ids == want, (gw, done)
        streamed = [i for start, ids in chunks for i in range(start, start + len(ids))]
        assert streamed == list(range(len(want))), (gw, streamed)


class Adversary:
    """A peer on the gateway's worker socket that says hello and then sends whatever the test says."""

    def __init__(self, endpoint: str, worker_id: str, slots: int = 1) -> None:
        self.worker_id = worker_id
        self.sock = make_socket(zmq.Context.instance(), zmq.DEALER, identity=worker_id.encode())
        self.sock.connect(endpoint)
        self.send(P.WorkerHello(worker_id, "adversary", 512, 2048, slots, 1024))

    def send(self, msg) -> None:
        self.sock.send(P.encode(msg))

    def load(self, job_ids: list[str], free: int = 1) -> None:
        self.send(P.WorkerLoad(self.worker_id, free, 1024, {}, {}, job_ids, 0.0))

    def recv(self, kind: type, timeout_s: float = 60.0, beat: list[str] | None = None):
        return recv_from([self], kind, timeout_s, beat)

    def close(self) -> None:
        self.sock.close(linger=0)


def recv_from(peers: list[Adversary], kind: type, timeout_s: float, beat: list[str] | None):
    """The first ``kind`` frame any of ``peers`` receives; each reports ``beat`` (held jobs) before each look."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in peers:
            if beat is not None:
                p.load(beat, free=0 if beat else 1)
            if p.sock.poll(200 // len(peers)):
                msg = P.decode(p.sock.recv())
                if isinstance(msg, kind):
                    return msg
    raise AssertionError(f"{peers[0].worker_id}: no {kind.__name__} within {timeout_s}s")


# -- 1. a gateway restarted with the same id ------------------------------------------------------------------------


def test_1_gateway_restarted_with_the_same_id_loses_no_token(tmp_path, tiny_model_dir, reference):  # noqa: F811
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=2) as c:
        lab = c.client("lab-co", "gw-0")
        # Long enough to run through both restarts (~9 s here, each restart ~2.5 s): 160-token jobs ran 0.3 s, so
        # the restarts came after they ended, and a test process paused that long missed their token logs
        # (deleted at completion) and waited out its 120 s.
        specs = [([3, i + 1], 2000) for i in range(4)]
        jobs = [lab.submit(prompt_token_ids=p, max_tokens=n, seed=11 + i, ignore_eos=True)
                for i, (p, n) in enumerate(specs)]
        lab.close()

        def running_with_tokens() -> bool:
            ended = [j for j in jobs if c.state(j.id) in {"done", "failed", "dead"}]
            assert not ended, f"jobs ended before the restart, the test needs longer ones: {ended}"
            return sum(len(c.redis.keys(f"ts:{{c}}:tok:{j.id}")) > 0 for j in jobs) >= 2
        wait_for(running_with_tokens, 120, "tokens of running jobs in Redis")
        for gw in ("gw-0", "gw-1"):  # each gateway holds some of the leases: restart both, one after the other
            c.kill(gw)
            c.restart(gw)
            c.wait_workers(gw)
        wait_states(c, [j.id for j in jobs], {"done", "failed", "dead"}, 300)
        want = reference([(p, n, 0.0, 11 + i) for i, (p, n) in enumerate(specs)])
        for j, w in zip(jobs, want):
            assert_whole(c, "lab-co", j.id, w)


def test_1_a_restarted_gateway_sends_a_full_worker_nothing_before_its_first_report(tmp_path, bench_model_dir):
    """A restarted gateway knows a worker from its hello alone until its first load report. It took every slot the
    hello names as free and sent the queued jobs to a worker whose slots were all busy: they waited in that
    worker, out of reach of aging and of a worker that frees a slot first. Credit now comes from reports only."""
    with DurableCluster(tmp_path, bench_model_dir, gateways=1, workers=1, max_running=2) as c:
        lab = c.client("lab-co")
        running = [lab.submit(prompt_token_ids=[4, i], max_tokens=1500, ignore_eos=True) for i in range(2)]
        wait_for(lambda: all(c.state(j.id) == "dispatched" for j in running), 60, "both slots busy")
        queued = [lab.submit(prompt_token_ids=[5, i], max_tokens=4, ignore_eos=True) for i in range(4)]
        time.sleep(1.0)
        assert all(c.state(j.id) == "queued" for j in queued)
        lab.close()
        c.kill("gw-0")
        c.restart("gw-0")
        c.wait_workers("gw-0")
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            states = [c.state(j.id) for j in queued]
            assert states == ["queued"] * 4, states
            time.sleep(0.05)
        with c.client("lab-co") as again:
            for j in running:
                again.cancel(j.id)
            assert all(len(again.job(j.id).result(timeout=60).token_ids) == 4 for j in queued)


# -- 2. a lost token frame ------------------------------------------------------------------------------------------


def test_2_a_gap_in_the_token_frames_never_becomes_a_short_done(tmp_path, tiny_model_dir):
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=0) as c:
        w = Adversary(c.gateways["gw-0"][1], "wk-gappy")
        lab = c.client("lab-co")
        short = lab.submit(prompt_token_ids=[1, 2], max_tokens=4, ignore_eos=True)
        d = w.recv(P.DispatchJob, beat=[])
        w.send(P.JobTokens(d.job_id, d.attempt, 0, [5, 6]))
        w.send(P.JobTokens(d.job_id, d.attempt, 3, [8]))  # index 2 never arrives
        w.send(P.JobFinished(d.job_id, d.attempt, "done", "length", 4, 0.0, 0.1, 0))  # and no token list
        wait_states(c, [short.id], {"done", "failed"}, 30)
        assert c.state(short.id) == "failed" and b"incomplete" in c.job(short.id)["reason"], c.job(short.id)
        assert c.stored_tokens(short.id) == []
        # The same gap, but the worker's JobFinished carries every token: the result is whole.
        whole = lab.submit(prompt_token_ids=[1, 3], max_tokens=4, ignore_eos=True)
        d = w.recv(P.DispatchJob, beat=[])
        w.send(P.JobTokens(d.job_id, d.attempt, 0, [5, 6]))
        w.send(P.JobTokens(d.job_id, d.attempt, 3, [8]))
        w.send(P.JobFinished(d.job_id, d.attempt, "done", "length", 4, 0.0, 0.1, 0, None, [5, 6, 7, 8]))
        assert whole.result(timeout=30).token_ids == [5, 6, 7, 8]
        assert_whole(c, "lab-co", whole.id, [5, 6, 7, 8])
        lab.close()
        w.close()


# -- 3. Redis down for a few seconds ----------------------------------------------------------------------------------


def test_3_redis_killed_under_load_nothing_admitted_is_lost(tmp_path, tiny_model_dir, reference):  # noqa: F811
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=2) as c:
        specs = [([4, i + 1], 48) for i in range(6)]
        jobs = []
        for i, (p, n) in enumerate(specs):
            cl = c.client("lab-co", f"gw-{i % 2}")
            jobs.append(cl.submit(prompt_token_ids=p, max_tokens=n, seed=21 + i, ignore_eos=True))
            cl.close()
        settle(1.5)  # AOF everysec: what was admitted more than a second ago is on disk
        c.kill("redis")
        raw = make_socket(zmq.Context.instance(), zmq.DEALER)
        raw.connect(c.endpoint("gw-1"))
        raw.send(P.encode(P.SubmitRequest(c.key("lab-co"), 4, prompt_token_ids=[1], ignore_eos=True)))
        assert raw.poll(30_000), "no answer while Redis is down"
        reply = P.decode(raw.recv())
        assert isinstance(reply, P.ErrorReply) and reply.code == "unavailable", reply
        raw.close(linger=0)
        settle(3.0)
        assert c.alive("gw-0") and c.alive("gw-1"), c.log_tail("gw-0") + c.log_tail("gw-1")
        c.restart("redis")
        wait_states(c, [j.id for j in jobs], {"done", "failed", "dead"}, 300)
        want = reference([(p, n, 0.0, 21 + i) for i, (p, n) in enumerate(specs)])
        for j, w in zip(jobs, want):
            assert_whole(c, "lab-co", j.id, w)


# -- 4. any gateway streams and cancels any job -----------------------------------------------------------------------


def test_4_any_gateway_streams_resumes_and_cancels_any_job(tmp_path, tiny_model_dir, reference):  # noqa: F811
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=1) as c:
        lab = c.client("lab-co", "gw-0")
        job = lab.submit(prompt_token_ids=[7, 7], max_tokens=120, seed=5, ignore_eos=True)
        wait_for(lambda: c.state(job.id) == "dispatched", 60, "the job to run")
        chunks, done = final_via(c, "gw-1", "lab-co", job.id)  # live, through the gateway that did not admit it
        [want] = reference([([7, 7], 120, 0.0, 5)])
        assert done.state == "done" and done.token_ids == want
        assert [t for _, ids in chunks for t in ids] == want
        chunks, done = final_via(c, "gw-1", "lab-co", job.id, from_index=100)  # resume
        assert [t for _, ids in chunks for t in ids] == want[100:] and chunks[0][0] == 100
        # Cancel through gw-1 a job that gw-0 admitted while gw-0's client streams it.
        long = lab.submit(prompt_token_ids=[7, 8], max_tokens=1500, ignore_eos=True)
        wait_for(lambda: c.state(long.id) == "dispatched", 60, "the long job to run")
        seen: dict = {}
        t = threading.Thread(target=lambda: seen.update(r=final_via(c, "gw-0", "lab-co", long.id)), daemon=True)
        t.start()
        other = c.client("lab-co", "gw-1")
        assert other.cancel(long.id) is True
        t.join(60)
        assert not t.is_alive(), "gw-0's stream never ended after the cancel through gw-1"
        assert seen["r"][1].state == "cancelled"
        # The worker stopped it: its slot is free for the next job.
        quick = other.submit(prompt_token_ids=[1], max_tokens=4, ignore_eos=True)
        assert len(quick.result(timeout=120).token_ids) == 4
        other.close()
        lab.close()


# -- 5. fencing -------------------------------------------------------------------------------------------------------


def test_5_frames_from_a_worker_without_the_lease_are_dropped(tmp_path, tiny_model_dir, reference):  # noqa: F811
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=1, max_running=1) as c:
        evil = Adversary(c.gateways["gw-0"][1], "wk-evil", slots=0)
        evil.load([], free=0)
        lab = c.client("lab-co")
        job = lab.submit(prompt_token_ids=[9, 1], max_tokens=80, seed=3, ignore_eos=True)
        wait_for(lambda: c.state(job.id) == "dispatched", 60, "the job to run on the real worker")
        assert c.job(job.id)["worker"] == b"wk-0"
        for attempt in (1, 2, 0):
            evil.send(P.JobTokens(job.id, attempt, 0, [1, 1, 1]))
            evil.send(P.JobFinished(job.id, attempt, "done", "stop", 3, 0.0, 0.1, 0))
        [want] = reference([([9, 1], 80, 0.0, 3)])
        assert job.result(timeout=120).token_ids == want
        assert_whole(c, "lab-co", job.id, want)
        evil.close()
        lab.close()


def test_5_a_requeue_cancels_the_previous_holder(tmp_path, tiny_model_dir):
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=0, lease_s=2.0) as c:
        cut_off = Adversary(c.gateways["gw-0"][1], "wk-cut-off")
        lab = c.client("lab-co")
        job = lab.submit(prompt_token_ids=[1, 2], max_tokens=4, ignore_eos=True)
        d = cut_off.recv(P.DispatchJob, beat=[])
        # It keeps reporting, but not the job (as if its heartbeat had stalled): the lease expires.
        cancel = cut_off.recv(P.CancelJob, timeout_s=60, beat=[])
        assert (cancel.job_id, cancel.attempt) == (d.job_id, d.attempt)
        again = cut_off.recv(P.DispatchJob, beat=[])
        assert (again.job_id, again.attempt) == (d.job_id, d.attempt + 1)
        # A frame from the lost attempt now counts for nothing; the current one completes the job.
        cut_off.send(P.JobFinished(d.job_id, d.attempt, "done", "length", 1, 0.0, 0.1, 0, None, [9]))
        cut_off.send(P.JobFinished(d.job_id, again.attempt, "done", "length", 4, 0.0, 0.1, 0, None, [4, 3, 2, 1]))
        assert job.result(timeout=30).token_ids == [4, 3, 2, 1]
        lab.close()
        cut_off.close()


def test_5_a_hand_back_a_restarted_gateway_dropped_is_confirmed_when_sent_again(tmp_path, tiny_model_dir):
    """A draining worker's JobReleased that reached a gateway restarted meanwhile was dropped (it knew no hello of
    that worker yet), and the job waited out its lease (here 60 s). The worker now sends it again after a hello
    until a JobFinishedAck answers (worker/completions.py); the gateway answers every copy it settles, requeued or
    stale, and the job runs elsewhere at once."""
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=0, lease_s=60.0) as c:
        draining = Adversary(c.gateways["gw-0"][1], "wk-draining")
        lab = c.client("lab-co")
        job = lab.submit(prompt_token_ids=[1, 2], max_tokens=4, ignore_eos=True)
        d = draining.recv(P.DispatchJob, beat=[])
        draining.load([d.job_id], free=0)
        c.kill("gw-0")
        c.restart("gw-0")
        release = P.JobReleased(d.job_id, d.attempt, "draining: not started")
        deadline = time.monotonic() + 60
        while True:  # sent while the new gateway knows no hello of this worker: dropped, and a hello asked for
            assert time.monotonic() < deadline, "the restarted gateway never answered"
            draining.send(release)
            if draining.sock.poll(1000):
                reply = P.decode(draining.sock.recv())
                assert not isinstance(reply, P.JobFinishedAck), reply
                if isinstance(reply, P.ErrorReply) and reply.code == P.HELLO_FIRST:
                    break
        assert c.state(d.job_id) == "dispatched"  # lost: without a copy sent again, it waits out the lease
        draining.send(P.WorkerHello("wk-draining", "adversary", 512, 2048, 1, 1024, draining=True))
        draining.load([], free=0)
        draining.send(release)
        ack = draining.recv(P.JobFinishedAck, timeout_s=10)
        assert (ack.job_id, ack.attempt) == (d.job_id, d.attempt)
        live = Adversary(c.gateways["gw-0"][1], "wk-live")
        again = live.recv(P.DispatchJob, timeout_s=30, beat=[])
        assert (again.job_id, again.attempt) == (d.job_id, d.attempt + 1)
        assert c.job(d.job_id)["releases"] == b"1"
        draining.send(release)  # one more copy, now stale: answered too, so that the worker stops sending it
        assert draining.recv(P.JobFinishedAck, timeout_s=10).job_id == d.job_id
        live.send(P.JobFinished(d.job_id, again.attempt, "done", "length", 4, 0.0, 0.1, 0, None, [4, 3, 2, 1]))
        assert job.result(timeout=30).token_ids == [4, 3, 2, 1]
        lab.close()
        live.close()
        draining.close()


class AdversaryEverywhere:
    """One adversary worker connected to every gateway of a cluster, as a real worker is."""

    def __init__(self, cluster: DurableCluster, worker_id: str, slots: int) -> None:
        self.peers = [Adversary(worker_ep, worker_id, slots) for _, worker_ep in cluster.gateways.values()]

    def send(self, msg) -> None:
        for p in self.peers:
            p.send(msg)

    def recv(self, kind: type, timeout_s: float = 60.0, beat: list[str] | None = None):
        return recv_from(self.peers, kind, timeout_s, beat)

    def dispatches(self) -> list:
        return [m for p in self.peers for m in iter(lambda p=p: P.decode(p.sock.recv()) if p.sock.poll(0) else None,
                                                     None) if isinstance(m, P.DispatchJob)]

    def close(self) -> None:
        for p in self.peers:
            p.close()


@pytest.mark.parametrize("gateways", [1, 2])
def test_5_a_lost_lease_sends_its_job_elsewhere_not_back_to_the_silent_worker(tmp_path, tiny_model_dir, gateways):
    """A worker that went silent with a slot free (killed -9 after its last report) loses its job's lease before
    the gateways time it out when lease_s < worker_timeout_s. The re-dispatch went by that last report's credit,
    to the dead worker again: one more lease lost and one more attempt spent of max_attempts (three by default), so
    a second fault could dead-letter a job whose worker alone had died. A worker silent for a lease, or whose lease
    ran out, gets nothing more until it reports again, from any gateway (with two, the one that did not requeue
    the job dispatched it to the silent worker half the time): the job goes to the live worker, at attempt 2."""
    with DurableCluster(tmp_path, tiny_model_dir, gateways=gateways, workers=0, lease_s=1.5) as c:
        silent = AdversaryEverywhere(c, "wk-silent", slots=2)
        lab = c.client("lab-co")
        job = lab.submit(prompt_token_ids=[1, 2], max_tokens=4, ignore_eos=True)
        d = silent.recv(P.DispatchJob, beat=[])
        silent.send(P.WorkerLoad("wk-silent", 1, 1024, {"P2": 1}, {}, [d.job_id], 0.0))  # its last word: one free
        live = AdversaryEverywhere(c, "wk-live", slots=1)  # joins after: the silent one comes first
        again = live.recv(P.DispatchJob, timeout_s=30, beat=[])
        assert (again.job_id, again.attempt) == (d.job_id, 2)
        assert not silent.dispatches()
        live.send(P.JobFinished(d.job_id, 2, "done", "length", 4, 0.0, 0.1, 0, None, [4, 3, 2, 1]))
        assert job.result(timeout=30).token_ids == [4, 3, 2, 1]
        # Heard from again, it gets work again.
        silent.send(P.WorkerLoad("wk-silent", 2, 1024, {}, {}, [], 0.0))
        second = lab.submit(prompt_token_ids=[3], max_tokens=2, ignore_eos=True)
        assert silent.recv(P.DispatchJob, timeout_s=30, beat=[]).job_id == second.id
        lab.close()
        live.close()
        silent.close()


REST = 400  # tokens test_5_a_completion... leaves its job to run once its gateway is lost


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_5_a_completion_whose_gateway_is_gone_for_good_is_stored_by_another(tmp_path, tiny_model_dir,
                                                                             reference, how):  # noqa: F811
    """The gateway that dispatched a running job dies (killed) or hangs (frozen: SIGSTOP, its connections stay open)
    and does not come back. The survivor stores the completion, since the lease in Redis says whose it is. Before,
    it went to the dispatching gateway only: the job was run again after its lease (attempt 2).
    - killed: the worker sees the connection drop and streams the job through the survivor from then on, the
      completion included (worker/routes.py);
    - frozen: its connection stays open, so the job streams to it until ZeroMQ's heartbeats time out (5 s) and the
      worker streams through the survivor; a completion sent to it before then waits for a confirmation that
      never comes, and the worker sends it again to every gateway (worker/completions.py)."""
    spec = ([4, 5, 6], 2000, 41)
    metrics = f"127.0.0.1:{free_port()}"  # the one worker's
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=1, lease_s=10.0,
                        gateway_env={"TS_WORKER_METRICS_BIND": metrics}) as c:
        lab = c.client("lab-co", "gw-0", timeout_s=10.0)
        job = lab.submit(prompt_token_ids=spec[0], max_tokens=spec[1], seed=spec[2], ignore_eos=True)
        wait_for(lambda: c.state(job.id) == "dispatched", 60, "the job to be dispatched")
        victim = c.job(job.id)["gateway"].decode()
        # Running, not only claimed: killed before it sent the dispatch, the gateway would leave nothing running.
        # And near its end: frozen, the gateway keeps its connection for the heartbeats' 5 s, and only a completion
        # sent within them goes to it unconfirmed; the whole job (about 2 s on a quiet machine) outlasted them on a
        # loaded one, and nothing was sent again. Its last REST tokens take a second or two at the most.
        with c.client("lab-co", victim, timeout_s=10.0) as via_victim:
            seen = 0
            for chunk in via_victim.job(job.id).stream(timeout=60):
                seen += len(chunk.token_ids)
                if seen >= spec[1] - REST:
                    break
        # The worker stands still while the gateway is lost and the job's state is read, so that it cannot end
        # in between unseen.
        worker = c.procs["wk-0"].pid
        os.kill(worker, signal.SIGSTOP)
        try:
            try:
                if how == "killed":
                    c.kill(victim)
                else:
                    os.kill(c.procs[victim].pid, signal.SIGSTOP)
                assert c.state(job.id) == "dispatched", "the job ended before its gateway was lost: nothing tested"
            finally:
                os.kill(worker, signal.SIGCONT)
            survivor = next(g for g in c.gateways if g != victim)
            with c.client("lab-co", survivor, timeout_s=10.0) as other:
                result = other.job(job.id).result(timeout=120)
            assert result.token_ids == reference([(spec[0], spec[1], 0.0, spec[2])])[0]
            assert c.job(job.id)["attempt"] == b"1", c.job(job.id)
            if how == "frozen":
                # Here the job ends before the heartbeats give up on the frozen gateway: its completion is sent
                # again, and the worker says so, for an operator.
                resent = [float(line.split()[-1]) for line in httpx.get(f"http://{metrics}/metrics").text.splitlines()
                          if line.startswith('ts_unconfirmed_completions_total{event="resent"}')]
                assert resent and resent[0] >= 1, resent
        finally:
            if how == "frozen":
                c.kill(victim)  # a stopped process takes no SIGTERM
        lab.close()


# -- 6. one clock -----------------------------------------------------------------------------------------------------


def test_6_a_gateway_with_a_fast_clock_requeues_no_healthy_job(tmp_path, tiny_model_dir, reference):  # noqa: F811
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=1, lease_s=10.0,
                        clock_skew_s={"gw-1": 12.0}) as c:
        lab = c.client("lab-co", "gw-0")
        specs = [([6, i + 1], 64) for i in range(3)]
        jobs = [lab.submit(prompt_token_ids=p, max_tokens=n, seed=31 + i, ignore_eos=True)
                for i, (p, n) in enumerate(specs)]
        want = reference([(p, n, 0.0, 31 + i) for i, (p, n) in enumerate(specs)])
        for j, w in zip(jobs, want):
            assert j.result(timeout=300).token_ids == w
            assert c.job(j.id)["attempt"] == b"1", c.job(j.id)  # never requeued
        lab.close()


def test_6_a_gateway_whose_wall_clock_steps_back_an_hour_keeps_its_timers(tmp_path, tiny_model_dir):
    """An NTP correction or a VM resumed from a snapshot steps a host's wall clock back. The gateway timed its
    keepalives and its maintenance (aging, lease recovery, queue timeouts) on it: stepped back an hour, it sent no
    keepalive and ran no maintenance for an hour, so every waiting client failed over or timed out and no job aged.
    They are intervals, and now run on a monotonic clock."""
    flag = tmp_path / "step-back"
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=0, aging_interval_s=2.0,
                        clock_jump={"gw-0": (flag, -3600.0)}) as c:
        # No worker: the job waits in its queue, heard of only through keepalives, and ages every 2 s.
        lab = c.client("lab-co", timeout_s=4.0)
        job = lab.submit(prompt_token_ids=[5, 6], max_tokens=2)
        failure: list[BaseException] = []

        def stream() -> None:
            try:
                for _ in GatewayClient(c.endpoint(), c.key("lab-co"), timeout_s=4.0, retries=0).job(job.id).stream():
                    pass
            except BaseException as e:  # reported by the test thread
                failure.append(e)

        watcher = threading.Thread(target=stream, daemon=True)
        watcher.start()
        time.sleep(1.0)
        flag.touch()
        # Aging goes on (P3 -> P2 -> P1, 2 s each, from when the step came)...
        wait_for(lambda: lab.status(job.id).tier == "P1" or failure, 30, "the job to age up to P1")
        # ...and the stream of the queued job still hears its keepalives: silence over 4 s would have failed it.
        time.sleep(5.0)
        assert not failure, failure
        assert watcher.is_alive()
        assert lab.status(job.id).tier == "P1" and lab.cancel(job.id)
        watcher.join(30)
        lab.close()


# -- 7. full workers ------------------------------------------------------------------------------------------------


def test_7_with_no_victim_anywhere_urgent_jobs_stay_in_redis(tmp_path, tiny_model_dir):
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=2, max_running=1) as c:
        api, chat = c.client("api-co"), c.client("chat-co")
        # P1 jobs fill both workers; P0 may not preempt P1, so there is nothing to preempt anywhere.
        p1 = [api.submit(prompt_token_ids=[2, i], max_tokens=150, ignore_eos=True, tier="P1") for i in range(2)]
        wait_for(lambda: all(c.state(j.id) == "dispatched" for j in p1), 60, "both workers busy with P1")
        p0 = [chat.submit(prompt_token_ids=[3, i], max_tokens=4, ignore_eos=True, tier="P0") for i in range(3)]
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            p0_states = [c.state(j.id) for j in p0]
            # Read after the P0 states: both P1 jobs still running now means they ran throughout that read
            # (a P1 that ends frees a slot, and then a P0 may rightly take it).
            if not all(c.state(j.id) == "dispatched" for j in p1):
                break
            assert p0_states == ["queued"] * len(p0), [c.job(j.id) for j in p0]
            time.sleep(0.1)
        for j in p0 + p1:
            j.result(timeout=300)
        # Nothing piled up on one worker: each P0 went out once a slot was free.
        assert all(c.job(j.id)["attempt"] == b"1" for j in p0)
        api.close()
        chat.close()


# -- 8. aging changes queue order only --------------------------------------------------------------------------------


def test_8_an_aged_job_preempts_by_its_admitted_tier(tmp_path, tiny_model_dir):
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=1, max_running=1,
                        aging_interval_s=0.2) as c:
        lab = c.client("lab-co")
        # Long enough to be running still when the worker stops, however late the poll sees it run: 300 tokens took
        # well under a second, and a test held up that long stopped an idle worker.
        running = lab.submit(prompt_token_ids=[5, 1], max_tokens=2000, ignore_eos=True)

        def runs() -> bool:
            state = c.state(running.id)
            assert state in ("queued", "dispatched"), f"the first P3 job ended before it was seen running: {state}"
            return state == "dispatched"

        wait_for(runs, 60, "the first P3 job to run")
        # Frozen, the worker stays registered as full of one preemptible P3 (its last report) however fast
        # this machine generates: only the gateway's dispatch decision is left to observe. Kept below the
        # gateway's 5 s worker timeout.
        os.kill(c.procs["wk-0"].pid, signal.SIGSTOP)
        try:
            waiting = lab.submit(prompt_token_ids=[5, 2], max_tokens=4, ignore_eos=True)
            wait_for(lambda: c.job(waiting.id).get("tier") == b"P1", 3, "the second job to age up to P1")
            # As a P1 it could preempt the running P3; admitted at P3 it must wait for the slot.
            for _ in range(10):
                assert c.state(waiting.id) == "queued" and c.state(running.id) == "dispatched", c.job(waiting.id)
                time.sleep(0.1)
        finally:
            os.kill(c.procs["wk-0"].pid, signal.SIGCONT)
        assert running.result(timeout=300).preemptions == 0
        assert len(waiting.result(timeout=300).token_ids) == 4
        lab.close()


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_5_a_stream_goes_on_through_another_gateway_when_its_gateway_dies_for_good(tmp_path, bench_model_dir, how):
    """The gateway that dispatched a running job is killed (or hangs: SIGSTOP, its connections stay open) and does
    not come back. A client reading the job's stream through the other gateway saw it stall: the worker sent the
    tokens to the lost gateway only, so nobody wrote them to the job's Redis stream, until the completion (sent to
    every gateway) brought them all at once. The worker now sees the connection drop (ZeroMQ's events; for the
    frozen one, its heartbeats time out after 5 s) and streams through a gateway it is connected to."""
    with DurableCluster(tmp_path, bench_model_dir, gateways=2, workers=1, lease_s=30.0) as c:
        lab = c.client("lab-co", "gw-0", timeout_s=10.0)
        job = lab.submit(prompt_token_ids=[4, 5, 6], max_tokens=1100, seed=41, ignore_eos=True)  # ~18 s here
        wait_for(lambda: c.state(job.id) == "dispatched", 60, "the job to be dispatched")
        victim = c.job(job.id)["gateway"].decode()
        survivor = next(g for g in c.gateways if g != victim)
        arrivals: list[tuple[float, int]] = []  # (when, tokens so far) at the survivor's client
        streamed: list[int] = []
        failures: list[BaseException] = []
        first = threading.Event()

        def follow() -> None:
            try:
                with c.client("lab-co", survivor, timeout_s=10.0) as other:
                    for chunk in other.job(job.id).stream(timeout=120):
                        assert chunk.index == len(streamed), (chunk.index, len(streamed))  # no gap, no repeat
                        streamed.extend(chunk.token_ids)
                        arrivals.append((time.monotonic(), len(streamed)))
                        first.set()
            except BaseException as e:  # noqa: BLE001 - reported below
                failures.append(e)
                first.set()

        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        assert first.wait(60), "no token reached the survivor's client"
        if how == "killed":
            c.kill(victim)
        else:
            os.kill(c.procs[victim].pid, signal.SIGSTOP)
        killed = time.monotonic()
        try:
            with c.client("lab-co", survivor, timeout_s=10.0) as other:
                result = other.job(job.id).result(timeout=120)
            reader.join(30)
        finally:
            if how == "frozen":
                c.kill(victim)  # a stopped process takes no SIGTERM
        assert not failures, failures
        ended = max(t for t, _ in arrivals)
        after = [(t - killed, n) for t, n in arrivals if t > killed]
        assert streamed == result.token_ids and len(streamed) == 1100
        # Tokens kept coming while the job ran, not all at its end: half the run after the kill saw new ones.
        assert ended - killed > 4.0, "the job ended too soon after the kill to tell"
        midway = [n for dt, n in after if dt < (ended - killed) / 2]
        assert midway and midway[-1] < 1100, (after[:5], after[-3:])
        assert c.job(job.id)["attempt"] == b"1"  # not re-run
        lab.close()


def test_5_a_job_whose_worker_is_killed_goes_on_from_its_streamed_tokens(tmp_path, bench_model_dir):
    """kill -9 the worker running a job: its lease runs out and it is dispatched again. The next worker goes on from
    the tokens the first one streamed (DispatchJob.resume_token_ids, from the job's token log), rather than decoding
    them all again, and the client's stream has every token once."""
    with DurableCluster(tmp_path, bench_model_dir, gateways=1, workers=1, lease_s=3.0) as c:
        lab = c.client("lab-co", timeout_s=10.0)
        job = lab.submit(prompt_token_ids=[4, 5, 6], max_tokens=500, seed=41, temperature=0.8, ignore_eos=True)
        streamed: list[int] = []
        with c.client("lab-co", timeout_s=10.0) as reader:
            chunks = reader.job(job.id).stream(timeout=120)
            for chunk in chunks:
                assert chunk.index == len(streamed)
                streamed.extend(chunk.token_ids)
                if len(streamed) >= 120:
                    break
            c.kill("wk-0")
            c.worker_ids.append("wk-1")
            c.start_process("wk-1")
            for chunk in chunks:  # the same stream, across the lease's end and the re-dispatch
                assert chunk.index == len(streamed), (chunk.index, len(streamed))  # no gap, no repeat
                streamed.extend(chunk.token_ids)
        result = lab.job(job.id).result(timeout=120)
        assert streamed == result.token_ids and len(streamed) == 500
        # Not attempt 3: the dead worker, not yet timed out, gets nothing once its lease ran out
        # (WorkerState.lost_lease).
        attempt = int(c.job(job.id)["attempt"])
        assert attempt == 2 and c.job(job.id)["worker"] == b"wk-1"
        resumed = [int(line.rsplit(" ", 2)[-2]) for line in c.log_tail("wk-1", 100_000).splitlines()
                   if f"job {job.id} attempt {attempt} resumes after" in line]
        assert resumed and 100 <= resumed[0] <= len(streamed), resumed
        lab.close()


def test_5_a_job_whose_worker_is_killed_after_its_queue_deadline_resumes_rather_than_expiring(tmp_path,
                                                                                              bench_model_dir):
    """The queue timeout bounds a wait for a slot. A P1 job (a 2 s timeout here) that got one at once, ran past its
    admission's deadline and lost its worker was requeued with that deadline, and the same maintenance pass that
    requeued it expired it: the client had its tokens streamed, then JobExpired, though another worker had a free
    slot."""
    env = {"TS_GATEWAY_TIER_TIMEOUTS_S": '{"P0": 30, "P1": 2, "P2": 300}'}
    with DurableCluster(tmp_path, bench_model_dir, gateways=1, workers=2, max_running=1, lease_s=3.0,
                        gateway_env=env) as c:
        api = c.client("api-co", timeout_s=10.0)
        # Long enough to outlast its deadline on a fast, quiet machine (500 tokens once ended in under 5 s there).
        job = api.submit(prompt_token_ids=[4, 5, 6], max_tokens=1500, seed=45, tier="P1", ignore_eos=True)
        admitted = time.monotonic()
        with c.client("api-co", timeout_s=10.0) as reader:
            next(reader.job(job.id).stream(timeout=120))
        wait_for(lambda: time.monotonic() - admitted > 3, 10, "the job's queue deadline to pass")
        holder = c.job(job.id)["worker"].decode()
        assert c.state(job.id) == "dispatched", "the job ended before the kill: nothing was tested"
        c.kill(holder)  # the other worker's slot is free
        result = api.job(job.id).result(timeout=180)  # JobExpired where the requeue kept the passed deadline
        assert len(result.token_ids) == 1500
        h = c.job(job.id)
        assert h["attempt"] == b"2" and h["worker"].decode() != holder, h
        api.close()
