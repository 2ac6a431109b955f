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

from common.traces import otlp_json
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
    """The scan _lines_naming did: every token searched in every line."""
    out = []
    for path in paths:
        with path.open(encoding="utf-8", errors="replace") as f:
            out += [ln.rstrip("\n") for ln in f if any(t in ln for t in tokens)]
    return out


def id_tokens(rng: random.Random, n: int) -> set[str]:
    """Every form read_spans_file seeks of ``n`` span ids (hex either case, base64, URL-safe base64)."""
    return {f for _ in range(n) for f in otlp_json._id_forms(format(rng.getrandbits(64), "016x"))}


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
        tokens |= otlp_json._id_forms(named) | {'"o12"'}
    cpu: dict[int, float] = {}
    for n, tokens in sought.items():
        spent = []
        for _ in range(3):
            t = time.process_time()
            got = otlp_json._lines_naming([path], tokens)
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
    tokens = {f for i in ids[:30] + ids[40:50] for f in otlp_json._id_forms(i)} | {'"req-7"', "ab12", "Q"}
    every_form = [f for i in ids for f in otlp_json._id_forms(i)]
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
    assert otlp_json._lines_naming([path], tokens) == want
    assert 400 < len(want) < 3600, len(want)  # both kinds of line are there
