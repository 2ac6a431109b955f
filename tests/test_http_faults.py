"""The HTTP front door under failure and hostile clients: a real local cluster of two gateways
(scripts/up.py), a real `python -m gateway.http` process, real HTTP clients."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import httpx
import pytest

from common.ports import free_port
from gateway.http.health import HEALTH_TIMEOUT_S
from tests.cluster_helpers import job_hash, local_cluster, state_pids, wait_for
from tests.test_http import front_door, key, sse


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    # No front door of up.py's: each test starts the door it needs (front_door).
    with local_cluster(tmp_path_factory.mktemp("http-faults"), tiny_model_dir, workers=1, gateways=2,
                       max_running=4, http=False) as c:
        yield c


def endpoints(c: dict) -> list[str]:
    return [g["endpoint"] for g in c["gateways"]]


def test_a_stream_outlives_its_client_leaving_the_door_s_table(cluster, tiny_model_dir, tmp_path):
    # A door that keeps one client: another tenant's request pushes the streaming tenant's client out of the
    # table. It was closed then (its users counted only the submission, not the stream), so the stream went
    # silent until the SDK took its gateway for dead (upstream_timeout_s) and failed over on a client nobody
    # would close again.
    log = tmp_path / "door.log"
    with front_door(tiny_model_dir, endpoints(cluster), log, env={"TS_HTTP_MAX_CLIENTS": "1"}) as base:
        body = {"prompt": [3, 4], "max_tokens": 600, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {key(cluster, 'api-co')}"}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = [next(lines) for _ in range(4)]  # events and the blank lines between them
            other = httpx.post(base + "/v1/completions", json={"prompt": [5], "max_tokens": 1}, timeout=120,
                               headers={"Authorization": f"Bearer {key(cluster, 'lab-co')}"})
            assert other.status_code == 200, other.text
            rest, gaps, last = [], [], time.monotonic()
            for line in lines:
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                rest.append(line)
        events, done = sse(first + rest)
        assert done and "error" not in events[-1], events[-1]
        assert events[-1]["usage"]["completion_tokens"] == 600
        assert events[-2]["choices"][0]["finish_reason"] == "length"
    text = log.read_text()
    assert "silent for" not in text, text[-2000:]
    assert max(gaps) < 10, f"the stream stood still {max(gaps):.1f}s"


@pytest.mark.parametrize("live", [0, 1], ids=["no-gateway", "the-second-gateway"])
def test_health_answers_within_its_timeout_whichever_gateways_are_down(cluster, tiny_model_dir, tmp_path, live):
    # Each gateway was asked in turn by a client that retried a silent one twice (HEALTH_TIMEOUT_S, 2 s, three
    # times): with both down /health took 12 s to say so, and with the first down 6 s to say all was well,
    # past the few seconds a readiness probe waits.
    dead = f"tcp://127.0.0.1:{free_port()}"
    gateways = [dead, endpoints(cluster)[0] if live else f"tcp://127.0.0.1:{free_port()}"]
    with front_door(tiny_model_dir, gateways, tmp_path / "door.log", health_key=key(cluster, "lab-co")) as base:
        for _ in range(2):
            start = time.monotonic()
            r = httpx.get(base + "/health", timeout=60)
            took = time.monotonic() - start
            assert r.status_code == (200 if live else 503), r.text
            assert r.json()["status"] == ("ok" if live else "unavailable")
            assert took < HEALTH_TIMEOUT_S + 2, f"/health took {took:.1f}s"


def test_a_huge_prompt_being_tokenized_does_not_stop_the_door(cluster, tiny_model_dir, tmp_path):
    # The prompt was tokenized on the event loop: for the seconds a body of many megabytes took, the door
    # answered nobody (every other tenant's stream, /health and /metrics stood still).
    rng = random.Random(3)
    words = ["alpha", "beta", "gamma", "épsilon", "ζήτα", "東京", "🙂"]
    prompt = " ".join(rng.choice(words) for _ in range(1_200_000))
    body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    with front_door(tiny_model_dir, endpoints(cluster), tmp_path / "door.log",
                    env={"TS_HTTP_MAX_BODY_BYTES": str(len(body) + 1024)}) as base:
        done: dict = {}

        def huge() -> None:
            start = time.monotonic()
            done["response"] = httpx.post(base + "/v1/completions", content=body, timeout=300, headers={
                "Authorization": f"Bearer {key(cluster, 'api-co')}", "Content-Type": "application/json"})
            done["took"] = time.monotonic() - start

        thread = threading.Thread(target=huge)
        thread.start()
        slowest = 0.0
        while thread.is_alive():
            start = time.monotonic()
            assert httpx.get(base + "/v1/models", timeout=60).status_code == 200
            slowest = max(slowest, time.monotonic() - start)
            time.sleep(0.05)
        thread.join()
        # Over the context and over the ids a request may carry: refused for its prompt, after the tokenizing.
        assert done["response"].status_code == 400, done["response"].text
        assert done["response"].json()["error"]["param"] == "prompt"
        assert done["took"] > 3, "the prompt was tokenized too fast to tell"
        # Tokenized on the loop, one probe waits out the whole tokenizing (slowest ~ took); off it, the loop still
        # pauses for single GIL-holding steps, longer on a slower machine (2.8 s of a 34.8 s prompt in a CI run).
        bound = max(1.5, done["took"] / 4)
        assert slowest < bound, f"the door answered nothing for {slowest:.1f}s (the prompt took {done['took']:.1f}s)"


def test_a_stream_the_door_gives_up_on_is_cancelled_like_a_whole_request(cluster, tiny_model_dir, tmp_path):
    # Every gateway hung (SIGSTOP) mid-stream: the door waits out its upstream timeout on each, then ends the
    # stream with an error event. A whole request that timed out so was cancelled; a stream was not, and its job
    # ran to its end once the gateways were back, for a client told it had failed.
    # The worker stands still too: on a quiet machine it generated all 1500 tokens while the door waited, and its
    # completion reached the gateways before the door's cancel.
    pids = [state_pids(cluster)[g["id"]] for g in cluster["gateways"]] + [state_pids(cluster)["wk-0"]]
    with front_door(tiny_model_dir, endpoints(cluster), tmp_path / "door.log",
                    env={"TS_HTTP_UPSTREAM_TIMEOUT_S": "3"}) as base:
        body = {"prompt": [3, 4], "max_tokens": 1500, "ignore_eos": True, "stream": True}
        stopped = False
        try:
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {key(cluster, 'api-co')}"}) as r:
                assert r.status_code == 200
                job_id = r.headers["X-Request-Id"]
                lines = r.iter_lines()
                next(lines)
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP)
                stopped = True
                events, done = sse(list(lines))
                for pid in pids:  # back at once: the door's cancellation is on its way to them
                    os.kill(pid, signal.SIGCONT)
                stopped = False
        finally:
            if stopped:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
        assert done and events[-1]["error"]["code"] == "upstream_timeout", events[-1:]
        h = wait_for(lambda: (h := job_hash(cluster, job_id))["state"] in ("cancelled", "done") and h, 90,
                     "the job to end")
        assert h["state"] == "cancelled", h


def test_a_million_ids_past_the_serving_limits_do_not_stop_the_door(cluster, tiny_model_dir, tmp_path):
    # A prompt the serving workers leave no room for goes to a gateway (it knows the workers a redeploy brings back),
    # through the SDK, whose check of each id (~0.7 s for the 1,048,576 a request may carry) ran on the door's event
    # loop: every other request of the door stood still meanwhile.
    from common import protocol as P

    rng = random.Random(5)
    body = json.dumps({"prompt": [rng.randrange(5, 300) for _ in range(P.MAX_LIST_LEN)], "max_tokens": 1}).encode()
    with front_door(tiny_model_dir, endpoints(cluster), tmp_path / "door.log",
                    env={"TS_HTTP_MAX_BODY_BYTES": str(len(body) + 1024)}) as base:
        headers = {"Authorization": f"Bearer {key(cluster, 'api-co')}", "Content-Type": "application/json"}
        assert httpx.post(base + "/v1/completions", json={"prompt": [5], "max_tokens": 1}, timeout=60,
                          headers=headers).status_code == 200  # the tenant's client is made and its limits known
        done: dict = {}

        def huge() -> None:
            done["response"] = httpx.post(base + "/v1/completions", content=body, timeout=300, headers=headers)

        thread = threading.Thread(target=huge)
        thread.start()
        slowest = 0.0
        while thread.is_alive():
            start = time.monotonic()
            assert httpx.get(base + "/v1/models", timeout=60).status_code == 200
            slowest = max(slowest, time.monotonic() - start)
            time.sleep(0.02)
        thread.join()
        r = done["response"]
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text  # refused as before
        # Every probe was answered meanwhile. How soon is not asserted: the door's loop still pauses for single
        # steps that hold the GIL (the body's validation, the frame's packing: ~0.1 s each here alone, 0.66 s
        # seen beside a whole suite, against a 0.5 s bound that failed two CI runs). That the SDK's check of the
        # ids runs off the loop is the next test's, which fails on the loop whatever the machine's pace.
        print(f"slowest probe answer while the huge request ran: {slowest:.2f} s")


def test_a_million_ids_are_checked_off_the_door_s_event_loop(cluster, tiny_model_dir, monkeypatch):
    # Timed, the test above told a door that checks the ids on its event loop only where the check outlasted a
    # bound: with the check put back on the loop (LOOP_SUBMIT_MAX_IDS past a million), it passed two runs of three
    # here (slowest answer 0.17 s). Here the door runs in this process, and each check of a submission says which
    # thread ran it.
    from common import protocol as P
    from gateway.sdk import _async, _sync
    from tests.test_http_disconnects import served_door

    checked = []
    real = _async.sized_submit_request

    def sized_submit_request(*args, **kwargs):
        checked.append((threading.current_thread(), len(args[2] or ())))
        return real(*args, **kwargs)

    monkeypatch.setattr(_async, "sized_submit_request", sized_submit_request)
    monkeypatch.setattr(_sync, "sized_submit_request", sized_submit_request)
    body = json.dumps({"prompt": [7] * P.MAX_LIST_LEN, "max_tokens": 1}).encode()
    headers = {"Authorization": f"Bearer {key(cluster, 'api-co')}", "Content-Type": "application/json"}
    with served_door(tiny_model_dir, endpoints(cluster)[0], max_body_bytes=len(body) + 1024) as door:
        base = f"http://127.0.0.1:{door.port}"
        assert httpx.post(base + "/v1/completions", json={"prompt": [5], "max_tokens": 1}, timeout=60,
                          headers=headers).status_code == 200
        r = httpx.post(base + "/v1/completions", content=body, timeout=300, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    big = [thread for thread, n in checked if n == P.MAX_LIST_LEN]
    assert big, f"the million ids were never checked: {checked}"
    assert door.thread not in big, "the SDK checked a million ids on the door's event loop"
