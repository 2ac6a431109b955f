"""python -m worker: run one worker process (one device, one model) connected to every gateway.

Configuration: defaults, then --config FILE (TOML), then TS_WORKER_<KEY> environment
variables, then the command-line flags below. Every key is listed by --help.
"""

from __future__ import annotations

import json
import logging
import signal
import sys

from common import process, settings
from common.sockets import check_worker_keys, secure_worker_sockets
from common.tracing import setup_tracing
from worker.service_config import ENV_PREFIX, WorkerConfig


def main(argv: list[str] | None = None) -> int:
    ap = process.parser("python -m worker", __doc__, WorkerConfig, ENV_PREFIX)
    ap.add_argument("--worker-id")
    ap.add_argument("--gateway", action="append", help="gateway worker endpoint (repeat for several)")
    ap.add_argument("--model", help="model directory or hub name")
    ap.add_argument("--device")
    ap.add_argument("--max-num-seqs", type=int)
    ap.add_argument("--num-kv-blocks", type=int)
    args = ap.parse_args(argv)
    process.setup_logging(args.log_level)
    try:
        setup_tracing("tiered-serve-worker")
        config = settings.load(WorkerConfig, args.config, ENV_PREFIX, worker_id=args.worker_id,
                               gateways=args.gateway, model=args.model, device=args.device,
                               max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks)
        if not config.model:
            raise settings.ConfigError("no model: set --model, TS_WORKER_MODEL or model in the config file")
        check_worker_keys(config.curve_secret_key_file, config.gateway_public_key)
        service = build(config)
    except (settings.ConfigError, ValueError) as e:
        print(f"worker: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGUSR1, lambda *_: service.log_state())  # operators: `kill -USR1 <pid>`
    secure_worker_sockets(service.sockets, config.curve_secret_key_file, config.gateway_public_key)
    service.connect()
    logging.getLogger("worker").info("worker %s serving %s on %s, gateways %s", config.worker_id, config.model,
                                     config.device, json.dumps(config.gateways))
    return process.serve_until_signalled(service.serve, service.close)


def build(config: WorkerConfig):
    import torch

    if config.torch_threads > 0:
        torch.set_num_threads(config.torch_threads)
    from worker.config import EngineConfig
    from worker.engine import Engine
    from worker.service import WorkerService

    engine = Engine.from_pretrained(config.model, EngineConfig(
        device=config.device, dtype=config.dtype, max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens, num_kv_blocks=config.num_kv_blocks or None,
        kv_cache_memory_mb=config.kv_cache_memory_mb, swap_space_mb=config.swap_space_mb, policy=config.policy))
    return WorkerService(config, engine)


if __name__ == "__main__":
    sys.exit(main())
