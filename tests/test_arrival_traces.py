"""common/arrival_traces.py on small hand-made files in each public trace format, and on the shipped Azure traces."""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import random
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from scripts import bench_estimate
from common.arrival_traces import load_trace, spread_ties

DATA = Path(__file__).resolve().parent.parent / "data" / "azure-2023"


def write(path: Path, text: str, encoding: str = "utf-8") -> Path:
    path.write_text(text, encoding=encoding)
    return path


def check(got, expected) -> None:
    # Times go through float epoch seconds, so they are exact to well under a microsecond, not to the bit.
    assert [(p, o) for _, p, o in got] == [(p, o) for _, p, o in expected]
    assert [t for t, _, _ in got] == pytest.approx([t for t, _, _ in expected], abs=1e-6)


def test_bench_estimate_still_exports_load_trace():
    assert bench_estimate.load_trace is load_trace


def test_azure_2023_seven_fractional_digits(tmp_path):
    # Written as a spreadsheet would, with a byte-order mark in front of TIMESTAMP.
    path = write(tmp_path / "conv.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                        "2023-11-16 18:15:46.6805900,374,44\n"
                                        "2023-11-16 18:15:50.9951690,396,109\n"
                                        "2023-11-16 18:16:00.0000009,879,0\n", encoding="utf-8-sig")
    check(load_trace(path, 0, 10), [(0.0, 374, 44), (4.314579, 396, 109), (13.31941, 879, 0)])


def test_azure_2024_offsets_and_timestamps_without_fraction(tmp_path):
    path = write(tmp_path / "code_1week.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                              "2024-05-10 00:00:00.009930+00:00,2048,28\n"
                                              "2024-05-10 00:00:01+00:00,4096,1\n"
                                              "2024-05-10 00:00:01.5000009+00:00,100,7\n"
                                              "2024-05-10 02:00:02.009930+02:00,55,3\n"
                                              "2024-05-10T00:00:03.009930Z,66,4\n")
    check(load_trace(path, 0, 10), [(0.0, 2048, 28), (0.99007, 4096, 1), (1.49007, 100, 7), (2.0, 55, 3),
                                    (3.0, 66, 4)])


def test_azure_multimodal_ignores_num_images(tmp_path):
    path = write(tmp_path / "mm.csv", "TIMESTAMP,NumImages,ContextTokens,GeneratedTokens\n"
                                      "2024-10-15 12:00:00.269000+00:00,1,2912,187\n"
                                      "2024-10-15 12:00:00.519000+00:00,2,3000,12\n")
    check(load_trace(path, 0, 10), [(0.0, 2912, 187), (0.25, 3000, 12)])


def test_naive_timestamps_are_utc_whatever_the_machine_zone(tmp_path, monkeypatch):
    # Local 01:59 and 03:01 on 2023-03-12 are 2 minutes apart in New York (clocks jumped an hour); in UTC, 62.
    path = write(tmp_path / "dst.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                       "2023-03-12 01:59:00.0000000,10,1\n"
                                       "2023-03-12 03:01:00.0000000,20,2\n")
    monkeypatch.setenv("TZ", "EST5EDT,M3.2.0,M11.1.0")  # POSIX rule: needs no tz database
    time.tzset()
    try:
        assert datetime(2023, 3, 12, 3, 1).timestamp() - datetime(2023, 3, 12, 1, 59).timestamp() == 120
        check(load_trace(path, 0, 10), [(0.0, 10, 1), (3720.0, 20, 2)])
    finally:
        monkeypatch.undo()
        time.tzset()


def test_burstgpt(tmp_path):
    path = write(tmp_path / "BurstGPT_1.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                                              "5,ChatGPT,472,18,490,Conversation log\n"
                                              "45,ChatGPT,1087,230,1317,Conversation log\n"
                                              "118.5,GPT-4,417,0,417,API log\n")
    check(load_trace(path, 0, 10), [(0.0, 472, 18), (40.0, 1087, 230), (113.5, 417, 0)])


