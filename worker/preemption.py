"""Who may preempt whom, which victim gives way, and how (keep / swap / recompute).

Pure Python. The scheduler asks this module two questions at a step
boundary: "which running requests may give way to this waiting one, in what
order?" and "what is the cheapest way for this victim to give way?". The
answers, with the cost model's inputs, become ``PreemptionDecision`` records
that the engine turns into trace spans.

Invariants this policy keeps: a tier that no other tier may preempt is never
chosen as a victim; a resumed request is not chosen again until it has run
``min_residency_steps`` tokens (after its re-prefill); victims come lowest tier first, then
least work lost, counting the work already lost to earlier preemptions.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.tiers import Tier
from worker.request import Request, RequestStatus


class PreemptMode(str, enum.Enum):
    KEEP = "keep"  # give up the batch slot only; KV stays resident
    SWAP = "swap"  # KV blocks copied to the host pool, copied back on resume
    RECOMPUTE = "recompute"  # KV blocks freed; prompt + output re-prefilled on resume


class Trigger(str, enum.Enum):
    SLOT = "slot"  # a higher tier needs a batch slot
    KV_MEMORY = "kv_memory"  # a higher tier (or a running request's growth) needs KV blocks
    RESERVE = "reserve"  # blocks exist but the P0 reserve or the low-tier cap holds them back
    BUDGET = "token_budget"  # without chunked prefill, a higher tier's whole prompt needs the step's tokens
    MANUAL = "manual"  # engine.suspend() by an operator or a test


class DeclineReason(str, enum.Enum):
    NO_LOWER_TIER = "no_lower_tier_running"  # nothing running that this tier may preempt
    RESIDENCY = "victims_within_residency"  # candidates exist but were resumed too recently
    PROGRESS = "victims_near_completion"  # candidates exist but the progress guard protects them
    INSUFFICIENT = "preemptible_capacity_insufficient"  # all eligible victims would still not make room


def _default_matrix() -> dict[Tier, frozenset[Tier]]:
    return {Tier.P0: frozenset({Tier.P2, Tier.P3}), Tier.P1: frozenset({Tier.P3}),
            Tier.P2: frozenset(), Tier.P3: frozenset()}


@dataclass(frozen=True)
class PreemptionConfig:
    # Which tiers each tier may preempt. Tiers that appear in no set are never preempted.
    matrix: dict[Tier, frozenset[Tier]] = field(default_factory=_default_matrix)
    # A resumed request generates at least this many tokens (after any re-prefill) before another
    # request may preempt it again.
    min_residency_steps: int = 8
    # Leave alone a victim with at most this many tokens left to generate.
    guard_remaining_tokens: int = 4
    # Leave alone a victim that has generated more than this many tokens (None: no limit).
    guard_max_generated: int | None = None
    # KV blocks that only P0 may allocate (priority-inversion guard).
    p0_reserve_blocks: int = 0
    # Most of the pool that P2 and P3 together may hold, as a fraction.
    low_tier_kv_share: float = 1.0
    # Host pool for swapped-out blocks (0 disables swap).
    swap_space_blocks: int = 0
    # Cost model inputs: host<->device copy bandwidth and re-prefill speed.
    swap_bytes_per_s: float = 4e9
    recompute_tokens_per_s: float = 2000.0
    # Bytes of one KV block across all layers (set by the engine from the model).
    bytes_per_block: int = 0

    def validate(self) -> None:
        from worker.config import ConfigError, check_preemption_matrix

        check_preemption_matrix(self.matrix)
        if self.min_residency_steps < 0 or self.guard_remaining_tokens < 0 or self.p0_reserve_blocks < 0:
            raise ConfigError("min_residency_steps, guard_remaining_tokens and p0_reserve_blocks must be >= 0")
        if not 0.0 < self.low_tier_kv_share <= 1.0:
            raise ConfigError(f"low_tier_kv_share must be in (0, 1], got {self.low_tier_kv_share}")
        if self.swap_space_blocks < 0 or self.swap_bytes_per_s <= 0 or self.recompute_tokens_per_s <= 0:
            raise ConfigError("swap_space_blocks must be >= 0; swap_bytes_per_s and recompute_tokens_per_s > 0")

    def preemptible(self, tier: Tier) -> bool:
        return any(tier in targets for targets in self.matrix.values())

    def may_preempt(self, attacker: Tier, victim: Tier) -> bool:
        return victim in self.matrix.get(attacker, frozenset())

    def tier_block_limit(self, tier: Tier, num_blocks: int) -> int:
        """Most KV blocks one request of ``tier`` can ever hold: the pool, less the P0 reserve for
        every other tier, and within the low-tier share for P2 and P3."""
        limit = num_blocks if tier is Tier.P0 else num_blocks - self.p0_reserve_blocks
        if tier in (Tier.P2, Tier.P3):
            limit = min(limit, int(self.low_tier_kv_share * num_blocks))
        return max(0, limit)


@dataclass(frozen=True)
class ModeChoice:
    mode: PreemptMode
    estimated_cost_s: float  # of the chosen mode
    # Inputs and alternatives, recorded on the decision span so the choice can be audited.
    inputs: dict[str, float]


class PreemptionPolicy:
    def __init__(self, config: PreemptionConfig) -> None:
        config.validate()
        self.config = config

    def guard(self, victim: Request, step: int) -> DeclineReason | None:
        """Why ``victim`` must be left alone now, or None if it may give way."""
        c = self.config
        if self.residency_left(victim) > 0:
            return DeclineReason.RESIDENCY
        remaining = victim.params.max_tokens - len(victim.output_token_ids)
        if victim.num_computed_tokens >= victim.num_prompt_tokens and remaining <= c.guard_remaining_tokens:
            return DeclineReason.PROGRESS
        if c.guard_max_generated is not None and len(victim.output_token_ids) > c.guard_max_generated:
            return DeclineReason.PROGRESS
        return None

    def protected_tokens(self, req: Request) -> int:
        """Tokens ``req`` will still generate (after any prompt it has left to prefill) before ``guard`` lets
        another request preempt it: a suspended one gets a fresh residency when it resumes, a resumed one has
        the rest of its own, and one the progress guard protects is protected to its end. What the gateway's
        wait estimate adds to a slot that only preemption frees (WorkerLoad.work)."""
        c = self.config
        generated = len(req.output_token_ids)
        remaining = max(0, req.params.max_tokens - generated)
        if c.guard_max_generated is not None and generated > c.guard_max_generated:
            return remaining
        residency = self.residency_tokens(req) if req.status is RequestStatus.SUSPENDED else self.residency_left(req)
        return remaining if remaining - residency <= c.guard_remaining_tokens else residency

    def residency_left(self, req: Request) -> int:
        """Tokens a resumed ``req`` must still generate before its residency ends (0: never resumed, or past it)."""
        if req.last_resume_step is None:
            return 0
        return max(0, self.residency_tokens(req) - (len(req.output_token_ids) - req.resume_output_tokens))

    def residency_tokens(self, req: Request) -> int:
        """Tokens ``req`` generates after resuming before another request may preempt it again.

        ``min_residency_steps`` for each time it was recomputed (once if never): work already thrown away
        on it counts against throwing more away, so a long victim under a stream of urgent requests gives
        way a few times, not once per ``min_residency_steps`` tokens."""
        return self.config.min_residency_steps * max(1, req.num_recomputes)

    def candidates(self, beneficiary: Request, running: list[Request], step: int
                   ) -> tuple[list[Request], DeclineReason | None]:
        """Running requests that may give way to ``beneficiary``, best victim first.

        When there are none, also says why (the first guard that stopped a lower-tier request).
        """
        eligible: list[Request] = []
        reason: DeclineReason | None = None
        for r in running:
            if not self.config.may_preempt(beneficiary.tier, r.tier):
                continue
            why = self.guard(r, step)
            if why is None:
                eligible.append(r)
            elif reason is None:
                reason = why
        # Lowest tier first, then least work lost or moved: tokens computed, plus the tokens earlier
        # recompute preemptions already threw away (a victim chosen again loses them again, in effect).
        eligible.sort(key=lambda r: (-r.tier.rank, r.num_computed_tokens + r.recomputed_total, -r.arrival_seq))
        return eligible, (None if eligible else reason or DeclineReason.NO_LOWER_TIER)

    def choose_mode(self, victim: Request, blocks_needed: bool, num_victim_blocks: int,
                    host_free_blocks: int) -> ModeChoice:
        """Cheapest way for ``victim`` to give way. Keep when only its slot is needed."""
        c = self.config
        swap_bytes = 2 * num_victim_blocks * c.bytes_per_block  # out now, back on resume
        swap_cost = swap_bytes / c.swap_bytes_per_s
        recompute_cost = victim.num_computed_tokens / c.recompute_tokens_per_s
        can_swap = 0 < num_victim_blocks <= host_free_blocks
        inputs = {"swap_bytes": float(swap_bytes), "swap_cost_s": swap_cost,
                  "recompute_tokens": float(victim.num_computed_tokens), "recompute_cost_s": recompute_cost,
                  "host_free_blocks": float(host_free_blocks), "victim_blocks": float(num_victim_blocks)}
        if not blocks_needed:
            return ModeChoice(PreemptMode.KEEP, 0.0, inputs)
        if can_swap and swap_cost < recompute_cost:
            return ModeChoice(PreemptMode.SWAP, swap_cost, inputs)
        return ModeChoice(PreemptMode.RECOMPUTE, recompute_cost, inputs)


@dataclass(frozen=True)
class PreemptionDecision:
    """One preemption decision, taken or declined; becomes one trace span."""

    decision_id: str
    step: int
    time: float  # time.monotonic() when decided
    trigger: Trigger
    beneficiary_id: str
    beneficiary_tier: Tier
    beneficiary_tenant: str | None
    mode: PreemptMode | None  # None when declined
    declined_reason: DeclineReason | None = None
    victim_id: str | None = None
    victim_tier: Tier | None = None
    victim_tenant: str | None = None
    victim_progress: float = 0.0  # generated / max_tokens of the victim
    blocks_freed: int = 0
    bytes_moved: int = 0
    estimated_cost_s: float = 0.0
    cost_inputs: dict[str, float] = field(default_factory=dict)
    kv_utilisation: float = 0.0
    running_per_tier: dict[str, int] = field(default_factory=dict)
    waiting_per_tier: dict[str, int] = field(default_factory=dict)

    @property
    def declined(self) -> bool:
        return self.mode is None
