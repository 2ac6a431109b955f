"""explain on a spans file that up.py rotates while explain reads it: the answer of the files as they were when it
began, never one missing the spans that moved. The rotation is the real one (common/spans_file.rotate, what up.py
calls) and the writer the real AppendStream, run at a chosen moment of the reading by a hook around the reader's
own functions, so that each race is met every time."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import threading

from common import spans_file
from common.spans_file import AppendStream, rotate, rotated_files
from common.traces import otlp_json
from scripts import explain
from tests.test_explain_hostile import one_job
from tests.test_explain_warnings import others


def job_files(tmp_path, split: int):
    """job-1's spans (one a line) in FILE.1 (its first ``split`` lines) and FILE (the rest), among other requests'
    lines; and the answer explain gives on a copy nobody rotates."""
    job = tmp_path / "job.jsonl"
    one_job(job, 1)
    lines = job.read_text().splitlines()
    other = tmp_path / "other.jsonl"
    others(other, 6)
    noise = other.read_text().splitlines()
    path = tmp_path / "spans.jsonl"
    if split:
        rotated = tmp_path / "spans.jsonl.1"
        rotated.write_text("\n".join(noise[:3] + lines[:split]) + "\n")
    path.write_text("\n".join(lines[split:] + noise[3:]) + "\n")
    still = tmp_path / "still"
    still.mkdir()
    for p in rotated_files(path):
        shutil.copy(p, still / p.name)
    return path, answer(still / path.name)


def answer(path) -> dict:
    out = explain_json(path)
    assert out["rc"] == 0, out
    return out["json"]


def explain_json(path) -> dict:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        rc = explain.main(["job-1", "--spans", str(path), "--json"])
    return {"rc": rc, "json": json.loads(out.getvalue()) if rc == 0 else None, "err": err.getvalue()}


def rotate_and_write(path) -> None:
    """up.py's rotation of FILE, then a process's next batch, which opens a new FILE."""
    assert rotate(path, 1, keep=5)
    stream = AppendStream(path)
    stream.write('{"resourceSpans": []}\n')
    stream.close()


def test_a_rotation_between_the_two_passes_loses_no_span(tmp_path, monkeypatch):
    """The files were listed once, before the first pass: rotated after it, the second pass read FILE.1 as FILE, FILE
    as the new (empty) file and missed FILE.2. A request all in FILE was told as unknown (exit 1); one straddling
    FILE.1 and FILE lost its admission (told as incomplete, its queue wait gone)."""
    for split in (0, 3):
        case = tmp_path / f"split{split}"
        case.mkdir()
        path, want = job_files(case, split)
        real = otlp_json.lines_naming
        calls = []

        def hooked(*args, **kwargs):
            got = real(*args, **kwargs)
            if not calls:
                rotate_and_write(path)
            calls.append(1)
            return got

        monkeypatch.setattr(otlp_json, "lines_naming", hooked)
        got = explain_json(path)
        monkeypatch.undo()
        assert len(calls) == 2, calls  # both passes ran, the rotation between them
        assert got["rc"] == 0, (split, got["err"])
        assert got["json"] == want, split


def test_a_rotation_while_the_files_are_opened_loses_no_span(tmp_path, monkeypatch):
    """Rotated just after the files were listed, FILE.1 then named what had been FILE, FILE the new file, and what
    had been FILE.1 (now FILE.2) was read by neither pass. The files are opened again until they are those the
    path names once they are all open."""
    path, want = job_files(tmp_path, 3)
    real = spans_file.rotated_files
    calls = []

    def hooked(p):
        got = real(p)
        if not calls:
            rotate_and_write(path)
        calls.append(1)
        return got

    monkeypatch.setattr(spans_file, "rotated_files", hooked)
    monkeypatch.setattr(otlp_json, "rotated_files", hooked, raising=False)
    got = explain_json(path)
    monkeypatch.undo()
    assert calls, "the hook never ran"
    assert got["rc"] == 0, got["err"]
    assert got["json"] == want


def test_a_half_written_last_line_is_at_most_a_warning(tmp_path, monkeypatch):
    """A process's batch caught half written (its write(2) not yet done, or a disk that filled): the line is told and
    skipped, the rest of the answer unchanged; completed between the two passes, it is read whole."""
    path, want = job_files(tmp_path, 3)
    job_line = (tmp_path / "job.jsonl").read_text().splitlines()[-1]
    cut = len(job_line) - 40  # past its ids and the request's: both passes pick it
    assert '"job-1"' in job_line[:cut]
    with path.open("a") as f:
        f.write(job_line[:cut])
    got = explain_json(path)
    assert got["rc"] == 0, got["err"]
    assert f"{path}, line" in got["err"] and "not JSON" in got["err"], got["err"]
    # The half line is a copy of a span the file holds whole: skipping it changes nothing.
    assert got["json"] == want
    real = otlp_json.lines_naming
    calls = []

    def hooked(*args, **kwargs):
        got = real(*args, **kwargs)
        if not calls:
            with path.open("a") as f:
                f.write(job_line[cut:] + "\n")
        calls.append(1)
        return got

    monkeypatch.setattr(otlp_json, "lines_naming", hooked)
    got = explain_json(path)
    monkeypatch.undo()
    assert got["rc"] == 0 and "not JSON" not in got["err"], got["err"]
    assert got["json"] == want


def test_a_pipe_is_read_once_and_explained(tmp_path):
    """--spans <(zcat spans.jsonl.gz): the first pass read the pipe to its end, the second found it empty, and the
    request was told as unknown (exit 1, 'no trace carries it'). A file that cannot be read again is read once,
    whole."""
    path, want = job_files(tmp_path, 0)
    r, w = os.pipe()
    data = path.read_bytes()
    feeder = threading.Thread(target=lambda: (os.write(w, data), os.close(w)), daemon=True)
    feeder.start()
    try:
        got = explain_json(f"/dev/fd/{r}")
    finally:
        feeder.join(10)
        os.close(r)
    assert got["rc"] == 0, got["err"]
    assert got["json"] == want


def test_a_file_rotating_at_each_opening_is_said_to_miss_spans(tmp_path, monkeypatch):
    """Rotated again each time it was opened: what was last opened is read, and explain says spans may be missing."""
    path, _ = job_files(tmp_path, 3)
    real = spans_file.rotated_files

    def hooked(p):
        got = real(p)
        rotate_and_write(path)
        return got

    monkeypatch.setattr(spans_file, "rotated_files", hooked)
    got = explain_json(path)
    monkeypatch.undo()
    assert got["rc"] in (0, 1), got["err"]
    assert f"warning: {path} was rotated while it was opened" in got["err"], got["err"]