def test_burstgpt_with_sessions_and_loose_column_names(tmp_path):
    path = write(tmp_path / "BurstGPT_3.csv",
                 " timestamp ,Session ID,Elapsed time,Model, REQUEST TOKENS ,response tokens,Total tokens,Log Type\n"
                 "10,a1,0,ChatGPT,100,20,120,Conversation log\n"
                 "12,a1,2,ChatGPT,150,30,180,Conversation log\n")
    check(load_trace(path, 0, 10), [(0.0, 100, 20), (2.0, 150, 30)])


def test_mooncake_timestamps_are_milliseconds(tmp_path):
    lines = [{"timestamp": 0, "input_length": 6755, "output_length": 500, "hash_ids": [0, 1, 2]},
             {"timestamp": 0, "input_length": 7319, "output_length": 490, "hash_ids": [0, 14]},
             {"timestamp": 3052, "input_length": 7234, "output_length": 794, "hash_ids": [0, 28, 29]},
             {"timestamp": 27482, "input_length": 655, "output_length": 52, "hash_ids": [46, 47]}]
    path = write(tmp_path / "conversation_trace.jsonl", "".join(json.dumps(x) + "\n" for x in lines) + "\n")
    check(load_trace(path, 0, 10), [(0.0, 6755, 500), (0.0, 7319, 490), (3.052, 7234, 794), (27.482, 655, 52)])


@pytest.mark.parametrize("name,text", [
    ("generic.csv", "arrival_time,prompt_tokens,output_tokens\n1.5,10,2\n2.0,20,4\n"),
    ("vidur.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n1.5,10,2\n2.0,20,4\n"),
    ("generic.jsonl", '{"time": 1.5, "input_tokens": 10, "completion_tokens": 2}\n'
                      '{"time": 2.0, "input_tokens": 20, "completion_tokens": 4}\n'),
])
def test_generic_columns_are_seconds(tmp_path, name, text):
    check(load_trace(write(tmp_path / name, text), 0, 10), [(0.0, 10, 2), (0.5, 20, 4)])


def test_gzip(tmp_path):
    path = tmp_path / "trace.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                "2024-05-10 00:00:00+00:00,1,2\n2024-05-10 00:00:04+00:00,3,4\n")
    check(load_trace(path, 0, 10), [(0.0, 1, 2), (4.0, 3, 4)])


def test_window_and_lazy_reading(tmp_path):
    # The bad last row lies beyond the window: the loader must stop before it.
    path = write(tmp_path / "b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                                     "0,ChatGPT,1,1,2,x\n10,ChatGPT,2,2,4,x\n13,ChatGPT,3,3,6,x\n"
                                     "20,ChatGPT,4,4,8,x\nnot a time,ChatGPT,5,5,10,x\n")
    check(load_trace(path, 1, 2), [(0.0, 2, 2), (3.0, 3, 3)])
    check(load_trace(path, 3, 1), [(0.0, 4, 4)])
    with pytest.raises(SystemExit, match=r"no rows in .*b\.csv from row 9"):
        load_trace(path, 9, 5)
    jsonl = write(tmp_path / "m.jsonl", '{"timestamp": 0, "input_length": 1, "output_length": 1}\n'
                                        '{"timestamp": 500, "input_length": 2, "output_length": 2}\n{"timest')
    check(load_trace(jsonl, 0, 2), [(0.0, 1, 1), (0.5, 2, 2)])


def test_rows_out_of_order_are_sorted_stably(tmp_path):
    path = write(tmp_path / "o.csv", "arrival_time,prompt_tokens,output_tokens\n"
                                     "5,1,1\n3,2,2\n5,3,3\n4,4,4\n")
    check(load_trace(path, 0, 10), [(0.0, 2, 2), (1.0, 4, 4), (2.0, 1, 1), (2.0, 3, 3)])


@pytest.mark.parametrize("text", ["", "when,ctx,gen\n1,2,3\n", "TIMESTAMP,ContextTokens\n2024-05-10 00:00:00,5\n",
                                  '{"ts": 1, "prompt": 2}\n'])
