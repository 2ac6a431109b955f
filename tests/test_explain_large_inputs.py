"""explain's cost on large inputs: a spans file of many megabytes searched for the ids of a request preempted
thousands of times, and a request with thousands of spans whose gaps are named. Judged by how this process's CPU time
grows (time.process_time: other load on the machine does not count), never by a wall-clock limit; and each faster
path is checked against the plain one it replaced, on seeded random inputs, for the very same answer."""

from __future__ import annotations

import random
import time

from opentelemetry.exporter.otlp.json.file import FileSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from common.traces import accounting, id_lines
from common.traces.spans import Span
from tests.test_explain import closed, ns, req_attrs, start


def other_requests(path, n: int) -> None:
    """``n`` requests that are not the one explained, as a worker writes them (batches, one per line)."""
    provider = TracerProvider(resource=Resource.create({"service.name": "tiered-serve-worker"}))
    provider.add_span_processor(BatchSpanProcessor(FileSpanExporter(str(path)), max_queue_size=3 * n + 16,
                                                   max_export_batch_size=64))
    wk = provider.get_tracer("test")
    for i in range(n):
        ra = req_attrs(f"o{i}", "P2", "other")
        t = i * 0.01
        wreq = start(wk, "worker.request", t, None, ra)
        closed(wk, "worker.prefill", t, t + 0.001, wreq, ra)
        closed(wk, "worker.decode", t + 0.001, t + 0.005, wreq, ra)
        wreq.end(end_time=ns(t + 0.006))
    provider.shutdown()


def substring_scan(paths, tokens) -> list[str]:
    """The scan lines_naming did: every token searched in every line."""
    out = []
    for path in paths:
        with path.open(encoding="utf-8", errors="replace") as f:
            out += [ln.rstrip("\n") for ln in f if any(t in ln for t in tokens)]
    return out


def id_tokens(rng: random.Random, n: int) -> set[str]:
    """Every form read_spans_file seeks of ``n`` span ids (hex either case, base64, URL-safe base64)."""
    return {f for _ in range(n) for f in id_lines.id_forms(format(rng.getrandbits(64), "016x"))}


def test_scanning_a_spans_file_does_not_grow_with_the_ids_sought(tmp_path):
    """The second pass over the spans file searched every line for every id sought, four forms per link of the
    request: for a request preempted thousands of times, tens of thousands of searches of each line (38 MB and
    19,654 ids: 116 s of CPU). 8x the ids sought took 8x the time; now about the same."""
    path = tmp_path / "spans.jsonl"
    other_requests(path, 1500)
    rng = random.Random(7)
    sought = {n: id_tokens(rng, n) for n in (300, 2400)}
    # Some lines do name an id sought: a span id taken from the file itself.
    named = path.read_text().split('"spanId":"')[37][:16]
    for tokens in sought.values():
        tokens |= id_lines.id_forms(named) | {'"o12"'}
    cpu: dict[int, float] = {}
    for n, tokens in sought.items():
        spent = []
        for _ in range(3):
            t = time.process_time()
            got = id_lines.lines_naming([path], tokens)
            spent.append(time.process_time() - t)
        cpu[n] = min(spent)
        assert 0 < len(got) < len(path.read_text().splitlines())
    assert got == substring_scan([path], sought[2400])
    assert cpu[2400] < 3 * cpu[300], cpu


def test_the_lines_selected_are_those_a_substring_search_selects(tmp_path):
    """An id counts wherever it lies in a line, as with the plain search: in a longer string, beside quotes, in
    either case, base64 with its padding; and tokens that are not ids (the request id in quotes, an odd short id)."""
    rng = random.Random(11)
    ids = [format(rng.getrandbits(64), "016x") for _ in range(40)] + [format(rng.getrandbits(128), "032x")
                                                                     for _ in range(20)]
    tokens = {f for i in ids[:30] + ids[40:50] for f in id_lines.id_forms(i)} | {'"req-7"', "ab12", "Q"}
    every_form = [f for i in ids for f in id_lines.id_forms(i)]
    alphabet = "0123456789abcdefABCDEF+/=_-xyzXYZ"
    lines = []
    for _ in range(4000):
        parts = []
        for _ in range(rng.randint(0, 6)):
            r = rng.random()
            if r < 0.3:
                piece = rng.choice(every_form)
                if rng.random() < 0.3:  # cut: a token's part is no token
                    a = rng.randint(0, len(piece) - 1)
                    piece = piece[a:rng.randint(a + 1, len(piece))]
                parts.append(piece)
            elif r < 0.4:
                parts.append(rng.choice(['"req-7"', '"req-70"', "req-7", "ab12", "AB12", "Q", "q"]))
            else:
                parts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))))
        lines.append("".join(p + rng.choice(["", "", '"', ",", ":", " ", "."]) for p in parts))
    path = tmp_path / "lines.jsonl"
    path.write_text("\n".join(lines) + "\n")
    want = substring_scan([path], tokens)
    assert id_lines.lines_naming([path], tokens) == want
    assert 400 < len(want) < 3600, len(want)  # both kinds of line are there


