"""What the wait model saw at each admission, written down so that it can be replayed offline.

A wait estimate depends on the whole cluster's state at one instant (the queues, every worker's held work and
rates, the learned arrival rates), which no later run reproduces: two runs of one trace differ more than most
changes to the model do (BENCHMARKS.md, issue 12). With ``estimate_dump`` set, the gateway appends one JSON line
per admitted job: the job's id, the inputs ``told_wait_s`` was given and the estimate it told.
``scripts/estimate_replay.py`` then asks any version of the model about the same states and judges it against the
waits a bench run measured, so two models are compared on identical states.

A debugging aid, off by default: it costs a line written per admission.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from common.tiers import Tier
from gateway.estimate_steps import StepCost
from gateway.estimate_types import Arrivals, Held, Queued, Rates, Work, WorkerView

VERSION = 1


def _work(w: Work) -> list:
    return [w.tier.value, w.prefill, w.decode]


def _unwork(x: list) -> Work:
    return Work(Tier(x[0]), float(x[1]), float(x[2]))


def _num(x: float) -> float | str:
    """JSON has no infinity: the standard's strict readers refuse Python's ``Infinity``."""
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def _unnum(x: float | str) -> float:
    return float(x)


def encode(told_s: float, bias: float, at: float, tier: Tier, workers: list[WorkerView], queued: list[Queued],
           arrivals: list[Arrivals], unread: dict[Tier, tuple[int, Work]], fits: frozenset[int] | None = None,
           **kw: float) -> dict[str, Any]:
    """One estimate's inputs and what it told, as plain JSON values; ``kw``: told_wait_s's scalar keywords;
    ``fits``: the workers the job fits (replay's), written only where it is not every one."""
    return {**({"fits": sorted(fits)} if fits is not None else {}),
        "v": VERSION, "at": at, "told_s": _num(told_s), "bias": bias, "tier": tier.value,
        "workers": [{"slots": w.slots, "rates": [w.rates.prefill_tps, w.rates.decode_tps],
                     "held": [[*_work(h.work), h.status, h.preemptible_by, h.guard, h.context] for h in w.held],
                     "handoff_s": w.handoff_s, "idle_handoff_s": w.idle_handoff_s,
                     "step_tokens": _num(w.step_tokens),
                     "step": None if w.step is None else [w.step.base_s, w.step.token_s, w.step.pair_s],
                     "age_s": w.age_s} for w in workers],
        # A sixth element only on workers of different sizes (Queued.fits): dumps of alike workers are as they were.
        "queued": [[*_work(q.work), q.enqueued_s, _num(q.promoted_s), *([sorted(q.fits)] if q.fits is not None else [])]
                   for q in queued],
        "arrivals": [[*_work(a.work), a.per_s, None if a.settles_to is None else _num(a.settles_to), a.settle_s]
                     for a in arrivals],
        "unread": {t.value: [n, *_work(w)] for t, (n, w) in unread.items()},
        "kw": {k: _num(v) for k, v in kw.items()},
    }


@dataclass
class Dumped:
    """One admission's estimate as written: the job, what the model was asked, what it told."""

    job_id: str
    at: float  # the gateway's clock
    told_s: float  # the estimate returned (after any bias factor)
    bias: float  # the bias factor applied (1: none)
    tier: Tier
    workers: list[WorkerView]
    queued: list[Queued]
    arrivals: list[Arrivals]
    unread: dict[Tier, tuple[int, Work]]
    kw: dict[str, float]  # enqueued_s, aging_interval_s, promoted_s
    work: Work | None = None  # the job's own, as the arrival rates counted it
    fits: frozenset[int] | None = None  # the workers the job fits, on workers of different sizes (None: any)

    def args(self) -> tuple[tuple, dict[str, Any]]:
        """told_wait_s's positional and keyword arguments (without ``futures``)."""
        return ((self.tier, self.workers, self.queued),
                {"arrivals": self.arrivals, "unread": self.unread, **self.kw,
                 **({"fits": self.fits} if self.fits is not None else {})})


def decode(line: dict[str, Any]) -> Dumped:
    if line.get("v") != VERSION:
        raise ValueError(f"estimate dump line of version {line.get('v')!r}; this code reads {VERSION}")
    return Dumped(
        job_id=line["job_id"], at=float(line["at"]), told_s=float(line["told_s"]), bias=float(line["bias"]),
        tier=Tier(line["tier"]),
        workers=[WorkerView(w["slots"], Rates(*w["rates"]),
                            [Held(_unwork(h[:3]), int(h[3]), int(h[4]), float(h[5]) if len(h) > 5 else 0.0,
                                  float(h[6]) if len(h) > 6 else 0.0) for h in w["held"]],
                            w["handoff_s"], w["idle_handoff_s"], _unnum(w.get("step_tokens", "inf")),
                            StepCost(*w["step"]) if w.get("step") else None, float(w.get("age_s", 0.0)))
                 for w in line["workers"]],  # older dumps: no step_tokens (before workers said it), no step cost,
        # no cost per pair, no contexts
        queued=[Queued(_unwork(q[:3]), float(q[3]), _unnum(q[4]), frozenset(q[5]) if len(q) > 5 else None)
                for q in line["queued"]],
        arrivals=[Arrivals(_unwork(a[:3]), float(a[3]),
                           *([None if a[4] is None else _unnum(a[4]), float(a[5])] if len(a) > 4 else []))
                  for a in line["arrivals"]],  # a dump from before settling rates has four fields
        unread={Tier(t): (int(x[0]), _unwork(x[1:])) for t, x in line["unread"].items()},
        kw={k: _unnum(v) for k, v in line["kw"].items()},
        work=_unwork(line["work"]) if "work" in line else None,
        fits=frozenset(line["fits"]) if "fits" in line else None,
    )


class DumpWriter:
    """Appends an admitted job's estimate inputs: ``hold`` keeps the last estimate's, ``admitted`` writes it with
    the job's id if it is that admission's (a refused admission's is dropped with the next estimate)."""

    def __init__(self, path: str | Path) -> None:
        try:
            self._file: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115: open for the gateway's life
        except OSError as e:  # a configuration error: the gateway says so and exits 2
            raise ValueError(f"estimate_dump: cannot append to {str(path)!r}: {e.strerror or e}") from None
        self._held: dict[str, Any] | None = None

    def hold(self, record: dict[str, Any]) -> None:
        self._held = record

    def admitted(self, job_id: str, at: float, work: Work | None = None) -> None:
        """``at``: the clock the admission's estimate was made at; a record held from another (a refused one's, an
        idempotent duplicate's) is not this job's. ``work``: the job's own (prompt, expected output), so that a
        replay can rebuild the arrivals from the dump itself and try other forecasts of them."""
        record, self._held = self._held, None
        if record is None or record["at"] != at:
            return
        own = {"work": _work(work)} if work is not None else {}
        self._file.write(json.dumps({"job_id": job_id, **record, **own}) + "\n")
        self._file.flush()  # a killed gateway's dump is read up to its last admission

    def close(self) -> None:
        self._file.close()


def read(path: str | Path) -> Iterator[Dumped]:
    """Every line of a dump; a last line cut short (a gateway killed while writing it) is left out."""
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, 1):
            if not text.strip() or not text.endswith("\n"):
                continue
            try:
                yield decode(json.loads(text))
            except (ValueError, KeyError, TypeError, IndexError) as e:
                raise ValueError(f"{path}:{n}: not an estimate dump line: {e}") from None
