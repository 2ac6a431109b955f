"""python -m worker: run one worker process (one device, one model) connected to every gateway.

Configuration: defaults, then --config FILE (TOML), then TS_WORKER_<KEY> environment
variables, then the command-line flags below (--<key>, with dashes). Every key is listed by
--help, the engine's own (EngineConfig: batch limits, KV pool, preemption, P0 isolation) included.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

from common import process, settings
from common.metrics import MetricsBindError
from common.sockets import check_worker_keys, secure_worker_sockets
from common.tracing import setup_tracing
from worker import metrics
from worker.drain import Drain
from worker.linger import Linger
from worker.service_config import ENV_PREFIX, WorkerConfig


def parser() -> argparse.ArgumentParser:
    ap = process.parser("python -m worker", __doc__, WorkerConfig, ENV_PREFIX)
    ap.add_argument("--gateway", action="append", help="gateway worker endpoint (repeat for several)")
    settings.add_arguments(ap, WorkerConfig, skip=("gateways",))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    process.setup_logging(args.log_level)
    try:
        setup_tracing("tiered-serve-worker")
        config = settings.load(WorkerConfig, args.config, ENV_PREFIX, gateways=args.gateway,
                               **settings.overrides(args, WorkerConfig))
        if not config.model:
            raise settings.ConfigError("no model: set --model, TS_WORKER_MODEL or model in the config file")
        check_worker_keys(config.curve_secret_key_file, config.gateway_public_key)
        Linger(config.dispatch_linger_s)  # bad values refused before the model loads
        Drain(config.drain_timeout_s)
        service = build(config)
    except (settings.ConfigError, ValueError) as e:
        print(f"worker: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGUSR1, lambda *_: service.log_state())  # operators: `kill -USR1 <pid>`
    secure_worker_sockets(service.sockets, config.curve_secret_key_file, config.gateway_public_key)
    # Everything that can fail at start-up fails before the hello: a gateway that heard from this worker
    # sends it jobs, and each one sent to a worker that then exits loses an attempt to a lease expiry.
    try:
        metrics.serve(config.metrics_bind, service.engine)
    except MetricsBindError as e:
        print(f"worker: {e}", file=sys.stderr)
        return 2
    service.connect()
    logging.getLogger("worker").info("worker %s serving %s on %s, gateways %s", config.worker_id, config.model,
                                     config.engine.device, json.dumps(config.gateways))
    return process.serve_until_signalled(service.serve, service.close, service.drain.request)


def build(config: WorkerConfig):
    import torch

    if config.torch_threads > 0:
        torch.set_num_threads(config.torch_threads)
    from common.model_digest import of_weights
    from common.tokenizer_digest import of_model
    from worker.engine import Engine
    from worker.service import WorkerService

    engine = Engine.from_pretrained(config.model, config.engine)
    return WorkerService(config, engine, tokenizer_digest=of_model(config.model),
                         weights_digest=of_weights(config.model))


if __name__ == "__main__":
    process.exit_now(main())
