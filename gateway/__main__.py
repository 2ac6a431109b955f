"""python -m gateway: run one gateway process.

Configuration: defaults, then --config FILE (TOML), then TS_GATEWAY_<KEY> environment
variables, then the command-line flags below. Every key is listed by --help.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from common import settings
from gateway.config import ENV_PREFIX, GatewayConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m gateway", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="configuration keys (TOML file or TS_GATEWAY_<KEY>):\n" + settings.describe(GatewayConfig))
    ap.add_argument("--config", help="TOML configuration file")
    ap.add_argument("--client-bind", help="override client_bind")
    ap.add_argument("--worker-bind", help="override worker_bind")
    ap.add_argument("--redis-url", help="override redis_url")
    ap.add_argument("--tenants-file", help="override tenants_file")
    ap.add_argument("--gateway-id", help="override gateway_id")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from common.tracing import setup_tracing

    try:
        setup_tracing("tiered-serve-gateway")
        config = settings.load(GatewayConfig, args.config, ENV_PREFIX, client_bind=args.client_bind,
                               worker_bind=args.worker_bind, redis_url=args.redis_url,
                               tenants_file=args.tenants_file, gateway_id=args.gateway_id)
        gw = build(config)
    except (settings.ConfigError, ValueError) as e:
        print(f"gateway: {e}", file=sys.stderr)
        return 2
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    gw.bind()
    logging.getLogger("gateway").info("gateway %s: clients on %s, workers on %s", config.gateway_id,
                                      config.client_bind, config.worker_bind)
    try:
        gw.serve(lambda: stop["now"])
    finally:
        gw.close()
    return 0


def build(config: GatewayConfig):
    import redis

    from common.redis_keys import KeySpace
    from gateway.redis_queue import RedisQueue
    from gateway.server import Gateway, tier_timeouts
    from gateway.tenants import TenantDirectory

    tenants = TenantDirectory.from_file(config.tenants_file)
    client = redis.Redis.from_url(config.redis_url)
    try:
        client.ping()
    except redis.RedisError as e:
        raise settings.ConfigError(f"cannot reach Redis at {config.redis_url}: {e}") from None
    tokenizer = None
    if config.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
    queue = RedisQueue(client, KeySpace(prefix=config.key_prefix), tier_timeouts_s=tier_timeouts(config),
                       idempotency_ttl_s=config.idempotency_ttl_s)
    return Gateway(config, queue, tenants, tokenizer)


if __name__ == "__main__":
    sys.exit(main())