def test_unknown_format_names_the_file_and_the_formats_read(tmp_path, text):
    path = write(tmp_path / "mystery.csv", text)
    with pytest.raises(SystemExit) as e:
        load_trace(path, 0, 10)
    message = str(e.value)
    assert "mystery.csv" in message and "unknown trace format" in message
    for name in ("Azure", "BurstGPT", "Mooncake", "ContextTokens", "Request tokens", "input_length"):
        assert name in message


@pytest.mark.parametrize("bad", ["2023-11-16 18:15:47,abc,3", "2023-11-16 18:15:47,5,-3", "2023-11-16 18:15:47,5",
                                 "yesterday,5,3", "2023-11-16 18:15:47,5.5,3", "nan,1,1"])
def test_a_bad_row_names_its_line(tmp_path, bad):
    path = write(tmp_path / "bad.csv", f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,1\n{bad}\n")
    with pytest.raises(SystemExit, match=r"bad\.csv, line 3: bad row"):
        load_trace(path, 0, 10)


@pytest.mark.parametrize("bad", ['{"timestamp": 5, "input_length": 2}', '{"timestamp": 5, "input_length": 2, '
                                 '"output_length": "many"}', '[1, 2, 3]', '{"timestamp": 5,'])
def test_a_bad_jsonl_record_names_its_line(tmp_path, bad):
    path = write(tmp_path / "bad.jsonl", f'{{"timestamp": 0, "input_length": 1, "output_length": 1}}\n\n{bad}\n')
    with pytest.raises(SystemExit, match=r"bad\.jsonl, line 3"):
        load_trace(path, 0, 10)


@pytest.mark.parametrize("name", ["AzureLLMInferenceTrace_conv.csv", "AzureLLMInferenceTrace_code.csv"])
def test_the_shipped_azure_traces_load_as_before(name):
    with (DATA / name).open(newline="") as f:
        raw = [row for _, row in zip(range(500), csv.DictReader(f))]
    at = [datetime.fromisoformat(r["TIMESTAMP"][:26]).replace(tzinfo=timezone.utc).timestamp() for r in raw]
    expected = [(t - at[0], int(r["ContextTokens"]), int(r["GeneratedTokens"])) for t, r in zip(at, raw)]
    assert at == sorted(at)  # in order already, so sorting changes nothing
    check(load_trace(DATA / name, 0, 500), expected)


def test_the_scheduler_simulator_reads_traces_through_the_same_loader(tmp_path):
    from worker.simulator import azure_trace

    path = write(tmp_path / "BurstGPT_1.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                                              "5,ChatGPT,472,18,490,Conversation log\n"
                                              "45,ChatGPT,1087,0,1087,Conversation log\n")
    arrivals = azure_trace(path, max_prompt=1000)
    assert [(a.time_s, a.prompt_tokens, a.max_tokens) for a in arrivals] == [(0.0, 472, 18), (40.0, 1000, 1)]
    shipped = DATA / "AzureLLMInferenceTrace_conv.csv"
    assert [a.time_s for a in azure_trace(shipped, limit=50)] == [t for t, _, _ in load_trace(shipped, 0, 50)]


def burstgpt_seconds(tmp_path, times) -> Path:
    return write(tmp_path / "BurstGPT_1.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 + "".join(f"{t},ChatGPT,{100 + i},{i},{100 + 2 * i},Conversation log\n" for i, t in enumerate(times)))


def test_arrivals_recorded_to_the_second_are_spread_through_it(tmp_path):
    # BurstGPT records whole seconds: five arrivals in second 7 did not come at one instant.
    recorded = [3, 7, 7, 7, 7, 7, 8, 12, 12]
    rows = load_trace(burstgpt_seconds(tmp_path, recorded), 0, 100)
    spread, unit = spread_ties(rows, random.Random(1))
    assert unit == 1.0
    assert [(p, o) for _, p, o in spread] == [(p, o) for _, p, o in rows]  # the same rows, in the same order
    times = [t for t, _, _ in spread]
    assert times[0] == 0.0 and times == sorted(times) and len(set(times)) == len(times)
    # Each moved forward within its own second: the moves, seen from the first row's (times start at it), differ
    # by less than a second.
    moves = [t - (r - recorded[0]) for t, r in zip(times, recorded)]
    assert max(moves) - min(moves) < 1.0 and moves[0] == 0.0
    assert spread_ties(rows, random.Random(1)) == (spread, unit)  # seeded: the same replay every time
    assert spread_ties(rows, random.Random(2))[0] != spread


@pytest.mark.parametrize("recorded,unit", [([0.1, 0.3, 0.3, 0.3, 0.6], 0.1), ([0.25, 0.25, 1.3], 0.01),
                                           ([1.001, 1.001, 1.002], 0.001)])
def test_finer_units_spread_within_their_unit(tmp_path, recorded, unit):
    rows = load_trace(burstgpt_seconds(tmp_path, recorded), 0, 100)
    spread, found = spread_ties(rows, random.Random(3))
    assert found == unit
    assert all(abs(s - t) < unit for (s, _, _), (t, _, _) in zip(spread, rows))
    assert len({t for t, _, _ in spread}) == len(rows)


def test_a_trace_without_ties_replays_as_recorded(tmp_path):
    rows = load_trace(burstgpt_seconds(tmp_path, [3, 4, 5, 9]), 0, 100)
    assert spread_ties(rows, random.Random(1)) == (rows, None)


def test_the_shipped_azure_traces_are_not_spread():
    # Recorded to 100 ns: no unit of UNITS_S fits, so their replays (and every figure in BENCHMARKS.md) stay.
    for name in ("AzureLLMInferenceTrace_conv.csv", "AzureLLMInferenceTrace_code.csv"):
        rows = load_trace(DATA / name, 0, 2000)
        assert spread_ties(rows, random.Random(1)) == (rows, None)


def test_the_scheduler_simulator_spreads_ties_as_the_bench_does(tmp_path):
    from worker.simulator import azure_trace

    recorded = [5, 5, 5, 6, 9, 9]
    path = burstgpt_seconds(tmp_path, recorded)
    times = [a.time_s for a in azure_trace(path, seed=4)]
    assert len(set(times)) == len(times) and times == sorted(times)
    moves = [t - (r - recorded[0]) for t, r in zip(times, recorded)]  # from the first row's, as above
    assert max(moves) - min(moves) < 1.0 and moves[0] == 0.0
    assert [a.time_s for a in azure_trace(path, seed=4)] == times  # seeded
    assert [a.tier for a in azure_trace(path, seed=4)] == [a.tier for a in azure_trace(path, seed=4, spread_ties=False)]
    assert [a.time_s for a in azure_trace(path, seed=4, spread_ties=False)] == [r - recorded[0] for r in recorded]
    # The bench, with the same seed, replays the same arrivals.
    args = argparse.Namespace(trace=path, start=0, arrivals=6, tail=0, seed=4, spread_ties=True)
    assert [t for t, _, _ in bench_estimate.trace_rows(args, say=False)] == times


def test_the_simulator_script_replays_a_whole_second_trace_either_way(tmp_path):
    from scripts import simulate

    path = burstgpt_seconds(tmp_path, [5, 5, 5, 6, 9, 9])
    for flag in ("--spread-ties", "--no-spread-ties"):
        out = tmp_path / f"{flag}.json"
        assert simulate.main(["--azure", str(path), "--limit", "6", flag, "--json", str(out)]) == 0
        result = json.loads(out.read_text())
        assert sum(t["count"] for t in result["priority"]["tiers"].values()) == 6  # every arrival finished


def test_the_bench_spreads_ties_unless_told_not_to(tmp_path, capsys):
    path = burstgpt_seconds(tmp_path, [5, 5, 5, 6, 9, 9])
    args = argparse.Namespace(trace=path, start=0, arrivals=50, tail=50, seed=1, spread_ties=True)  # the bench's flags
    spread = bench_estimate.trace_rows(args)
    assert "recorded to 1 s" in capsys.readouterr().err
    assert len({t for t, _, _ in spread}) == 6
    args.spread_ties = False
    assert bench_estimate.trace_rows(args) == load_trace(path, 0, 100)
    assert capsys.readouterr().err == ""

