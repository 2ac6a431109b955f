"""Engine configuration: every knob in one typed place, with its default and why."""

from __future__ import annotations

from dataclasses import dataclass

_DTYPES = ("auto", "float32", "float16", "bfloat16")
# Preemption cost model on CPU (measured on the 2-core dev machine); CUDA measures its own at start-up.
CPU_SWAP_BYTES_PER_S = 4e9
CPU_RECOMPUTE_TOKENS_PER_S = 2000.0


class ConfigError(ValueError):
    """A configuration value is out of range; raised before anything is loaded."""


def check_p0_reserve_slots(reserve: int, max_num_seqs: int) -> None:
    if not 0 <= reserve < max_num_seqs:
        raise ConfigError(f"p0_reserve_slots must be in [0, max_num_seqs) so the other tiers keep a slot; "
                          f"got {reserve} with max_num_seqs {max_num_seqs}")


def check_preemption_matrix(matrix) -> None:
    """A tier preempts only lower tiers: a lower one preempting a higher inverts the tiers, and a tier preempting
    itself lets two of its requests take each other's slot in turn. ``matrix``: Tier -> set of Tiers."""
    for attacker, victims in matrix.items():
        for victim in sorted(victims, key=lambda t: t.rank):
            if victim.rank <= attacker.rank:
                raise ConfigError(f"preemption_matrix: {attacker.value} may not preempt {victim.value}: a tier "
                                  f"preempts only lower tiers (P0 is the highest)")


@dataclass(frozen=True)
class SchedulerConfig:
    # Most sequences in one forward step (the batch "slots").
    max_num_seqs: int = 64
    # Most tokens (prefill + decode) in one forward step; bounds step latency.
    max_num_batched_tokens: int = 1024
    # Split long prompts across steps so running decodes keep flowing.
    enable_chunked_prefill: bool = True
    # Longest prompt + output a request may reach (the model's context unless set lower).
    max_model_len: int = 2048
    # Token ids that end a request unless it asked for ignore_eos.
    eos_token_ids: tuple[int, ...] = ()
    # A new P0 request's first prefill chunk runs in a step with running P0s only (lower tiers wait that
    # step), as SGLang runs prefill batches: where a step's time grows with its tokens (CPUs, big
    # batches) the urgent request's first token comes sooner. Never two such steps in a row.
    isolate_p0_prefill: bool = False
    # Batch slots only P0 may use: P1..P3 together hold at most max_num_seqs - p0_reserve_slots, so a new
    # P0 finds a free slot while fewer P0s than this run, even when the rest is work it may not preempt.
    p0_reserve_slots: int = 0

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_p0_reserve_slots(self.p0_reserve_slots, self.max_num_seqs)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # A request recomputed after preemption re-prefills prompt + output in one step: without
            # chunking that step can need up to max_model_len tokens, or the request would wait forever.
            raise ConfigError(f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                              f"must be >= max_model_len ({self.max_model_len})")


