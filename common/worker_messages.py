"""The messages between a gateway and its workers (their codec: common/protocol.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

# The ErrorReply code of a gateway that does not know the worker a frame came from (it restarted, or the worker
# timed out there): the worker says hello on that socket at once, rather than at its next periodic hello.
HELLO_FIRST = "hello_first"


@dataclass(frozen=True)
class WorkerHello:
    worker_id: str
    model: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    num_kv_blocks: int
    # Largest prompt + max_tokens per tier ("P0".."P3") this worker accepts (its tier's share of the KV
    # cache); None from workers that do not say.
    tier_max_tokens: dict[str, int] | None = None
    # Most tokens one engine step runs (max_num_batched_tokens): a longer prompt is prefilled in chunks of it, so
    # a job sent during a long prefill waits a chunk, not the prompt (wait estimates); None from older workers.
    max_num_batched_tokens: int | None = None
    # Takes DispatchJob.resume_token_ids (False from older workers: they are never sent any).
    resumes: bool = False
    # Told to stop (worker/drain.py): it takes no new job. Also in its reports (WorkerLoad.draining); said here
    # for a gateway that hears this hello before any report (one that restarted during the drain).
    draining: bool = False
    # common/tokenizer_digest of the tokenizer saved with the model: a gateway whose own tokenizer differs refuses
    # this worker (its text jobs would run on tokens the model never learnt). None: the model has none, or an older
    # worker.
    tokenizer_digest: str | None = None
    # Takes DispatchJob's stop_token_ids, min_tokens and penalties (False from older workers: while one is
    # registered, a job asking for them is refused at admission).
    sampling_extras: bool = False
    # Takes CancelJob.stop_at (False from older workers: they are sent a plain cancel instead).
    stops_at: bool = False
    # common/model_digest of the model directory's weights: where both this and the cluster's are known, the
    # gateway compares them rather than the model's path (a worker keeping the model elsewhere is taken; one whose
    # path holds other weights is refused). None: not a directory it could read, or an older worker.
    weights_digest: str | None = None


@dataclass(frozen=True)
class GatewayWelcome:
    """Reply to WorkerHello: tells the worker which gateway is on the other end of this socket."""

    gateway_id: str


@dataclass(frozen=True)
class WorkerLoad:
    """Heartbeat: extends the leases of ``job_ids`` and reports capacity."""

    worker_id: str
    free_slots: int
    free_kv_blocks: int
    running: dict[str, int]  # per tier
    waiting: dict[str, int]  # per tier
    job_ids: list[str]  # jobs this worker holds (running, waiting or suspended)
    # Cheapest preemption here for a P0/P1 job, in estimated seconds (0: a slot is free or keep will do).
    preemption_cost_s: float
    # Per tier: running jobs a new job of that tier may preempt here (the worker's preemption matrix).
    victims: dict[str, int] = field(default_factory=dict)
    # Measured tokens/s per sequence (worker/calibration.py); 0: not reported (an older worker).
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    # job id -> [tier rank, status 0 running / 1 suspended / 2 waiting, tokens left to prefill, generated,
    # max_tokens, bit mask of tiers that may preempt it, tokens it still generates before its preemption guards
    # let it be preempted (absent from older workers: none), tokens in its KV cache (absent from older workers:
    # none)]: the work ahead of new jobs, for wait estimates.
    work: dict[str, list[int]] = field(default_factory=dict)
    # Seconds from building this report to sending it (the heartbeat thread sends the latest one, up to a
    # heartbeat old): with the time since it came, how far the running work has got past what ``work`` says.
    age_s: float = 0.0
    # An engine step's cost here (worker/step_cost.py): seconds = step_base_s + step_token_s x tokens batched
    # + step_pair_s x query-key pairs attended; all 0: not reported (an older worker, or nothing measured).
    step_base_s: float = 0.0
    step_token_s: float = 0.0
    step_pair_s: float = 0.0
    # Told to stop (worker/drain.py): no job is sent here, and its slots are no capacity for queued work in wait
    # estimates (it hands back what it has not started); False from older workers.
    draining: bool = False
    # The worker's clock (monotonic, its own base) as it sent this frame: from the reports' latest, the gateway
    # learns that clock's offset from its own, to place a frame's send without the time it sat unread in the
    # gateway's socket (gateway/waits.py, WorkerClocks). None from older workers.
    sent_at_s: float | None = None


@dataclass(frozen=True)
class DispatchJob:
    job_id: str
    attempt: int
    tier: str  # the tier the job was admitted at: what it preempts by (aging changes queue order only)
    tenant: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int | None
    seed: int  # fixed at admission, so a re-dispatch reproduces the same tokens
    reply_to: str  # gateway that dispatched this attempt: it receives the tokens and writes them to Redis
    trace_context: dict[str, str] = field(default_factory=dict)
    ignore_eos: bool = False
    # A re-dispatched job's output so far (what its earlier attempts streamed, from the job's token log): the
    # worker prefills it with the prompt and goes on from there, rather than decoding it all again. Sampling is
    # seeded by (seed, token index), so the rest is what a run from the start would draw. Sent only to workers
    # whose hello says ``resumes``.
    resume_token_ids: list[int] = field(default_factory=list)
    # As SubmitRequest's. A worker whose hello does not say ``sampling_extras`` drops such a frame as malformed.
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # As CancelJob.stop_at, for a job stopped before this attempt (kept in its hash: stop_at.lua), so that a
    # re-dispatch ends where its caller's answer did. Sent only to workers whose hello says ``stops_at``.
    stop_at: int | None = None


@dataclass(frozen=True)
class CancelJob:
    job_id: str
    # Cancel only this attempt or an earlier one (None: whatever runs): a late CancelJob for a
    # requeued lease must not stop the job's next attempt on the same worker.
    attempt: int | None = None
    # End the job done (finish_reason "stop") with its first ``stop_at`` tokens, once it has that many, rather
    # than drop it (CancelRequest.stop_at). Sent only to workers whose hello says ``stops_at``.
    stop_at: int | None = None


@dataclass(frozen=True)
class JobTokens:
    job_id: str
    attempt: int
    index: int  # index of token_ids[0] in the job's output
    token_ids: list[int]
    # On the first frame: seconds from the dispatch's arrival to the job's first prefill chunk (its wait there).
    prefill_start_s: float | None = None
    # On the first frame: seconds from the job's first prefill chunk starting to this frame being sent, on the
    # worker's clock. The gateway puts the start at this long before the frame reached it: that counts the time
    # the dispatch sat unread while a step ran, which prefill_start_s (from when the worker read it) cannot.
    prefill_start_age_s: float | None = None
    sent_at_s: float | None = None  # as in WorkerLoad: the age counts from this send, not from the frame's reading


@dataclass(frozen=True)
class JobFinished:
    job_id: str
    attempt: int
    state: str  # done | failed
    finish_reason: str | None
    num_tokens: int
    ttft_s: float | None
    run_s: float
    preemptions: int
    reason: str | None = None
    # Every output token, in order (len == num_tokens): the result stays whole even when a JobTokens
    # frame was dropped or went to a gateway that has since restarted.
    token_ids: list[int] | None = None
    prefill_start_s: float | None = None  # as in JobTokens: the end of the job's wait, on this worker's clock
    prefill_start_age_s: float | None = None  # as in JobTokens
    sent_at_s: float | None = None  # as in JobTokens


@dataclass(frozen=True)
class JobFinishedAck:
    """Reply to JobFinished, and to JobReleased: the gateway is done with it (stored or requeued, or not needed: the
    lease had moved on), so the worker may stop sending it again (worker/completions.py)."""

    job_id: str
    attempt: int


@dataclass(frozen=True)
class JobReleased:
    """A worker hands back a job it will not finish (it is shutting down: worker/drain.py). The gateway requeues it
    now, not when its lease runs out, and the release does not count against the job's max_attempts (a lost lease
    does). Fenced like a completion: it counts only from the worker holding that attempt's lease."""

    job_id: str
    attempt: int
    reason: str = "draining"
