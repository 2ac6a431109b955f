"""One AsyncGatewayClient shared by many coroutines that are cancelled at every await point, as a real application
cancels them (asyncio.wait_for timeouts, a TaskGroup whose sibling failed, a web handler whose client went away and
left its stream unread). Afterwards the same client must serve new calls: every answer reached its own caller, no
request or subscription is left registered (nor at the gateway), nothing was logged as never retrieved, and close()
is prompt.

Real redis-server, gateway and worker processes (scripts/up.py via tests/cluster_helpers.py).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import time
from collections import Counter

import pytest

from common import protocol as P
from gateway.sdk import AsyncGatewayClient, JobCancelled, Overloaded, ServingError
from tests.cluster_helpers import frozen, job_hash, job_ids, local_cluster, wait_for

KEEPALIVE_ENV = {"TS_GATEWAY_KEEPALIVE_INTERVAL_S": "0.3"}
SEED = 20261206
COROUTINES = 50


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("sdk-cancel"), tiny_model_dir, workers=1, max_running=8,
                       env=KEEPALIVE_ENV, http=False) as state:
        yield state


class Unretrieved(logging.Handler):
    """What asyncio would have reported to nobody: the loop's exception handler calls ("Task exception was never
    retrieved", "Task was destroyed but it is pending!") and any ERROR logged meanwhile."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(f"log {record.name}: {record.getMessage()}")

    def loop_handler(self, loop, context: dict) -> None:
        self.seen.append(f"loop: {context.get('message')} {context.get('exception')!r} {context.get('future')!r}")

    def __enter__(self) -> Unretrieved:
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger().removeHandler(self)


def run(main, handler: Unretrieved):
    """asyncio.run(main()) with ``handler`` watching the loop, also while the loop's leftovers are collected."""
    with asyncio.Runner() as runner:
        runner.get_loop().set_exception_handler(handler.loop_handler)
        out = runner.run(main())
        gc.collect()  # a future dropped unretrieved reports when collected: while the handler still listens
    gc.collect()
    return out


def leftovers(client: AsyncGatewayClient) -> list[str]:
    """Whatever a call or stream that ended left registered on the client's connections, and tasks still alive."""
    out = []
    for conn in client._conns.values():
        out += [f"inbox {rid} on {conn.endpoint}" for rid in conn.inboxes]
        out += [f"drop waiter on {conn.endpoint}" for _ in conn._drop_waiters]
    readers = {conn._reader for conn in client._conns.values()}
    out += [f"task {t!r}" for t in asyncio.all_tasks() if t is not asyncio.current_task() and t not in readers]
    return out


async def settled(client: AsyncGatewayClient, within_s: float = 5.0) -> list[str]:
    """leftovers() once abandoned streams were collected and their closing ran, or what is left after ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        gc.collect()  # an async generator a handler broke out of closes when collected (the loop's asyncgen hook)
        await asyncio.sleep(0.05)
        if not (left := leftovers(client)) or time.monotonic() > deadline:
            return left


async def cancel_somehow(rng: random.Random, coro, tasks_done: list, spare: bool = True):
    """Run ``coro`` and cancel it at a random point: after a few loop turns (an await point that does not wait on the
    network), after a few milliseconds (one that does), by wait_for, or (``spare``) not at all. Returns its value or
    the exception it ended with."""
    how = rng.choice(["turns", "turns", "time", "wait_for", "wait_for"] + ["none"] * spare)
    task = asyncio.ensure_future(coro)
    try:
        if how == "turns":
            for _ in range(rng.randrange(0, 12)):
                await asyncio.sleep(0)
            task.cancel()
        elif how == "time":
            await asyncio.sleep(rng.uniform(0.0, 0.15))
            task.cancel()
        elif how == "wait_for":
            return await asyncio.wait_for(task, rng.uniform(0.0, 0.1))
        return await asyncio.wait_for(task, 60)
    except (asyncio.CancelledError, TimeoutError) as e:
        if not task.cancelled() and not task.done():
            raise
        return e
    finally:
        tasks_done.append(task)


class Ledger:
    """What each caller got: its jobs' ids and max_tokens, and the tokens it saw of each."""

    def __init__(self) -> None:
        self.jobs: dict[str, tuple[list[int], int]] = {}  # job id -> (prompt, max_tokens), as its submitter asked
        self.complete: dict[str, list[int]] = {}  # job id -> every token (result() or a stream to the end)
        self.partial: dict[str, list[int]] = {}  # job id -> a stream's tokens before it stopped reading
        self.statuses: list[tuple[str, str]] = []  # (job id asked about, job id answered)
        self.cancelled_in: Counter[str] = Counter()  # the await a caller was cancelled at -> how often

    def got(self, job, prompt: list[int], max_tokens: int) -> None:
        assert job.id not in self.jobs, f"job {job.id} handed to two submitters"
        self.jobs[job.id] = (prompt, max_tokens)


