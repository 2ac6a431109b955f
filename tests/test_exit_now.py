"""common/process.exit_now, how a gateway and a worker end: everything a normal exit does before the interpreter's
teardown (threads joined, atexit handlers, stdio flushed), and its status; the teardown itself is left out."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from common import process

    out = Path({out!r})
    atexit.register(lambda: (out / "atexit").write_text("ran"))

    def late():
        time.sleep(0.3)
        (out / "thread").write_text("joined")
    threading.Thread(target=late).start()
    pool = ThreadPoolExecutor(1)
    pool.submit(lambda: (time.sleep(0.3), (out / "pool").write_text("done")))

    class Teardown:
        def __del__(self):
            (out / "teardown").write_text("ran")
    kept = Teardown()
    sys.stdout.write("unflushed")
    process.exit_now(3)
""")


def test_exit_now_joins_threads_runs_atexit_flushes_and_skips_the_teardown(tmp_path):
    script = SCRIPT.format(root=str(ROOT), out=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "unflushed"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "pool").read_text() == "done"
    assert not (tmp_path / "teardown").exists()  # the module teardown (what cost the time) did not run
