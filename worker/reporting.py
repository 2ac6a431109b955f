"""What a worker tells its gateways of itself: the hello (what it is, whether it drains) and the load report (what it
holds and has room for), which extends the leases of the jobs it lists.

The step loop builds the report (engine state is read on its thread alone: worker/load_report.py) and publishes it
as a snapshot; the heartbeat thread (worker/heartbeat.py) sends the latest snapshot every interval, and the step loop
sends it at once when jobs came or went (``_beat_soon``): a gateway counts a slot busy, and a job held, until a
report says otherwise.
"""

from __future__ import annotations

from dataclasses import replace

import zmq

from common import protocol as P
from worker import load_report

HELLO_EVERY_S = 5.0  # re-announce, so a restarted gateway learns about this worker


class Reporting:
    """The worker service's reports (a mixin of worker.service.WorkerService): needs its ``config``, ``engine``,
    ``rates``, ``drain``, ``jobs``, ``unconfirmed``, ``tokenizer_digest``, ``sockets``, ``clock``, ``_lock`` and
    ``_send``, and sets
    ``_snapshot``, ``_sent``, ``_snapshot_at`` and ``_beat_pending`` (initialised in its ``__init__``)."""

    def _hello(self, sockets: list[zmq.Socket] | None = None) -> None:
        e = self.engine
        hello = P.WorkerHello(self.config.worker_id, self.config.model, e.vocab_size, e.max_model_len,
                              e.config.max_num_seqs, e.blocks.num_blocks, e.tier_limits(),
                              e.config.max_num_batched_tokens, resumes=True, draining=self.drain.active,
                              tokenizer_digest=self.tokenizer_digest, sampling_extras=True, stops_at=True,
                              weights_digest=self.weights_digest)
        for s in self.sockets if sockets is None else sockets:
            self._send(s, hello)
        # And the latest report at once: a gateway gives a worker it knows from a hello alone no credit (a hello
        # names its slots, not which are free), so one that restarted would otherwise wait for the next heartbeat.
        self._beat(sockets)

    def _publish(self) -> tuple[bool, P.WorkerLoad | None]:
        """Refresh the snapshot the heartbeat thread sends; send it now if jobs came or went. Returns whether it
        went now, and the report sent before it (a refresh in between may never have gone out)."""
        now = self.clock()
        if self._beat_pending or now - self._snapshot_at >= self.config.heartbeat_interval_s / 2:
            self._refresh_snapshot(now)
        if not self._beat_pending:
            return False, self._sent
        self._beat_pending = False
        with self._lock:
            before = self._sent
            self._beat()
        return True, before

    def _beat_soon(self) -> None:
        """Send a fresh load report after this loop iteration rather than at the next heartbeat."""
        self._beat_pending = True

    def _beat(self, sockets: list[zmq.Socket] | None = None) -> None:
        if self._snapshot is not None:
            report = replace(self._snapshot, age_s=max(0.0, self.clock() - self._snapshot_at))
            # A list, not any(generator): every gateway gets it.
            if any([self._send(s, report) for s in (self.sockets if sockets is None else sockets)]):
                self._sent = self._snapshot

    def _refresh_snapshot(self, now: float) -> None:
        """The load report the heartbeat thread sends until the next refresh (built here: engine state
        is only read on the step loop's thread)."""
        self._snapshot_at = now
        held = list(dict.fromkeys([*self.jobs, *self.unconfirmed.job_ids()]))
        self._snapshot = load_report.build(self.config.worker_id, self.engine, self.rates, held,
                                           offer=not self.drain.active)