async def caller(client: AsyncGatewayClient, i: int, rng: random.Random, ledger: Ledger, pool: list[str]):
    """One coroutine's work: submit then read, or a call on a job of the pool. Every await may be cancelled."""
    op = rng.choice(["result", "stream", "stream", "handler", "status", "cancel", "info", "result_t"])
    where = ["start"]
    try:
        return await _caller(client, i, rng, ledger, pool, op, where)
    except asyncio.CancelledError:
        ledger.cancelled_in[where[0]] += 1
        raise


async def _caller(client, i: int, rng: random.Random, ledger: Ledger, pool: list[str], op: str, where: list[str]):
    prompt, max_tokens = [7 + i % 40, 3 + i, 11], 4 + i % 17
    if i % 3 == 0:
        # Over 1 KiB of frame: a client that has not heard what the gateway takes asks it first (_fits), one more
        # await to be cancelled at.
        prompt = prompt + [256 + (i + k) % 256 for k in range(400)]
    if op in ("status", "cancel"):
        job_id = rng.choice(pool)
        where[0] = op
        if op == "status":
            st = await client.status(job_id)
            ledger.statuses.append((job_id, st.job_id))
        else:
            assert isinstance(await client.cancel(job_id), bool)
        return op
    if op == "info":
        where[0] = op
        reply = await client.info(limits=True)
        assert isinstance(reply, P.InfoReply) and reply.workers
        return op
    where[0] = "submit"
    try:
        job = await client.submit(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, seed=i)
    except Overloaded:
        return "overloaded"
    ledger.got(job, prompt, max_tokens)
    where[0] = "result" if op.startswith("result") else "stream"
    if op == "result":
        ledger.complete[job.id] = (await job.result()).token_ids
    elif op == "result_t":
        try:
            ledger.complete[job.id] = (await job.result(timeout=rng.uniform(0.0, 0.05))).token_ids
        except TimeoutError:
            pass
    else:
        seen: list[int] = []
        stop_after = rng.randrange(1, 4) if op == "handler" else None
        ledger.partial[job.id] = seen
        async for chunk in job.stream():
            assert chunk.index == len(seen), f"job {job.id}: chunk at {chunk.index} after {len(seen)} tokens"
            seen.extend(chunk.token_ids)
            await asyncio.sleep(0)  # the handler writes the chunk out: a cancel here finds the stream between yields
            if stop_after is not None and len(seen) >= stop_after:
                break  # the handler's client went away: the stream is left to the garbage collector
        else:
            ledger.complete[job.id] = ledger.partial.pop(job.id)
    return op


async def grouped(client, base: int, rng: random.Random, ledger: Ledger, pool: list[str]):
    """A TaskGroup whose one failing member cancels its siblings wherever they wait."""

    class Boom(Exception):
        pass

    async def fail_later():
        await asyncio.sleep(rng.uniform(0.0, 0.1))
        raise Boom

    try:
        async with asyncio.TaskGroup() as tg:
            for k in range(4):
                tg.create_task(caller(client, base + k, random.Random(rng.random()), ledger, pool))
            tg.create_task(fail_later())
    except* Boom:
        pass


