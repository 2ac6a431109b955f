"""explain run in-process (as a long-running tool would run it, again and again) leaves no spans file open, whichever
way the reading goes: the two passes, rotated files, a document read whole, a file that is not OTLP, a file truncated
while it is read and read again, and a reading that an exception ends mid-pass. Each open handle would be one
descriptor fewer for every later reading.

The files are written by the cluster's exporter (FileSpanExporter over common.spans_file's AppendStream), rotated by
the function up.py calls; the descriptors counted are the process's own (/proc/self/fd)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.spans_file import rotate
from common.traces import id_lines, otlp_json
from scripts import explain
from tests.test_explain import build_spans_file
from tests.test_explain_truncation import write_others

REQUEST = "req-p3"

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc/self/fd")


def open_under(folder: Path) -> list[str]:
    """The files under ``folder`` this process holds open, one entry per descriptor."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(f"{folder}/"):
                out.append(target)
    return sorted(out)


@contextlib.contextmanager
def closes_what_it_opens(folder: Path) -> Iterator[None]:
    """Nothing under ``folder`` open after the block, nor closed only by the garbage collector on the way (CPython
    closes a dropped file object with a ResourceWarning: one kept by a traceback, a cache or a generator stays open)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        yield
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == [], unclosed
    assert open_under(folder) == []


def run(*argv: str) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return explain.main(list(argv))


@pytest.fixture
def spans(tmp_path) -> Path:
    """FILE.1 and FILE, the request's lines in both, and other requests' batches appended by the cluster's exporter."""
    path = tmp_path / "spans.jsonl"
    build_spans_file(path)
    assert rotate(path, 1, keep=3)
    write_others(path, 4)
    assert open_under(tmp_path) == [], "the writers left the files open"
    return path


def test_explain_leaves_no_spans_file_open_on_any_reading(spans, monkeypatch):
    folder = spans.parent
    lines = [ln for p in (Path(f"{spans}.1"), spans) for ln in p.read_text().splitlines()]
    doc = folder / "doc.json"
    doc.write_text(json.dumps({"resourceSpans": [r for ln in lines for r in json.loads(ln)["resourceSpans"]]},
                              indent=2))
    not_otlp = folder / "notes.txt"
    not_otlp.write_text("not spans\n")
    runs = [((REQUEST, "--spans", str(spans), "--json"), 0),  # both passes over FILE.1 and FILE
            ((REQUEST, "--spans", str(spans)), 0),
            (("nobody", "--spans", str(spans)), 1),  # nothing names it: every file parsed whole
            ((REQUEST, "--spans", str(doc)), 0),  # one document: read whole after the first pass
            ((REQUEST, "--spans", str(not_otlp)), 2),
            ((REQUEST, "--spans", str(folder / "absent.jsonl")), 2)]
    for _ in range(3):  # a handle per reading would grow with them
        for argv, rc in runs:
            with closes_what_it_opens(folder):
                assert run(*argv) == rc, argv


def test_a_file_truncated_while_read_leaves_no_file_open(spans, monkeypatch):
    """Cut after each first pass (logrotate's copytruncate): read again from the start, each reading's files closed."""
    real = otlp_json.lines_naming
    cuts = []

    def cut_after_a_pass(*args, **kwargs):
        got = real(*args, **kwargs)
        if len(cuts) < 2:
            cuts.append(1)
            shutil.copy(spans, f"{spans}.cut{len(cuts)}")
            os.truncate(spans, 0)
            write_others(spans, 1, 10 + len(cuts))
        return got

    monkeypatch.setattr(otlp_json, "lines_naming", cut_after_a_pass)
    with closes_what_it_opens(spans.parent):
        got = otlp_json.read_spans_file(spans, REQUEST)
    monkeypatch.undo()
    assert len(cuts) == 2 and any("truncated in place" in w for w in got.warnings), got.warnings


def test_a_reading_an_exception_ends_mid_pass_leaves_no_file_open(spans, monkeypatch):
    """An exception out of the middle of a pass (a bug, a KeyboardInterrupt at the terminal) leaves the iteration over
    the file abandoned: the files are closed all the same."""
    calls = []

    def stop(self, line):
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(id_lines._TokenFinder, "in_line", stop)
    with closes_what_it_opens(spans.parent), pytest.raises(KeyboardInterrupt) as stopped:
        otlp_json.read_spans_file(spans, REQUEST)  # the files read_spans_file opened
    with closes_what_it_opens(spans.parent), pytest.raises(KeyboardInterrupt) as stopped_too:
        id_lines.lines_naming([Path(f"{spans}.1"), spans], {'"x"'})  # those lines_naming opens by their names
    assert stopped.tb is not None and stopped_too.tb is not None  # their frames, held by the tracebacks kept
    assert len(calls) == 2, calls