# --------------------------------------------------------------------------------------------
# accounting.transit

T0 = 1_750_000_000 * 10**9


def preempted_on_a_killed_worker(n: int) -> list[Span]:
    """A request on a worker killed -9: no worker.request, only the ended spans it exported, ``n`` times a prefill
    chunk and a suspended period with a gap on either side (what transit names, each gap)."""
    ra = req_attrs("v", "P3", "lab")
    out = [Span("t", "a", None, "gateway.admit", T0, T0 + 1_000_000, dict(ra)),
           Span("t", "q", None, "gateway.queue", T0 + 1_000_000, T0 + 2_000_000, dict(ra)),
           Span("t", "d", None, "gateway.dispatch", T0 + 2_000_000, T0 + 3_000_000, dict(ra))]
    t = T0 + 4_000_000
    for i in range(n):
        out.append(Span("t", f"p{i}", None, "worker.prefill", t, t + 1_000_000, dict(ra)))
        out.append(Span("t", f"s{i}", None, "worker.suspended", t + 1_500_000, t + 3_000_000, dict(ra)))
        t += 3_500_000
    return out


def test_naming_the_gaps_between_thousands_of_spans_grows_with_their_number_not_its_square():
    """Each gap between spans was named by a pass over every span (those covering it, those on either side): with
    2,000 attempts of a job, 8,000 spans, 25 s. From 500 preemptions to 2,000: 16x the CPU time before, now about
    4x."""
    cpu: dict[int, float] = {}
    for n in (500, 2000):
        spans = preempted_on_a_killed_worker(n)
        spent = []
        for _ in range(3):  # the least of three: a few ms each, which one collection could double
            t = time.process_time()
            got = accounting.transit(spans, T0, max(s.end_ns for s in spans))
            spent.append(time.process_time() - t)
        cpu[n] = min(spent)
        assert got["other"] == round(n * 1e-3 - 0.5e-3, 9) and got["to_worker"] == 0.001, got
    assert cpu[2000] < 9 * cpu[500], cpu


NAMES = ("sdk.submit", "gateway.admit", "gateway.queue", "gateway.dispatch", "gateway.dead_letter", "worker.request",
         "worker.queue", "worker.prefill", "worker.decode", "worker.suspended", "scheduler.preemption")


def random_spans(rng: random.Random) -> list[Span]:
    """Spans of the names transit reads, at times on a grid of ns, us or ms from 0 or from an epoch (where a float
    midpoint of two instants rounds), with ties, empty and backwards spans, unset starts, and dispatches with and
    without the attributes of a hand-back and of kept tokens."""
    base = rng.choice([0, T0])
    grid = rng.choice([1, 100, 1000, 1_000_000])
    out = []
    for i in range(rng.randint(0, 25)):
        st = base + rng.randint(0, 40) * grid * rng.choice([1, 1, 37])
        en = st + rng.choice([0, 0, grid, rng.randint(0, 20) * grid, -grid])
        if rng.random() < 0.05:
            st = 0
        name = rng.choice(NAMES)
        attrs: dict = {}
        if name == "gateway.dispatch":
            if rng.random() < 0.5:
                attrs["dispatch.requeue_cause"] = rng.choice(["released", "lease_expired"])
            if rng.random() < 0.6:
                attrs["dispatch.resumed_tokens"] = rng.randint(0, 3)
            if rng.random() < 0.6:
                attrs["dispatch.last_kept_token_ms"] = (base + rng.randint(0, 40 * 37 * grid)) // 1_000_000
        out.append(Span("t", format(i, "016x"), None, name, st, en, attrs))
    return out


def test_transit_names_every_gap_as_the_plain_pass_did():
    rng = random.Random(2024)
    seen: set[str] = set()
    for _ in range(4000):
        spans = random_spans(rng)
        timed = [s for s in spans if s.start_ns > 0] or spans
        t0 = min((s.start_ns for s in timed), default=0)
        t_end = max((s.end_ns for s in timed), default=t0)
        if rng.random() < 0.1:
            t0, t_end = t_end, t0
        want = reference_transit(spans, t0, t_end)
        assert accounting.transit(spans, t0, t_end) == want, spans
        seen |= {k for k, v in want.items() if v}
    assert seen == {*accounting.TRANSIT_KINDS, "kept"}, seen