def test_a_storm_of_cancelled_calls_leaves_the_shared_client_whole(cluster):
    c = cluster
    key = c["tenants"]["api-co"]["api_key"]
    rng = random.Random(SEED)
    ledger = Ledger()

    async def main():
        async with AsyncGatewayClient(c["gateway"], key, timeout_s=5) as client:
            pool = [(await client.submit(prompt_token_ids=[1, 2, n], max_tokens=2, ignore_eos=True)).id
                    for n in range(4)]
            await client.info()  # the connection exists before the storm: its reader is the baseline's one task
            tasks_done: list = []
            for wave in range(3):
                runs = [cancel_somehow(random.Random(rng.random()),
                                       caller(client, wave * 100 + i, random.Random(rng.random()), ledger, pool),
                                       tasks_done)
                        for i in range(COROUTINES)]
                runs += [grouped(client, wave * 100 + COROUTINES + 4 * g, random.Random(rng.random()), ledger, pool)
                         for g in range(3)]
                outcomes = await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 90)
                failures = [o for o in outcomes if isinstance(o, BaseException)
                            and not isinstance(o, (asyncio.CancelledError, TimeoutError))]
                assert not failures, failures
                assert not (left := await settled(client)), left
            unfinished = [t for t in tasks_done if not t.done()]
            assert not unfinished, unfinished
            cancelled = sum(t.cancelled() for t in tasks_done)
            # The same client, after the storm: a submission, its stream and its result, side by side.
            job = await client.submit(prompt_token_ids=[9, 9, 9], max_tokens=12, ignore_eos=True)
            streamed = [t async for chunk in job.stream() for t in chunk.token_ids]
            after = (await asyncio.wait_for(job.result(), 30)).token_ids
            assert streamed == after and len(after) == 12
            assert (await client.status(job.id)).job_id == job.id
            assert not (left := await settled(client)), left
        started = time.monotonic()
        client.close()  # again, after __aexit__'s: nothing left to wait on
        return cancelled, time.monotonic() - started

    with Unretrieved() as trouble:
        cancelled, close_s = run(main, trouble)
    assert close_s < 1.0
    assert cancelled >= COROUTINES, f"only {cancelled} calls were cancelled: the storm cancelled too little"
    assert set(ledger.cancelled_in) >= {"submit", "result", "stream", "status", "cancel", "info"}, ledger.cancelled_in

    async def check():
        """Every job as a fresh client reads it: the tokens each caller saw were its own job's."""
        async with AsyncGatewayClient(c["gateway"], key, timeout_s=10) as fresh:
            for job_id, (_, max_tokens) in ledger.jobs.items():
                stored = job_hash(c, job_id)
                # ignore_eos: a job that ran made exactly its max_tokens, which differ between neighbouring callers
                assert stored.get("num_tokens") in (None, str(max_tokens)), f"job {job_id} is another's: {stored}"
                try:
                    tokens = (await asyncio.wait_for((await fresh.job(job_id)).result(), 30)).token_ids
                except JobCancelled:
                    assert job_id not in ledger.complete
                    continue
                assert len(tokens) == max_tokens
                if job_id in ledger.complete:
                    assert ledger.complete[job_id] == tokens, f"job {job_id}: a caller saw another job's tokens"
                if job_id in ledger.partial:
                    seen = ledger.partial[job_id]
                    assert seen == tokens[:len(seen)], f"job {job_id}: a stream delivered another job's tokens"
        return len(ledger.complete), len(ledger.partial)

    with trouble:
        complete, partial = run(check, trouble)
    assert not trouble.seen, trouble.seen
    print(f"cancelled {cancelled} calls, at {dict(ledger.cancelled_in)}; {complete} complete, {partial} partial")
    assert all(asked == answered for asked, answered in ledger.statuses)
    # The check above read real answers, some whole and some cut mid-stream. How many of each the storm leaves is
    # the machine's pace (a slow one cancels more calls during their submission: 10 whole and 3 cut in a CI run
    # whose suite ran 25 % slower, against a bound of 5 each).
    assert complete >= 5 and partial >= 1, (complete, partial)


