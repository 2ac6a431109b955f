"""What the gateway knows about workers, and which worker gets the next job.

Credit-based: a worker's credit is its free batch slots, less jobs sent since its
last load report (none before its first). Low tiers only go where there is credit,
so ordering and aging stay in Redis instead of in worker backlogs; P0 and P1 may
also go to a full worker that reports a running job they may preempt
(WorkerLoad.victims).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from common.protocol import WorkerHello, WorkerLoad
from common.tiers import Tier
from gateway.estimate_steps import StepCost
from gateway.estimate_types import PREEMPTED_BY


# A step cost past this (per step, per token or per pair) is a broken worker's, not a slow one's: not believed.
MAX_STEP_COST_S = 3600.0
# A job's context past this many tokens is a broken worker's report (no model holds one): not believed.
MAX_CONTEXT_TOKENS = 1 << 24
# A worker that drained (told to stop) and then fell silent is remembered by its size this long: a redeploy brings it
# back, model loading included, and the jobs only it fits wait for it (up to their queue timeouts) rather than fail on
# a smaller worker, or be refused as too big for the cluster. A scale-down's worker is forgotten after it.
DRAINED_MEMORY_S = 300.0
# Workers registered at once. Without CURVE any peer is taken at its hello's word, and each hello under a new id was
# kept until the worker timeout: a peer looping hellos grew the registry, and every pass over it, without end. Past
# this the oldest worker that never reported a load is forgotten (it holds no job: a gateway sends work only by a
# report's credit), and a hello that finds every one reporting is refused. Far above one gateway's workers.
MAX_WORKERS = 1024


def reported_guard(entry: list) -> int:
    """The tokens a WorkerLoad.work entry says its preemption guards still protect it (its seventh field): none
    from an older worker, and none believed from a bad value. At most the job's prompt and output: a guard ends
    with its job, so a larger one (a buggy worker's) must not make every estimate unbounded and shed all work."""
    guard = entry[6] if len(entry) > 6 else 0
    if type(guard) is not int or guard <= 0:
        return 0
    return min(guard, max(0, entry[2]) + max(0, entry[4]))  # ints: the protocol decodes work as list[int]


def reported_context(entry: list) -> int:
    """The tokens a WorkerLoad.work entry says its job has in the KV cache (its eighth field): none from an older
    worker, and none believed from a bad value (not a whole number, below none, or past MAX_CONTEXT_TOKENS)."""
    context = entry[7] if len(entry) > 7 else 0
    return context if type(context) is int and 0 < context <= MAX_CONTEXT_TOKENS else 0


def step_tokens(hello: WorkerHello) -> float:
    """Most prompt tokens one of the worker's engine steps prefills, as its hello says; inf where it does not say
    (an older worker) or says nonsense (below one token): a prompt is then taken to be prefilled in one step."""
    n = hello.max_num_batched_tokens
    return float(n) if n is not None and n >= 1 else math.inf


def reported_step(load: WorkerLoad | None) -> StepCost | None:
    """The step cost a worker's report gives, where it gives a usable one (no part negative nor past an hour, the
    base and per token not both nothing); else None, and its jobs are timed at its token rates."""
    if load is None:
        return None
    base, token, pair = load.step_base_s, load.step_token_s, load.step_pair_s
    if not all(0 <= x <= MAX_STEP_COST_S for x in (base, token, pair)) or not base + token > 0:
        return None  # NaN fails every comparison
    return StepCost(float(base), float(token), float(pair))


def limits_fit(limits: dict[str, int] | None, tier: Tier, tokens: int) -> bool:
    limit = (limits or {}).get(tier.value)
    return limit is None or tokens <= limit


@dataclass
class WorkerState:
    hello: WorkerHello
    identity: bytes  # ZeroMQ routing id
    last_seen: float
    load: WorkerLoad | None = None
    # Jobs sent but not yet listed in a load report: they use credit the report does not know about.
    pending: set[str] = field(default_factory=set)
    load_at: float = 0.0  # when the latest load report came (this gateway's clock)
    # Silent for a lease, or a lease it held ran out, since its last report: it may be dead (killed after that
    # report, and not yet timed out when lease_s < worker_timeout_s). It gets no job until it reports again;
    # before, the requeued job went back to it by that report's credit, and lost another lease and another of
    # its max_attempts.
    lost_lease: bool = False
    # Taken by this gateway's memory alone while Redis did not answer (gateway/model_pin.py): it gets no job until a
    # load report, once Redis answers, finds its model the cluster's. Its answers would otherwise come from whatever
    # model it serves, stored as done, until that check drops it.
    unconfirmed: bool = False

    @property
    def draining(self) -> bool:
        """Told to stop (worker/drain.py), as its hello or its latest report says: a worker never stops draining."""
        return self.hello.draining is True or (self.load is not None and self.load.draining is True)

    @property
    def held_back(self) -> bool:
        """Sent no job, on its credit or for a victim: it may be dead (lost_lease), its model is not confirmed, it
        drains, or it has not reported yet (a hello says how many slots it has, not how many are free: a gateway that
        restarted hears the hellos of workers whose slots are all busy)."""
        return self.lost_lease or self.unconfirmed or self.draining or self.load is None

    @property
    def credit(self) -> int:
        if self.held_back:
            return 0
        return max(0, self.load.free_slots - len(self.pending))

    @property
    def stepping(self) -> bool:
        """Running or about to run something, as far as the gateway knows: a job sent now is read after the step
        in progress (the hand-off's two cases, gateway/wait_learning.HandOffs)."""
        return bool(self.pending) or (self.load is not None and any((*self.load.running.values(),
                                                                      *self.load.waiting.values())))

    def victims_left(self, urgent_sent: set[str], tier_of: Callable[[str], Tier | None] = lambda _: None,
                     ) -> dict[Tier, int]:
        """Per P0/P1: running jobs here it may preempt, less the urgent jobs sent since the last report, plus the
        jobs sent here since then that it may preempt (``tier_of``: the tier a job was admitted at, None where not
        known). Those run when the urgent job arrives, or wait behind it: either way it starts at the next step.
        Left out, an urgent job admitted while a job just sent here ran its first step waited in the queue for the
        report at that step's end, and its dispatch then came just after the worker had begun the next step: it
        waited two steps, a second or two beside a long prompt's chunks, where the wait model told it one."""
        if self.held_back:
            return {}
        unreported = len(self.pending & urgent_sent)
        sent = [t for t in map(tier_of, self.pending - urgent_sent) if t is not None]
        out = {}
        for t, n in self.load.victims.items():
            if t in ("P0", "P1"):
                urgent = Tier(t)
                out[urgent] = n - unreported + sum(self._may_preempt(urgent, v) for v in sent)
        return out

    def _may_preempt(self, urgent: Tier, victim: Tier) -> bool:
        """By the worker's preemption matrix as its report shows it (the mask of a job of ``victim``'s tier it
        holds), else by the default matrix."""
        mask = next((e[5] for e in self.load.work.values() if len(e) > 5 and e[0] == victim.rank
                     and type(e[5]) is int), PREEMPTED_BY[victim])
        return bool((mask >> urgent.rank) & 1)

    def guarded_victims(self, tier: Tier) -> int:
        """Running jobs here ``tier`` may preempt, but not yet: a preemption guard protects them (a resumed
        victim's residency; the report's seventh field, WorkerLoad.work). A job sent where every victim is
        guarded waits in the worker until a guard lifts, while another worker may have one free now."""
        if self.load is None:
            return 0
        return sum(1 for e in self.load.work.values()
                   if len(e) > 6 and e[1] == 0 and isinstance(e[5], int) and (e[5] >> tier.rank) & 1
                   and reported_guard(e))

    def fits(self, tier: Tier, tokens: int) -> bool:
        """A job of ``tier`` holding ``tokens`` (prompt + max_tokens) fits here, as the hello says (a worker that
        does not say is taken to: it refuses what does not, and the job fails with why)."""
        return limits_fit(self.hello.tier_max_tokens, tier, tokens)

    @property
    def preemption_cost_s(self) -> float:
        return self.load.preemption_cost_s if self.load is not None else 0.0


class WorkerRegistry:
    def __init__(self, timeout_s: float, drained_memory_s: float = DRAINED_MEMORY_S,
                 max_workers: int = MAX_WORKERS) -> None:
        self.timeout_s = timeout_s
        self.max_workers = max_workers
        self.workers: dict[str, WorkerState] = {}
        # Workers that drained and timed out: id -> (hello, when dropped), for DRAINED_MEMORY_S.
        self.drained: dict[str, tuple[WorkerHello, float]] = {}
        self.drained_memory_s = drained_memory_s
        # The cluster's memory of drained workers (gateway/drained.py): id -> tier limits, as read last. It holds
        # those this gateway never heard drain (it restarted meanwhile, or it is another gateway's worker).
        self.shared_drained: dict[str, dict[str, int]] = {}

    def has_room(self, worker_id: str) -> bool:
        """A hello from ``worker_id`` may be taken: it is registered, or there is room for it, or a worker that never
        reported can be forgotten to make some (``MAX_WORKERS``)."""
        return worker_id in self.workers or len(self.workers) < self.max_workers or self._silent() is not None

    def _silent(self) -> str | None:
        """The worker that said hello longest ago and never reported, if any."""
        silent = [w for w in self.workers.values() if w.load is None]
        return min(silent, key=lambda w: w.last_seen).hello.worker_id if silent else None

    def hello(self, msg: WorkerHello, identity: bytes, now: float, confirmed: bool = True) -> str | None:
        """Register (or refresh) the worker; the caller asked ``has_room``. Returns the id of the worker forgotten to
        make room, if one was. ``confirmed``: Redis said its model is the cluster's (else a worker registered
        unconfirmed stays so; one confirmed before stays confirmed: its model was held to this gateway's memory)."""
        forgotten = None
        if msg.worker_id not in self.workers and len(self.workers) >= self.max_workers:
            forgotten = self._silent()
            if forgotten is None:
                raise ValueError(f"no room for worker {msg.worker_id}: ask has_room first")
            del self.workers[forgotten]  # not remembered as drained either: a made-up id must not grow that
        self.drained.pop(msg.worker_id, None)
        old = self.workers.get(msg.worker_id)
        # A worker re-announces every few seconds: its latest report stays as it was, with when it came (its age
        # advances the running work it lists, gateway/wait_estimator.report_age_s).
        self.workers[msg.worker_id] = WorkerState(msg, identity, now, old.load if old else None,
                                                  old.pending if old else set(), old.load_at if old else 0.0,
                                                  old.lost_lease if old else False,
                                                  not confirmed and (old is None or old.unconfirmed))
        return forgotten

    def load(self, msg: WorkerLoad, now: float) -> bool:
        w = self.workers.get(msg.worker_id)
        if w is None:
            return False  # unknown: it must say hello first
        w.load, w.last_seen, w.load_at, w.lost_lease = msg, now, now, False
        w.pending -= set(msg.job_ids)
        return True

    def expire(self, now: float) -> list[str]:
        gone = [wid for wid, w in self.workers.items() if now - w.last_seen > self.timeout_s]
        for wid in gone:
            w = self.workers.pop(wid)
            if w.draining:
                self.drained[wid] = (w.hello, now)
        for wid in [wid for wid, (_, at) in self.drained.items() if now - at > self.drained_memory_s]:
            del self.drained[wid]
        return gone

    def uneven(self) -> bool:
        """The workers' hellos give different tier limits: a job may fit some of them and not the others (also a
        drained worker's, remembered: a job only it fits waits for it)."""
        limits = [w.hello.tier_max_tokens for w in self.workers.values()] + self._drained_limits()
        return len({tuple(sorted((x or {}).items())) for x in limits}) > 1

    def _drained_limits(self) -> list[dict[str, int] | None]:
        """The tier limits of the workers that drained lately, as this gateway remembers them and as the cluster
        does; a registered worker is judged by what it says now (back from a redeploy, or draining again)."""
        shared = [x for wid, x in self.shared_drained.items() if wid not in self.workers and wid not in self.drained]
        return [h.tier_max_tokens for h, _ in self.drained.values()] + shared

    def places(self, tier: Tier, tokens: int) -> set[str] | None:
        """The workers a job of ``tier`` holding ``tokens`` (prompt + max_tokens) may go to, where it fits some and not
        others; None: anywhere (workers alike, every one fits, or none registered or drained lately does: nothing
        here can run it now, and rather than wait for a worker that may never come, a P3 having no queue timeout, it
        is sent on and fails with the reason). Empty: only draining workers fit it, or drained ones (DRAINED_MEMORY_S);
        it waits for them (a redeploy's worker comes back, and the jobs it handed back were otherwise sent on to fail
        on a smaller one, also once it had exited and timed out before its restart)."""
        if not self.uneven():
            return None
        fit = {w.hello.worker_id for w in self.workers.values() if not w.draining and w.fits(tier, tokens)}
        if fit:
            return fit if len(fit) < len(self.workers) else None
        return set() if self.returning_fits(tier, tokens) else None

    def returning_fits(self, tier: Tier, tokens: int) -> bool:
        """A draining worker, or one that drained lately, fits such a job: a redeploy brings it back."""
        return any(w.fits(tier, tokens) for w in self.workers.values() if w.draining) or \
            any(limits_fit(x, tier, tokens) for x in self._drained_limits())

    def total_credit(self) -> int:
        return sum(w.credit for w in self.workers.values())

    def with_credit(self) -> WorkerState | None:
        """The worker with the most credit (spreads load), or None."""
        best = max(self.workers.values(), key=lambda w: w.credit, default=None)
        return best if best is not None and best.credit > 0 else None

    def max_model_len(self) -> int | None:
        lens = [w.hello.max_model_len for w in self.workers.values()]
        return min(lens) if lens else None

    def all_take_sampling_extras(self) -> bool:
        """Every registered worker takes DispatchJob's stop_token_ids, min_tokens and penalties (its hello says
        ``sampling_extras``)."""
        return all(w.hello.sampling_extras for w in self.workers.values())

    def vocab_size(self) -> int | None:
        sizes = [w.hello.vocab_size for w in self.workers.values()]
        return min(sizes) if sizes else None

    def tier_max_tokens(self, tier: str) -> int | None:
        """Largest prompt + max_tokens some worker that says accepts for ``tier``, of those not draining where any
        says (None: none says). Not the smallest worker's: dispatch sends a job only to workers it fits
        (gateway/dispatch.py), and one small worker (or one whose P0 reserve leaves the lower tiers little) made
        every job past its share refused, though the others could run it."""
        said = [w for w in self.workers.values() if w.hello.tier_max_tokens and tier in w.hello.tier_max_tokens]
        live = [w for w in said if not w.draining] or said
        return max(w.hello.tier_max_tokens[tier] for w in live) if live else None

    def returning_max_tokens(self, tier: str) -> int | None:
        """Largest prompt + max_tokens for ``tier`` that a draining worker, or one that drained lately, says it
        accepts (None: none says): a job past tier_max_tokens but within this waits out a redeploy, not refused as
        too big for the cluster."""
        limits = [w.hello.tier_max_tokens for w in self.workers.values() if w.draining] + self._drained_limits()
        said = [x[tier] for x in limits if x and tier in x]
        return max(said) if said else None
