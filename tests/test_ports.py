"""free_port(): a port free now, drawn below the kernel's ephemeral range, so that the outgoing
connections made while a child process starts cannot take it before the child binds it (a worker
died 12 times in a row on its metrics port in a CI run when ports came from bind(0))."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

from common import ports
from common.ports import ephemeral_range, free_port


def test_ports_are_free_and_below_the_range_outgoing_connections_draw_from():
    low, high = ephemeral_range(ports._EPHEMERAL_RANGE_FILE)
    assert 1024 < low <= high
    if low - 1 < ports._LOWEST:
        pytest.skip(f"this machine's ephemeral range starts at {low}: no room below it to draw from")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(256)
        clients = []
        try:
            for _ in range(200):  # what a busy test machine does meanwhile: connections out
                c = socket.create_connection(server.getsockname())
                clients.append(c)
            outgoing = {c.getsockname()[1] for c in clients}
            picked = [free_port() for _ in range(200)]
        finally:
            for c in clients:
                c.close()
    assert all(low <= p <= high for p in outgoing)
    assert all(ports._LOWEST <= p < low for p in picked)
    assert not outgoing & set(picked)
    for p in picked[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free when handed out


def _only(monkeypatch, tmp_path, port: int) -> None:
    """Leave exactly one port below the ephemeral range: ``port``, as if this process had handed out none yet."""
    monkeypatch.delenv(ports.PORT_RANGE_ENV, raising=False)  # set under pytest-xdist: the range is this test's
    monkeypatch.setattr(ports, "_given", deque(maxlen=ports._REMEMBERED))
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text(f"{port + 1}\t60999\n")
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE_FILE", range_file)
    monkeypatch.setattr(ports, "_LOWEST", port)


def test_a_taken_port_is_never_handed_out(monkeypatch, tmp_path):
    port = free_port()
    _only(monkeypatch, tmp_path, port)
    assert free_port() == port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen(1)
        other = free_port()  # none free below the range: the kernel's choice, still a free one
        assert other != port
        with socket.socket() as s:
            s.bind(("127.0.0.1", other))


def test_a_port_is_not_handed_out_twice_before_its_child_binds_it(monkeypatch, tmp_path):
    # A launcher picks a cluster's ports before any child binds one: the same free port must not come back.
    port = free_port()
    _only(monkeypatch, tmp_path, port)
    assert free_port() == port  # nobody bound it yet: still free, but handed out
    again = free_port()
    assert again != port  # the only port below the range is given: the kernel's choice instead
    with socket.socket() as s:
        s.bind(("127.0.0.1", again))


def test_many_picks_in_one_process_are_all_different():
    picked = [free_port() for _ in range(2000)]  # as a long test session does, none of them bound
    assert len(set(picked)) == len(picked)


@pytest.mark.parametrize("text", ["", "garbage", "1 2 3"])
def test_an_unreadable_range_falls_back_to_linux_default(tmp_path, text):
    f = tmp_path / "range"
    f.write_text(text)
    assert ephemeral_range(f) == (32768, 60999)
    assert ephemeral_range(tmp_path / "absent") == (32768, 60999)


def test_a_range_that_leaves_no_room_below_uses_the_kernels_choice(monkeypatch, tmp_path):
    range_file = tmp_path / "range"
    range_file.write_text("1024 65535")
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE_FILE", range_file)
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_port_range_of_its_own_keeps_a_process_to_it(monkeypatch):
    low, high = (int(x) for x in ports.split_range(1, 3).split("-"))
    monkeypatch.setenv(ports.PORT_RANGE_ENV, f"{low}-{high}")
    picked = [free_port() for _ in range(300)]
    assert all(low <= p <= high for p in picked)
    assert len(set(picked)) == len(picked)


def test_split_ranges_are_disjoint_and_below_the_ephemeral_range():
    low, _ = ephemeral_range(ports._EPHEMERAL_RANGE_FILE)
    if low - 1 < ports._LOWEST + 4:
        pytest.skip(f"this machine's ephemeral range starts at {low}: no room below it to split")
    shares = [tuple(int(x) for x in ports.split_range(i, 4).split("-")) for i in range(4)]
    assert shares[0][0] == ports._LOWEST and shares[-1][1] < low
    for (_, high), (next_low, _) in zip(shares, shares[1:]):
        assert high < next_low


@pytest.mark.parametrize("text", ["garbage", "2000", "3000-2000", "80-90", "60000-70000", "1-2-3"])
def test_a_bad_port_range_is_refused_naming_the_variable(monkeypatch, text):
    monkeypatch.setenv(ports.PORT_RANGE_ENV, text)
    with pytest.raises(ValueError, match=ports.PORT_RANGE_ENV):
        free_port()


def test_up_py_refuses_a_bad_port_range_before_starting_anything(tmp_path):
    root = Path(__file__).resolve().parent.parent
    state = tmp_path / "cluster.json"
    done = subprocess.run([sys.executable, str(root / "scripts" / "up.py"), "--workers", "1", "--model", "tiny",
                           "--state-file", str(state), "--logs-dir", str(tmp_path / "logs")],
                          env=os.environ | {ports.PORT_RANGE_ENV: "9000-8000"}, capture_output=True, text=True,
                          timeout=120, cwd=root)
    assert done.returncode == 2, done.stderr[-2000:]
    assert ports.PORT_RANGE_ENV in done.stderr and "Traceback" not in done.stderr
    assert not state.exists() and not (tmp_path / "logs").exists()