@dataclass(frozen=True)
class EngineConfig:
    # Tokens per KV block. Smaller wastes less memory at the tail, larger gathers faster.
    block_size: int = 16
    # Blocks in the pool; None (or 0) derives it from kv_cache_memory_mb.
    num_kv_blocks: int | None = None
    # KV pool size (all layers, K and V) when num_kv_blocks is None. None: 512 on CPU; on CUDA
    # whatever gpu_memory_utilization leaves after the weights and a profiled forward's activations.
    kv_cache_memory_mb: int | None = None
    # Fraction of the GPU's total memory this worker may use (weights + activations + KV pool), as vLLM's.
    gpu_memory_utilization: float = 0.9
    # Most sequences in one forward step (the batch "slots").
    max_num_seqs: int = 64
    # Most tokens (prefill + decode) in one forward step; bounds step latency.
    max_num_batched_tokens: int = 1024
    # Split long prompts across steps so running decodes keep flowing.
    enable_chunked_prefill: bool = True
    # None: the model's max_position_embeddings. Lower it to save KV memory per request.
    max_model_len: int | None = None
    # "cpu", "cuda" or "cuda:N".
    device: str = "cpu"
    # Weights and KV dtype: float32, float16, bfloat16, or auto (bfloat16 on CUDA, float32 on CPU).
    dtype: str = "auto"
    # Run a new P0 request's first prefill chunk without the lower tiers' work (see SchedulerConfig);
    # measured on the seed benchmark (BENCHMARKS.md), it brings P0 p99 time to first token under load closer to idle.
    isolate_p0_prefill: bool = True
    # "priority": tier order with preemption at step boundaries; "fifo": admission order, no preemption.
    policy: str = "priority"
    # Which tiers each tier may preempt, e.g. {"P0": ["P2", "P3"]}; None: the design's default matrix.
    preemption_matrix: dict[str, list[str]] | None = None
    # A resumed request generates at least this many tokens (after any re-prefill) before it may be preempted again.
    min_residency_steps: int = 8
    # Leave alone a victim with at most this many tokens left to generate.
    guard_remaining_tokens: int = 4
    # Leave alone a victim that has generated more than this many tokens (None: no limit).
    guard_max_generated: int | None = None
    # KV blocks only P0 may use, so a P0 request never waits for P2/P3 work to drain.
    p0_reserve_blocks: int = 0
    # Batch slots only P0 may use, so a P0 request does not wait for a slot behind P1 work, which it may
    # not preempt (the default matrix), while fewer P0s than this run.
    p0_reserve_slots: int = 0
    # Most of the KV pool P2 and P3 together may hold (fraction in (0, 1]).
    low_tier_kv_share: float = 1.0
    # Host memory for swapped-out KV blocks; 0 disables swap (preemption then keeps or recomputes).
    swap_space_mb: int = 256
    # Cost model: host<->device bandwidth (bytes/s) and re-prefill speed (tokens/s) used to choose
    # between swap and recompute for each preemption. None: measured at start-up on CUDA (a short
    # calibration), the CPU constants above on CPU.
    swap_bytes_per_s: float | None = None
    recompute_tokens_per_s: float | None = None

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"

    def served_context(self, max_position_embeddings: int) -> int:
        """The longest sequence served: max_model_len, never past the model's positions."""
        return min(self.max_model_len or max_position_embeddings, max_position_embeddings)

    def preemption_config(self, bytes_per_block: int):
        """The scheduler's PreemptionConfig for a model whose KV block takes ``bytes_per_block``."""
        from worker.preemption import PreemptionConfig

        fields = dict(min_residency_steps=self.min_residency_steps, guard_remaining_tokens=self.guard_remaining_tokens,
                      guard_max_generated=self.guard_max_generated, p0_reserve_blocks=self.p0_reserve_blocks,
                      low_tier_kv_share=self.low_tier_kv_share,
                      swap_space_blocks=self.swap_space_mb * 2**20 // max(1, bytes_per_block),
                      swap_bytes_per_s=self.swap_bytes_per_s or CPU_SWAP_BYTES_PER_S,
                      recompute_tokens_per_s=self.recompute_tokens_per_s or CPU_RECOMPUTE_TOKENS_PER_S,
                      bytes_per_block=bytes_per_block)
        if self.preemption_matrix is not None:
            fields["matrix"] = self._parsed_matrix()
        config = PreemptionConfig(**fields)
        config.validate()
        return config

    def _parsed_matrix(self):
        from common.tiers import parse_tier

        try:
            matrix = {parse_tier(k): frozenset(parse_tier(v) for v in vs) for k, vs in self.preemption_matrix.items()}
        except ValueError as e:
            raise ConfigError(f"preemption_matrix: {e}") from None
        check_preemption_matrix(matrix)
        return matrix

    def validate(self) -> None:
        if self.preemption_matrix is not None:
            self._parsed_matrix()  # before a model is loaded
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 0:
            raise ConfigError(f"num_kv_blocks must be >= 1 (or 0/None: from kv_cache_memory_mb), "
                              f"got {self.num_kv_blocks}")
        if self.kv_cache_memory_mb is not None and self.kv_cache_memory_mb < 1:
            raise ConfigError(f"kv_cache_memory_mb must be >= 1, got {self.kv_cache_memory_mb}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("swap_bytes_per_s", "recompute_tokens_per_s"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 (or unset), got {getattr(self, name)}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_seqs and max_num_batched_tokens must be >= 1")
        check_p0_reserve_slots(self.p0_reserve_slots, self.max_num_seqs)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.policy not in ("priority", "fifo"):
            raise ConfigError(f"policy must be 'priority' or 'fifo', got {self.policy!r}")
        if self.swap_space_mb < 0:
            raise ConfigError(f"swap_space_mb must be >= 0, got {self.swap_space_mb}")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
