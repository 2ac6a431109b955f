"""explain's warnings about the spans file's bad lines name the line as the file numbers it: a user who opens the
file there finds the line that was skipped. Spans are made by the real OpenTelemetry SDK and written through its
OTLP-JSON file exporter."""

from __future__ import annotations

import json
import re

from scripts import explain
from opentelemetry.exporter.otlp.json.file import FileSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from tests.test_explain import closed, req_attrs
from tests.test_explain_hostile import one_job


def others(path, n: int) -> None:
    """``n`` lines of other requests' spans (one span a line), none naming job-1 or its traces."""
    provider = TracerProvider(resource=Resource.create({"service.name": "tiered-serve-worker"}))
    provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(str(path))))
    wk = provider.get_tracer("test")
    for i in range(n):
        closed(wk, "worker.request", i * 0.01, i * 0.01 + 0.005, None, req_attrs(f"o{i}", "P2", "other"))
    provider.shutdown()


def bad_lines_told(err: str) -> list[str]:
    return re.findall(r"warning: (.*?): not JSON", err)


def test_a_bad_line_is_told_by_its_line_in_the_file(tmp_path, capsys):
    """The file is read twice, keeping only the lines that name the request or its traces, and the bad lines were
    numbered among those kept: a cut line naming the request at line 63 of the file was told as 'line 3'."""
    path = tmp_path / "spans.jsonl"
    others(path, 60)
    job = tmp_path / "job.jsonl"
    one_job(job, 1)
    job_lines = job.read_text().splitlines()
    lines = path.read_text().splitlines()
    cut = job_lines[0][:-40] + ' "job-1"'  # a line cut short (a full disk), still naming the request
    lines = lines[:10] + job_lines[:2] + lines[10:] + [cut] + job_lines[2:]
    path.write_text("\n".join(lines) + "\n")
    assert explain.main(["job-1", "--spans", str(path), "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["workers"] == ["w0"]
    want = lines.index(cut) + 1
    assert want > 50, want
    assert bad_lines_told(out.err) == [f"{path}, line {want}"], out.err


def test_a_bad_line_of_a_rotated_file_is_told_by_that_file_and_its_line(tmp_path, capsys):
    """With rotated files, the text of all of them was numbered as one (and one more line for each file's join): a
    bad line at line 2 of FILE was told as 'line 6' among the lines picked, 'line 7' with the files read whole. Each
    is now told by its file and its line there, whether the lines were picked by the request's ids or the files
    read whole (nothing names the request)."""
    job = tmp_path / "job.jsonl"
    one_job(job, 1)
    job_lines = job.read_text().splitlines()
    path = tmp_path / "spans.jsonl"
    old = tmp_path / "spans.jsonl.1"
    old.write_text("\n".join(job_lines[:3] + ['{"resourceSpans": [ "job-1"']) + "\n")
    path.write_text("\n".join(job_lines[3:4] + ['{"resourceSpans": "job-1" x'] + job_lines[4:]) + "\n")
    assert explain.main(["job-1", "--spans", str(path), "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["workers"] == ["w0"]
    assert bad_lines_told(out.err) == [f"{old}, line 4", f"{path}, line 2"], out.err
    # Read whole: the request named nowhere (an unknown id).
    assert explain.main(["job-9", "--spans", str(path)]) == 1
    assert bad_lines_told(capsys.readouterr().err) == [f"{old}, line 4", f"{path}, line 2"]
