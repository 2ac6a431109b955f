"""explain on a spans file that was empty when its reading began (just rotated, or just cut by logrotate's
copytruncate), written while it was read, then cut again and written past where the reader had been: the first bytes
the watch kept of it were none, so they matched whatever the file held later, and the cut was not told. The writer
is the project's (the OTLP-JSON file exporter over common.spans_file's AppendStream); the cut is run at a chosen
moment of the reading by a hook around the reader's own functions, as tests/test_explain_truncation.py does."""

from __future__ import annotations

import os
import shutil

from common.spans_file import AppendStream
from common.traces.truncation import TruncationWatch
from tests.test_explain import build_spans_file
from tests.test_explain_truncation import after_first_pass, explain_json, truncated_told, write_others


def test_a_file_empty_when_first_read_then_cut_and_written_past_is_told(tmp_path, monkeypatch):
    """FILE.1 holds other requests' spans, FILE nothing when the reading opens it; the request's batches land in FILE
    as the first pass begins it (the pass reads them), then FILE is cut to nothing and others' batches written past
    where the first pass read. The second pass read only those: 'no scheduling spans for request req-p3', exit 1, no
    warning. Now the cut is told and the spans the first pass read are the answer, the untouched file's."""
    source = tmp_path / "source.jsonl"
    build_spans_file(source)
    still = tmp_path / "still"
    still.mkdir()
    shutil.copy(source, still / "spans.jsonl")
    want = explain_json(still / "spans.jsonl")
    assert want["rc"] == 0, want["err"]
    path = tmp_path / "spans.jsonl"
    write_others(tmp_path / "spans.jsonl.1", 3)
    path.touch()
    real_begin = TruncationWatch.begin
    begun = []

    def begin(self, f):
        real_begin(self, f)
        if f.name == str(path) and not begun:  # the watch has kept FILE's first bytes: none
            begun.append(1)
            stream = AppendStream(path)
            stream.write(source.read_text())
            stream.close()

    def cut_and_write_past():
        reach = path.stat().st_size
        os.truncate(path, 0)
        write_others(path, 100, 10)
        assert path.stat().st_size > reach  # no size tells it

    monkeypatch.setattr(TruncationWatch, "begin", begin)
    calls = after_first_pass(monkeypatch, cut_and_write_past)
    got = explain_json(path)
    monkeypatch.undo()
    assert begun and len(calls) >= 2, (begun, calls)
    assert got["rc"] == 0, got["err"]
    assert truncated_told(got["err"], path), got["err"]
    assert got["json"] == want["json"]
