"""What one scheduler step hands to the rest of the engine, and the scheduler's counters."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from worker.preemption import PreemptionDecision, PreemptMode
from worker.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # first position computed in this step (the request's num_computed_tokens)
    num_tokens: int  # positions [start, start + num_tokens) are computed this step
    sample: bool  # the chunk reaches the last known token, so a new token is sampled after it


@dataclass(frozen=True)
class BlockCopy:
    """Copy KV blocks between the device pool and the host pool, before the step's forward pass."""

    to_host: bool  # True: device -> host (swap out); False: host -> device (swap in)
    device_block_ids: tuple[int, ...]
    host_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # batch order; the model runner packs them in this order
    preempted: list[Request] = field(default_factory=list)  # running requests that gave way this step
    copies: list[BlockCopy] = field(default_factory=list)  # must run in order, before the forward pass
    decisions: list[PreemptionDecision] = field(default_factory=list)  # taken and declined, for tracing
    # Whose KV the copies move to the host: running victims and keep-suspended requests demoted to swap (these
    # are not in ``preempted``). If the copies fail, each must resume by recompute (worker/step_failure.py).
    swapped_out: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_attended_pairs(self) -> int:
        """Query-key pairs the step's attention computes: each token attends to itself and every token before it
        in its sequence, so a chunk of n tokens from position s adds n*s + n(n+1)/2 (a decode token: s + 1)."""
        return sum(c.num_tokens * c.start + c.num_tokens * (c.num_tokens + 1) // 2 for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.copies


@dataclass
class SchedulerStats:
    # (victim tier, mode) -> events; a keep-suspended request that later gives up its blocks counts again.
    preemptions: Counter = field(default_factory=Counter)
    wasted_tokens: int = 0  # computed KV discarded by recompute preemptions
    recomputed_tokens: int = 0  # tokens prefilled again after a recompute preemption, counted as computed
    bytes_swapped: int = 0  # both directions
    suspended_s: float = 0.0  # summed over resumed requests
    demotions: int = 0  # keep-suspended requests that later had to give up their blocks too
    declined: int = 0

    @property
    def num_recompute(self) -> int:
        return sum(n for (_, mode), n in self.preemptions.items() if mode is PreemptMode.RECOMPUTE)

    def by_mode(self) -> dict[str, int]:
        out = {m.value: 0 for m in PreemptMode}
        for (_, mode), n in self.preemptions.items():
            out[mode.value] += n
        return out