def test_cancelled_waits_leave_no_subscription_at_the_gateway(cluster):
    """Streams and results cancelled while their jobs wait (the worker stands still) must each have told the gateway
    they left: else it sends every one a keepalive per interval, which the client drops as answering nobody."""
    c = cluster
    key = c["tenants"]["api-co"]["api_key"]
    rng = random.Random(SEED + 1)

    async def waits(client, jobs):
        async def one(job, how: str):
            if how == "stream":
                async for _ in job.stream():
                    await asyncio.sleep(0)
            elif how == "result_t":
                await job.result(timeout=rng.uniform(0.0, 0.3))
            else:
                await (await client.job(job.id)).result()

        runs = [cancel_somehow(random.Random(rng.random()), one(rng.choice(jobs), how), [], spare=False)
                for how in ["stream", "result", "result_t"] * 12]
        return await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 30)

    async def main():
        async with AsyncGatewayClient(c["gateway"], key, timeout_s=5) as client:
            await client.info()
            with frozen(c["workers"][0]["pid"]):
                jobs = [await client.submit(prompt_token_ids=[2, 3, n], max_tokens=3, ignore_eos=True)
                        for n in range(6)]
                try:
                    outcomes = await waits(client, jobs)
                    failures = [o for o in outcomes if isinstance(o, BaseException)
                                and not isinstance(o, (asyncio.CancelledError, TimeoutError))]
                    assert not failures, failures
                    assert not (left := await settled(client)), left
                    conn = next(iter(client._conns.values()))
                    await asyncio.sleep(1.0)  # frames already on their way when the waits gave up
                    before = conn.dropped
                    await asyncio.sleep(1.5)  # five keepalive intervals (KEEPALIVE_ENV)
                    unread = conn.dropped - before
                    states = {(await client.status(job.id)).state for job in jobs}
                    # And close() under waits still in flight: each ends at once, told why.
                    waiting = [asyncio.create_task(job.result()) for job in jobs]
                    waiting += [asyncio.create_task(anext(aiter(job.stream()))) for job in jobs]
                    await asyncio.sleep(0.3)
                    started = time.monotonic()
                    client.close()
                    ended = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), 5)
                    close_s = time.monotonic() - started
                    assert all(isinstance(e, ServingError) and "closed" in str(e) for e in ended), ended
                finally:
                    for job in jobs:
                        await job.cancel()
            return unread, states, close_s

    with Unretrieved() as trouble:
        unread, states, close_s = run(main, trouble)
    assert close_s < 1.0, f"close() took {close_s:.2f}s to end the calls waiting on it"
    assert not trouble.seen, trouble.seen
    assert states <= {"queued", "dispatched", "running"}, states  # still waiting: a subscription left is fed
    assert unread == 0, f"{unread} frames sent to subscriptions of waits that were cancelled"


def test_a_submit_cancelled_after_it_went_out_is_found_again_by_its_idempotency_key(cluster):
    """A submit cancelled once its request left (before its answer, or with the answer already in its inbox) may
    have been admitted: nothing then tells its caller the job id. README's promise for that case is the idempotency
    key: the same submission again gets the same job, which the caller can then cancel."""
    c = cluster
    key = c["tenants"]["api-co"]["api_key"]

    async def cancelled_submit(client, idem: str, answered: bool):
        conn = next(iter(client._conns.values()))
        before = set(conn.inboxes)
        task = asyncio.create_task(client.submit(prompt_token_ids=[5, 4, 3], max_tokens=4, ignore_eos=True,
                                                 idempotency_key=idem))
        deadline = time.monotonic() + 10
        while True:
            assert time.monotonic() < deadline and not task.done(), "the submit's request never went out"
            mine = [conn.inboxes[rid] for rid in set(conn.inboxes) - before]
            if mine and (not answered or mine[0].qsize()):
                break
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert set(conn.inboxes) == before, "the cancelled submit left its inbox"

    async def main():
        async with AsyncGatewayClient(c["gateway"], key, timeout_s=5) as client:
            await client.info()
            found = {}
            for answered in (False, True):
                idem = f"cancelled-submit-{answered}-{time.time_ns()}"
                ids_before = job_ids(c)
                await cancelled_submit(client, idem, answered)
                wait_for(lambda: len(job_ids(c) - ids_before) == 1, 10, "the cancelled submission's job")
                orphan = (job_ids(c) - ids_before).pop()
                again = await client.submit(prompt_token_ids=[5, 4, 3], max_tokens=4, ignore_eos=True,
                                            idempotency_key=idem)
                assert again.id == orphan and again.duplicate
                found[answered] = len((await asyncio.wait_for(again.result(), 30)).token_ids)
            assert not (left := await settled(client)), left
            return found

    with Unretrieved() as trouble:
        found = run(main, trouble)
    assert not trouble.seen, trouble.seen
    assert found == {False: 4, True: 4}


