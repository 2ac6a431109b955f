"""explain on a spans file truncated in place while it reads it (logrotate's copytruncate: FILE copied to FILE.1,
then cut to nothing; or a bare ``: > FILE``), the writers going on appending to it. The file is the same open file
throughout, so nothing told the reader: the second pass found none of the first pass's lines and the request was told
as unknown, without a word. The writer is the project's (the OTLP-JSON file exporter over common.spans_file's
AppendStream); the truncation is run at a chosen moment of the reading by a hook around the reader's own functions,
as tests/test_explain_rotation.py does, so that each race is met every time."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from common.traces import id_lines, otlp_json
from scripts import explain
from tests.test_explain import AppendExporter, build_spans_file, closed, req_attrs

REQUEST = "req-p3"  # preempted twice: its decisions are spans of other traces, kept by the second pass


def spans_and_answer(tmp_path):
    """The spans file, and the answer explain gives on an untouched copy."""
    path = tmp_path / "spans.jsonl"
    build_spans_file(path)
    still = tmp_path / "still"
    still.mkdir()
    shutil.copy(path, still / path.name)
    out = explain_json(still / path.name)
    assert out["rc"] == 0, out["err"]
    return path, out["json"]


def explain_json(path) -> dict:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = explain.main([REQUEST, "--spans", str(path), "--json"])
    return {"rc": rc, "json": json.loads(out.getvalue()) if rc == 0 else None, "err": err.getvalue()}


def write_others(path, n: int, first: int = 0) -> None:
    """``n`` other requests' spans, one batch each, appended as a process of the cluster does (O_APPEND)."""
    provider = TracerProvider(resource=Resource.create({"service.name": "tiered-serve-worker"}))
    provider.add_span_processor(SimpleSpanProcessor(AppendExporter(path)))
    wk = provider.get_tracer("test")
    for i in range(first, first + n):
        closed(wk, "worker.request", 40 + i * 0.01, 40 + i * 0.01 + 0.005, None, req_attrs(f"late-{i}", "P2", "x"))
    provider.shutdown()


def copytruncate(path) -> None:
    """logrotate's copytruncate: the content copied to FILE.1, then FILE cut to nothing in place."""
    shutil.copy(path, f"{path}.1")
    os.truncate(path, 0)


def after_first_pass(monkeypatch, action, times: int = 1) -> list[int]:
    """Runs ``action`` after each of the first ``times`` passes of the reader over the files."""
    real = otlp_json.lines_naming
    calls: list[int] = []

    def hooked(*args, **kwargs):
        calls.append(1)  # before: a pass that finds the file cut raises
        got = real(*args, **kwargs)
        if len(calls) <= times:
            action()
        return got

    monkeypatch.setattr(otlp_json, "lines_naming", hooked)
    return calls


def truncated_told(err: str, path) -> bool:
    return f"warning: {path} was truncated in place while it was read" in err


def test_a_copytruncate_between_the_two_passes_gives_the_whole_answer(tmp_path, monkeypatch):
    """The first pass found the request's lines; the file was then copied to FILE.1 and cut, and a process appended
    its next batch. The second pass read only that batch: 'no scheduling spans for request req-p3 (no trace carries
    it)', exit 1, no warning. Now the cut is told, the files are read again from the start (FILE.1 among them), and
    the answer is the untouched file's: its spans read twice (before the cut, and in FILE.1) count once."""
    path, want = spans_and_answer(tmp_path)
    calls = after_first_pass(monkeypatch, lambda: (copytruncate(path), write_others(path, 3)))
    got = explain_json(path)
    monkeypatch.undo()
    assert got["rc"] == 0, got["err"]
    assert len(calls) == 4, calls  # two passes, then two again from the start
    assert truncated_told(got["err"], path), got["err"]
    assert got["json"] == want
    assert len(got["json"]["suspensions"]) == 2 and len(got["json"]["decisions"]) == 2


def test_a_file_cut_with_no_copy_keeps_the_spans_read_before_the_cut(tmp_path, monkeypatch):
    """``: > FILE`` between the passes, no copy kept: the spans the first pass had read (every line naming the
    request) are the answer, and the warning says the file was cut."""
    path, want = spans_and_answer(tmp_path)
    after_first_pass(monkeypatch, lambda: (os.truncate(path, 0), write_others(path, 2)))
    got = explain_json(path)
    monkeypatch.undo()
    assert got["rc"] == 0, got["err"]
    assert truncated_told(got["err"], path), got["err"]
    assert "not JSON" not in got["err"], got["err"]
    assert got["json"] == want


