"""python -m gateway: run one gateway process.

Configuration: defaults, then --config FILE (TOML), then TS_GATEWAY_<KEY> environment
variables, then the command-line flags below. Every key is listed by --help.
"""

from __future__ import annotations

import logging
import sys

import zmq

from common import process, settings
from common.metrics import MetricsBindError
from common.tracing import setup_tracing
from gateway import metrics
from common.redis_server import redact_url, redis_client
from gateway.config import ENV_PREFIX, GatewayConfig
from gateway.security import check_config, secure_sockets
from gateway.torchless import keep_torch_out


def main(argv: list[str] | None = None) -> int:
    keep_torch_out()  # before anything imports transformers
    ap = process.parser("python -m gateway", __doc__, GatewayConfig, ENV_PREFIX)
    ap.add_argument("--client-bind", help="override client_bind")
    ap.add_argument("--worker-bind", help="override worker_bind")
    ap.add_argument("--redis-url", help="override redis_url")
    ap.add_argument("--tenants-file", help="override tenants_file")
    ap.add_argument("--gateway-id", help="override gateway_id")
    ap.add_argument("--insecure-workers", action="store_true", default=None,
                    help="accept workers without CURVE keys (the worker socket must then be on loopback)")
    args = ap.parse_args(argv)
    process.setup_logging(args.log_level)
    try:
        setup_tracing("tiered-serve-gateway")
        config = settings.load(GatewayConfig, args.config, ENV_PREFIX, client_bind=args.client_bind,
                               worker_bind=args.worker_bind, redis_url=args.redis_url,
                               tenants_file=args.tenants_file, gateway_id=args.gateway_id,
                               insecure_workers=args.insecure_workers)
        check_config(config)  # before anything is started
        gw = build(config)
        auth = secure_sockets(gw, config)
    except (settings.ConfigError, ValueError) as e:
        print(f"gateway: {redact_url(str(e))}", file=sys.stderr)
        return 2
    if auth is not None:
        gw.close = _also(gw.close, auth.stop)
    try:  # a port taken: say which, not a traceback
        gw.bind()
        metrics.serve(config.metrics_bind, gw)
    except zmq.ZMQError as e:  # its text names the endpoint
        gw.close()
        print(f"gateway: cannot bind a socket (client_bind, worker_bind): {e}", file=sys.stderr)
        return 2
    except MetricsBindError as e:
        gw.close()
        print(f"gateway: {e}", file=sys.stderr)
        return 2
    logging.getLogger("gateway").info("gateway %s: clients on %s, workers on %s", config.gateway_id,
                                      config.client_bind, config.worker_bind)
    return process.serve_until_signalled(gw.serve, gw.close)


def build(config: GatewayConfig):
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from common.redis_keys import KeySpace
    from gateway import tokenizer_pin
    from gateway.redis_queue import RedisQueue
    from gateway.redis_startup import until_redis_answers
    from gateway.server import Gateway, tier_timeouts
    from gateway.tenants import TenantDirectory

    tenants = TenantDirectory.from_file(config.tenants_file)
    # Bounded waits: while Redis is unreachable the gateway keeps answering ("unavailable") and retries. No
    # client-side retries: redis-py 6+ retries a timed-out command itself (with back-off: ~26 s against a frozen
    # Redis, not 2), standing the loop still that long, and the reply deadlines assume the socket timeout.
    client = redis_client(config.redis_url, config.redis_password_file, socket_timeout=2.0,
                          socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0))
    until_redis_answers(client.ping, config.redis_startup_wait_s,
                        f"cannot reach Redis at {redact_url(config.redis_url)}")
    tokenizer = None
    if config.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
    queue = RedisQueue(client, KeySpace(prefix=config.key_prefix), tier_timeouts_s=tier_timeouts(config),
                       idempotency_ttl_s=config.idempotency_ttl_s, result_ttl_s=config.result_ttl_s,
                       tenant_max_jobs=config.tenant_max_jobs, dead_letter_max=config.dead_letter_max)
    gw = Gateway(config, queue, tenants, tokenizer)
    policy = gw.hello_policy
    try:
        ours = policy.tokenizer_digest if tokenizer is not None else None
        policy.adopt(until_redis_answers(lambda: tokenizer_pin.claim(client, queue.keys, ours),
                                         config.redis_startup_wait_s, "cannot read the cluster's tokenizer from Redis"))
    except settings.ConfigError:
        gw.close()
        raise
    return gw


def _also(first, then):
    def both() -> None:
        try:
            first()
        finally:
            then()
    return both


if __name__ == "__main__":
    process.exit_now(main())