def test_a_stream_whose_wait_timed_out_reads_on_from_its_next_token(cluster):
    """A web handler's heartbeat loop: asyncio.wait_for(anext(chunks), T), a keep-alive sent at each TimeoutError,
    then the same iterator read on; or stream(timeout=T), whose TimeoutError the loop catches the same way. The
    stream was an async generator, which the first timeout ended for good: the loop's next anext() ended it quietly,
    short of every token still to come, against the SDK's promise that a stream never ends quietly short."""
    c = cluster

    async def read_on(chunks, quick_waits: bool) -> tuple[list[int], int]:
        got, timeouts, quick = [], 0, False
        while True:
            try:
                # A zero wait times out before the stream could answer: after each chunk, one wait times out.
                chunk = await asyncio.wait_for(anext(chunks), 0 if quick else 10)
            except TimeoutError:
                timeouts, quick = timeouts + 1, False
                continue
            except StopAsyncIteration:
                return got, timeouts
            assert chunk.index == len(got), f"chunk at {chunk.index} after {len(got)} tokens"
            got.extend(chunk.token_ids)
            quick = quick_waits

    async def main():
        async with AsyncGatewayClient(c["gateway"], c["tenants"]["api-co"]["api_key"], timeout_s=5) as client:
            job = await client.submit(prompt_token_ids=[6, 5, 4], max_tokens=40, ignore_eos=True)
            heartbeat = await asyncio.wait_for(read_on(job.stream(), quick_waits=True), 30)
            with frozen(c["workers"][0]["pid"]):
                late = await client.submit(prompt_token_ids=[4, 5, 6], max_tokens=24, ignore_eos=True)
                bounded = late.stream(timeout=0.1)
                for _ in range(2):  # the job cannot start: the stream's own limit passes, twice
                    with pytest.raises(TimeoutError):
                        await anext(bounded)
            bounded_read = await asyncio.wait_for(read_on(bounded, quick_waits=False), 30)
            expected = [(await j.result()).token_ids for j in (job, late)]
            assert not (left := await settled(client)), left
            return heartbeat, bounded_read, expected

    with Unretrieved() as trouble:
        (heartbeat, timeouts), (bounded, _), (expected, late_expected) = run(main, trouble)
    assert not trouble.seen, trouble.seen
    assert timeouts >= 3, f"only {timeouts} waits timed out mid-stream"
    assert len(expected) == 40 and heartbeat == expected, f"{len(heartbeat)} of 40 tokens after {timeouts} timeouts"
    assert len(late_expected) == 24 and bounded == late_expected


def test_a_stream_raises_its_jobs_end_once_then_ends(cluster):
    """As the blocking stream: a job that ended cancelled (or failed, or expired) raises that once at the end of its
    stream; the next anext() is the stream's end, not the same error again after another round trip."""
    c = cluster

    async def main():
        async with AsyncGatewayClient(c["gateway"], c["tenants"]["api-co"]["api_key"], timeout_s=5) as client:
            with frozen(c["workers"][0]["pid"]):
                doomed = await client.submit(prompt_token_ids=[35, 36], max_tokens=4, ignore_eos=True, seed=9)
                chunks = doomed.stream(timeout=0.2)
                with pytest.raises(TimeoutError):
                    await anext(chunks)
                assert await doomed.cancel()
                with pytest.raises(JobCancelled):
                    await anext(chunks)
                with pytest.raises(StopAsyncIteration):
                    await anext(chunks)
            assert not (left := await settled(client)), left

    with Unretrieved() as trouble:
        run(main, trouble)
    assert not trouble.seen, trouble.seen