# The implementation before the bisections, kept as the reference (its behaviour, float midpoints and ties included).

def reference_transit(own, t0, t_end):
    from common.traces.schema import (GATEWAY_ADMIT, GATEWAY_DISPATCH, SDK_SUBMIT, WORKER_DECODE, WORKER_PREFILL,
                                      WORKER_REQUEST)
    out = {k: 0.0 for k in (*accounting.TRANSIT_KINDS, "kept")}
    timed = [s for s in own if s.start_ns > 0 and s.end_ns >= s.start_ns and s.name != SDK_SUBMIT]
    running = () if any(s.name == WORKER_REQUEST for s in timed) else (WORKER_PREFILL, WORKER_DECODE)
    covered = [(s.start_ns, s.end_ns) for s in timed if s.name in accounting._ACCOUNTED or s.name in running]
    inside = [(s.start_ns, s.end_ns, {GATEWAY_ADMIT: "admission", GATEWAY_DISPATCH: "dispatch"}[s.name])
              for s in timed if s.name in (GATEWAY_ADMIT, GATEWAY_DISPATCH)]
    marks = accounting.kept_marks(timed)
    cuts = sorted({t0, t_end} | {t for s in timed for t in (s.start_ns, s.end_ns) if t0 < t < t_end}
                  | {t for _, t in marks if t0 < t < t_end})
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        if any(s <= mid < e for s, e in covered):
            continue
        kind = next((k for s, e, k in inside if s <= mid < e), None) or reference_gap_kind(timed, mid)
        if kind == "lost" and mid < next((kept for start, kept in marks if start >= mid), 0):
            kind = "kept"
        out[kind] += (b - a) / 1e9
    return {k: round(v, 9) for k, v in out.items()}


def reference_gap_kind(timed, at):
    from common.traces.schema import GATEWAY_ADMIT, GATEWAY_DEAD_LETTER, GATEWAY_DISPATCH, GATEWAY_QUEUE, attr_str
    before = [s for s in timed if s.end_ns <= at]
    after = [s for s in timed if s.start_ns >= at]
    prev = max(before, key=lambda s: s.end_ns).name if before else None
    nxt = min(after, key=lambda s: s.start_ns).name if after else None
    if prev is None:
        return "to_gateway"
    if nxt is None:
        return "delivery"
    if prev == GATEWAY_ADMIT:
        return "admission"
    if nxt == GATEWAY_DEAD_LETTER and (prev == GATEWAY_DISPATCH or prev.startswith("worker.")):
        return "lost"
    if prev == GATEWAY_DISPATCH:
        return "to_worker" if nxt.startswith("worker.") else "lost" if nxt == GATEWAY_QUEUE else "other"
    if prev.startswith("worker.") and nxt == GATEWAY_QUEUE:
        redispatch = min((s for s in after if s.name == GATEWAY_DISPATCH), key=lambda s: s.start_ns, default=None)
        released = redispatch is not None and attr_str(redispatch.get("dispatch.requeue_cause")) == "released"
        return "hand_back" if released else "lost"
    return "other"


# --------------------------------------------------------------------------------------------
# Order and repetition

def test_spans_out_of_order_and_written_twice_give_the_same_answer(tmp_path, capsys):
    """An exporter's retry writes a batch twice, and rotated files hold spans of any age: the answer must be the one
    the clean file gives. Every request of test_explain's file, its lines shuffled, some twice, over FILE.1 and FILE."""
    import json

    from scripts import explain
    from tests.test_explain import build_spans_file

    clean = tmp_path / "clean.jsonl"
    build_spans_file(clean)
    lines = clean.read_text().splitlines()
    rng = random.Random(3)
    for rid in ("req-p3", "chat-9", "api-7", "chat-1", "chat-2"):
        assert explain.main([rid, "--spans", str(clean), "--json"]) == 0
        want = json.loads(capsys.readouterr().out)
        for k in range(4):
            messy = lines + rng.sample(lines, 6)
            rng.shuffle(messy)
            path = tmp_path / f"{rid}-{k}.jsonl"
            cut = rng.randint(1, len(messy) - 1)
            (tmp_path / f"{rid}-{k}.jsonl.1").write_text("\n".join(messy[:cut]) + "\n")
            path.write_text("\n".join(messy[cut:]) + "\n")
            assert explain.main([rid, "--spans", str(path), "--json"]) == 0
            assert json.loads(capsys.readouterr().out) == want, (rid, k)
