"""Wait estimates on workers of different sizes, for the jobs queued ahead: dispatch hands a worker's free slot to the
first job in line that fits that worker (gateway/dispatch.py reads past a job whose workers are full), so a job ahead
that fits only some of the workers a job may go to never takes the others' slots, and the wait model must not give
them to it either.

Real processes (tests/uneven_cluster.py): redis-server, a gateway, a real small worker (2 slots, 64 tokens a job) and
a big worker played by a peer that keeps its one slot full.
"""

from __future__ import annotations

import pytest

from tests.cluster_helpers import wait_for
from tests.uneven_cluster import uneven_cluster

pytestmark = pytest.mark.faults  # real clusters: `make test-faults` runs these alone


def test_a_job_both_workers_fit_is_not_told_to_wait_behind_jobs_only_the_big_worker_fits(tmp_path, tiny_model_dir):
    """Four long jobs only the (full) big worker fits were queued, then a short one both fit: dispatch started it on
    the small worker's free slot at once, but the model gave the small worker's slots to the big jobs ahead, so it was
    told it would wait for one of them to finish (seconds: 1,000 tokens each)."""
    with uneven_cluster(tmp_path, tiny_model_dir) as u:
        c = u.cluster
        lab = c.client("lab-co", timeout_s=60.0)
        big = [lab.submit(prompt_token_ids=[5] * 100, max_tokens=1000, ignore_eos=True) for _ in range(4)]
        wait_for(lambda: all(c.state(j.id) == "queued" for j in big), 10, "the big jobs to stay queued")
        short = lab.submit(prompt_token_ids=[5] * 10, max_tokens=20, ignore_eos=True)
        result = short.result(timeout=60)
        assert c.job(short.id)["worker"] == b"wk-0"
        assert all(c.state(j.id) == "queued" for j in big)  # still: they went nowhere before it
        told, waited = short.estimated_wait_s, result.queued_s
        # Within 2x of the wait, with a hand-off's slack (a wait this short is mostly the hand-off).
        assert told <= 2 * waited + 0.5, f"told {told:.2f} s, waited {waited:.2f} s"
        u.big.free.set()
        for j in big:
            assert len(j.result(timeout=60).token_ids) == 1000
        lab.close()
