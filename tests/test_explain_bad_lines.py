"""explain on a spans file full of lines that are not JSON (a corrupted disk, a hostile producer): each bad line is
told by its number and skipped, in CPU time growing with the file's size, and no line, however it is nested, ends
explain in a traceback. Judged by this process's CPU time (time.process_time), never by a wall-clock limit; the
line numbers told are checked against the plain count they replaced, on seeded random inputs."""

from __future__ import annotations

import json
import random
import time

from common.traces.json_values import _BATCH_START, iter_json_values
from scripts import explain
from tests.test_explain_hostile import one_job


def plain_iter(text: str):
    """What iter_json_values did before: each bad line's number counted from the start of the text."""
    decoder = json.JSONDecoder()
    pos, n = 0, len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n":
            pos += 1
        if pos >= n:
            return
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            yield None, f"line {text.count(chr(10), 0, pos) + 1}: not JSON ({e.msg})"
            nl = text.find("\n", pos)
            again = text.find(_BATCH_START, pos + 1, None if nl < 0 else nl)
            if again >= 0:
                pos = again
                continue
            if nl < 0:
                return
            pos = nl + 1
            continue
        yield value, None
        pos = end


def least_cpu(text: str) -> float:
    spent = []
    for _ in range(3):  # the least of three: one collection could double a run
        t = time.process_time()
        for _ in iter_json_values(text):
            pass
        spent.append(time.process_time() - t)
    return min(spent)


def test_a_file_of_bad_lines_is_read_in_time_growing_with_its_size():
    """Each bad line's number was counted from the start of the text: 4x the bad lines took 16x the CPU time."""
    cpu = {n: least_cpu("\n".join(['{"resourceSpans": x'] * n)) for n in (4000, 16000)}
    assert cpu[16000] < 8 * cpu[4000], cpu


def test_a_long_line_of_cut_batches_is_read_in_time_growing_with_its_length():
    """Batches cut short and appended to on one line with no newline after: the end of the line was looked for
    again from each batch, to the end of the text (20,000 batches: 2 s; 40,000: 8.5 s)."""
    cpu = {n: least_cpu('{"resourceSpans": x' * n) for n in (2000, 8000)}
    assert cpu[8000] < 8 * cpu[2000], cpu
    assert len(list(iter_json_values('{"resourceSpans": x' * 8000))) == 8000


def test_the_bad_lines_told_are_those_the_plain_count_told():
    rng = random.Random(11)
    good = json.dumps({"resourceSpans": []})
    pieces = [good, good + "\n" + good, '{"resourceSpans": [', "not json", "", "  ", '{"a": 1}', "[1, 2]",
              '{"resourceSpans": [' + good, "x" + good + "y", "\r", good + " trailing",
              '"abc', '"\\u12', '"\\ud800', '"x\\', "tru", "12", "-Infinity", "NaN", "[1,", '{"a":', '{"a"', "1e",
              '"\\"',
              '{"resourceSpans": [{', "  ]}", "}", "]", ',"b": [2]}', "3]", '"x\tabc"',
              json.dumps({"resourceSpans": [{"a": [1, "x"], "b": None}]}, indent=2)]
    for _ in range(2000):
        text = rng.choice(["\n", "\r\n"]).join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        if rng.random() < 0.3:
            text += rng.choice(["\n", "", '{"resourceSpans": x'])
        assert list(iter_json_values(text)) == list(plain_iter(text)), text


def test_a_line_nested_too_deeply_is_told_not_a_traceback(tmp_path, capsys):
    """A line of 5,000 open brackets naming the request: json's decoder raised RecursionError, which the reader did
    not catch, and explain died with a traceback. It is now one bad line, told by its number, and the rest read."""
    path = tmp_path / "spans.jsonl"
    one_job(path, 1)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:1] + ["[" * 5000 + '"job-1"', '{"a": ' * 5000 + '"job-1"'] + lines[1:]) + "\n")
    assert explain.main(["job-1", "--spans", str(path), "--json"]) == 0
    out = capsys.readouterr()
    d = json.loads(out.out)
    assert d["total_s"] > 0.9 and d["workers"] == ["w0"], d
    assert "line 2: not JSON (nested too deeply)" in out.err, out.err
    # Bad from the start to the end: the whole text is one bad value, and the error says so.
    told = list(iter_json_values("[" * 5000 + "\n" + good_batch()))
    assert told == [(None, "line 1: not JSON (nested too deeply)"), (json.loads(good_batch()), None)], told


def good_batch() -> str:
    return json.dumps({"resourceSpans": []})
