"""Which worker hellos a gateway takes: one model, one context, one tokenizer per cluster, and no reserved id."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from gateway.metrics import HANDOFF_WORKERS, OTHER_WORKERS

log = logging.getLogger("gateway.security")

MAX_WARNED = 1024  # worker ids warned about as unchecked (HelloPolicy)


@dataclass(frozen=True)
class Pinned:
    """The cluster's model (gateway/model_pin.py): the first taken worker's, with each digest scheme's first."""
    model: str
    vocab_size: int
    max_model_len: int
    weights_digests: dict[str, str] = field(default_factory=dict)


class HelloPolicy:
    """One model per cluster: the first acceptable hello pins model, vocab_size and max_model_len, and a
    later hello that differs is refused, so no worker can narrow (or widen) what admission accepts. The model is
    its weights' digest where the hellos say one of a scheme pinned (common/model_digest.py: workers of two versions
    name one model by two schemes), its path where not.

    And one tokenizer: a gateway with a tokenizer refuses a worker whose model's tokenizer differs from it
    (common/tokenizer_digest.py: its text jobs would run on ids the model never learnt, and come back as nonsense
    marked done); one without pins the first accepted worker's, as it pins the model. A worker that says no
    digest (its model has no tokenizer, or an older worker) cannot be checked: taken, with a warning.
    """

    MAX_WORKER_ID_CHARS = 200

    def __init__(self, tokenizer_digest: str | None = None) -> None:
        self.model: str | None = None
        self.vocab_size: int | None = None
        self.max_model_len: int | None = None
        self.weights_digests: dict[str, str] = {}  # the scheme ("sha256t") -> the cluster's digest of that scheme
        self.tokenizer_digest = tokenizer_digest
        self._own_tokenizer = tokenizer_digest is not None
        self._unchecked: set[str] = set()  # worker ids warned about once

    def refusal(self, msg) -> str | None:
        """Why this hello is refused, or None. Pins nothing: a hello may still be refused after this (its key), and
        a refused one must leave the cluster's model as it was (``pin`` it once it is accepted)."""
        if not 0 < len(msg.worker_id) <= self.MAX_WORKER_ID_CHARS:
            return "worker_id must be 1..200 characters"
        if msg.worker_id == OTHER_WORKERS:  # its hand-offs would be mixed, unseen, with the overflow series'
            return f"worker_id {OTHER_WORKERS!r} is the metrics' series for workers past the first {HANDOFF_WORKERS}"
        if min(msg.vocab_size, msg.max_model_len, msg.max_num_seqs) < 1 or msg.num_kv_blocks < 0:
            return "vocab_size, max_model_len and max_num_seqs must be >= 1, num_kv_blocks >= 0"
        pinned_digest = self.weights_digests.get(scheme(msg.weights_digest))
        weighed = msg.weights_digest is not None and pinned_digest is not None
        if weighed and msg.weights_digest != pinned_digest:
            return (f"the weights of model {msg.model!r} differ from this cluster's model {self.model!r} "
                    f"({msg.weights_digest[:20]} vs {pinned_digest[:20]})")
        pinned_fields = [("vocab_size", self.vocab_size), ("max_model_len", self.max_model_len)]
        if not weighed:  # digests of both, of one scheme: one model wherever each keeps it; else its path names it
            pinned_fields.insert(0, ("model", self.model))
        for name, pinned in pinned_fields:
            if pinned is not None and getattr(msg, name) != pinned:
                return f"{name} {getattr(msg, name)!r} differs from this cluster's {pinned!r}"
        theirs = msg.tokenizer_digest
        if theirs is not None and self.tokenizer_digest is not None and theirs != self.tokenizer_digest:
            whose = "this gateway's tokenizer" if self._own_tokenizer else "this cluster's model's"
            return (f"the tokenizer of model {msg.model!r} differs from {whose} ({theirs[:19]} vs "
                    f"{self.tokenizer_digest[:19]}): give the gateway's --tokenizer the worker's model directory")
        if theirs is None and self._own_tokenizer and msg.worker_id not in self._unchecked \
                and len(self._unchecked) < MAX_WARNED:  # a peer looping hellos under new ids must not grow it
            self._unchecked.add(msg.worker_id)
            log.warning("worker %s says no tokenizer digest (its model %r has no tokenizer, or it is older): this "
                        "gateway cannot check that its tokenizer matches that model", msg.worker_id, msg.model)
        return None

    def adopt(self, cluster_digest: str | None) -> None:
        """Take the cluster's tokenizer (gateway/tokenizer_pin.py) as the one workers must have, where this gateway
        has none of its own."""
        if not self._own_tokenizer and cluster_digest is not None:
            self.tokenizer_digest = cluster_digest

    def follow(self, pinned: Pinned | None) -> None:
        """The cluster's pin (gateway/model_pin.py) is this gateway's too; None: none is (no worker of the last one
        kept it alive), and the next taken worker's model is the cluster's."""
        if pinned is None:
            self.model = self.vocab_size = self.max_model_len = None
            self.weights_digests = {}
        else:
            self.model, self.vocab_size, self.max_model_len = pinned.model, pinned.vocab_size, pinned.max_model_len
            self.weights_digests = dict(pinned.weights_digests)

    def pin(self, msg) -> None:
        """An accepted hello's model, vocab_size, max_model_len and tokenizer are this cluster's (the first one's
        stay; the gateway's own tokenizer, where it has one)."""
        if self.model is None:
            self.model, self.vocab_size, self.max_model_len = msg.model, msg.vocab_size, msg.max_model_len
        if msg.weights_digest is not None:
            self.weights_digests.setdefault(scheme(msg.weights_digest), msg.weights_digest)
        if self.tokenizer_digest is None:
            self.tokenizer_digest = msg.tokenizer_digest


def scheme(digest: str | None) -> str | None:
    """A weights digest's scheme, the part before its colon (common/model_digest.py)."""
    return None if digest is None else digest.split(":", 1)[0]