def test_a_cut_in_the_middle_of_a_pass_and_written_past_is_told(tmp_path, monkeypatch):
    """Cut while the first pass was at its third line, then written past where the reader was (its buffered read
    ended there): the pass went on from the middle of a line of the new batches and never saw the request's lines.
    Told, read again from the start: the copy holds them all."""
    path, want = spans_and_answer(tmp_path)
    before = path.stat().st_size
    real = id_lines._TokenFinder.in_line
    seen = [0]

    def in_line(self, line):
        seen[0] += 1
        if seen[0] == 3:
            copytruncate(path)
            write_others(path, 100)
            assert path.stat().st_size > before  # past where the reader was: no size alone tells it
        return real(self, line)

    monkeypatch.setattr(id_lines._TokenFinder, "in_line", in_line)
    got = explain_json(path)
    monkeypatch.undo()
    assert got["rc"] == 0, got["err"]
    assert truncated_told(got["err"], path), got["err"]
    assert "not JSON" not in got["err"], got["err"]  # the line the reader was cut into is not told as a bad line
    assert got["json"] == want


def test_a_document_file_read_whole_is_watched_too(tmp_path, monkeypatch):
    """A pretty-printed document is read whole after the first pass (no line of it parses alone): cut before that
    read, it was read as empty and the request told as unknown."""
    lines_file, want = spans_and_answer(tmp_path)
    spans = [s for ln in lines_file.read_text().splitlines() for s in json.loads(ln)["resourceSpans"]]
    path = tmp_path / "doc.json"
    path.write_text(json.dumps({"resourceSpans": spans}, indent=2))
    after_first_pass(monkeypatch, lambda: copytruncate(path))
    got = explain_json(path)
    monkeypatch.undo()
    assert got["rc"] == 0, got["err"]
    assert truncated_told(got["err"], path), got["err"]
    assert got["json"] == want


def test_a_file_cut_at_every_reading_is_bounded_and_said(tmp_path, monkeypatch):
    """Cut after every pass: the reading starts again a bounded number of times, then says spans may be missing.
    From the second reading on, the file is cut and written again to the length that was read of it."""
    path, _ = spans_and_answer(tmp_path)
    n = [0]

    def cut():
        n[0] += 1
        os.truncate(path, 0)
        write_others(path, 1, n[0])  # as long as the batch before it: only its first bytes tell the cut

    calls = after_first_pass(monkeypatch, cut, times=100)
    got = explain_json(path)
    monkeypatch.undo()
    assert len(calls) == otlp_json.TRUNCATED_TRIES * 2, calls
    assert got["rc"] in (0, 1), got["err"]
    assert truncated_told(got["err"], path), got["err"]
    assert f"was truncated again each time it was read ({otlp_json.TRUNCATED_TRIES} times)" in got["err"], got["err"]


def test_a_file_that_only_grows_is_not_told_as_cut(tmp_path, monkeypatch):
    """A process appending between the passes (the usual case) is no truncation: one reading, no warning."""
    path, want = spans_and_answer(tmp_path)
    calls = after_first_pass(monkeypatch, lambda: write_others(path, 5))
    got = explain_json(path)
    monkeypatch.undo()
    assert len(calls) == 2, calls
    assert got["rc"] == 0 and got["err"] == "", got["err"]
    assert got["json"] == want


def test_spans_read_twice_count_once_and_the_first_read_is_kept(tmp_path, monkeypatch):
    """The spans read before the cut and read again in the copy are one span each (counted exactly against the
    untouched file's); a copy whose span differs from what was read before (here the admission's queue.ahead.P3) is
    the later read, and the first one is kept, as for any duplicate id (common.traces.spans.dedupe)."""
    path, want = spans_and_answer(tmp_path)
    untouched = otlp_json.read_spans_file(tmp_path / "still" / path.name, REQUEST).spans
    admit = '"name":"gateway.admit"'

    def altered_copytruncate():
        lines = path.read_text().splitlines()
        lines = [ln.replace('"queue.ahead.P3","value":{"intValue":"1"}', '"queue.ahead.P3","value":{"intValue":"9"}')
                 if admit in ln and '"req-p3"' in ln else ln for ln in lines]
        assert sum('"intValue":"9"' in ln for ln in lines) == 1
        (tmp_path / "spans.jsonl.1").write_text("\n".join(lines) + "\n")
        os.truncate(path, 0)

    after_first_pass(monkeypatch, altered_copytruncate)
    got = otlp_json.read_spans_file(path, REQUEST)
    monkeypatch.undo()
    assert any("was truncated in place" in w for w in got.warnings), got.warnings
    keys = [s.key for s in got.spans]
    assert len(keys) == len(set(keys)) == len(untouched), (len(keys), len(set(keys)), len(untouched))
    assert set(keys) == {s.key for s in untouched}
    admission = [s for s in got.spans if s.name == "gateway.admit" and s.get("request.id") == REQUEST]
    assert [s.get("queue.ahead.P3") for s in admission] == [1]
    got = explain_json(path)  # the copy is all there is now: its (altered) admission is read
    assert got["rc"] == 0 and got["json"] != want, got
