"""python -m gateway.http: run the OpenAI-compatible HTTP front door (uvicorn).

Configuration: defaults, then --config FILE (TOML), then TS_HTTP_<KEY> environment
variables, then the command-line flags below. Every key is listed by --help.
"""

from __future__ import annotations

import logging
import sys

from common import process, settings
from gateway.http.config import ENV_PREFIX, HttpConfig
from gateway.torchless import keep_torch_out


def main(argv: list[str] | None = None) -> int:
    keep_torch_out()  # before anything imports transformers
    ap = process.parser("python -m gateway.http", __doc__, HttpConfig, ENV_PREFIX)
    ap.add_argument("--host", help="override host")
    ap.add_argument("--port", type=int, help="override port")
    ap.add_argument("--gateway", action="append", help="gateway client endpoint (repeat for several)")
    ap.add_argument("--tokenizer", help="override tokenizer (the model directory or hub name)")
    ap.add_argument("--served-model-name", help="override served_model_name")
    args = ap.parse_args(argv)
    process.setup_logging(args.log_level)
    try:
        config = settings.load(HttpConfig, args.config, ENV_PREFIX, host=args.host, port=args.port,
                               gateways=args.gateway, tokenizer=args.tokenizer,
                               served_model_name=args.served_model_name)
        if not config.tokenizer:
            raise settings.ConfigError("no tokenizer: set --tokenizer, TS_HTTP_TOKENIZER or tokenizer in the "
                                       "config file (the model's directory or hub name)")
        app = build(config)
    except (settings.ConfigError, ValueError, OSError) as e:
        print(f"http: {e}", file=sys.stderr)
        return 2
    import uvicorn

    logging.getLogger("gateway.http").info("HTTP front door on http://%s:%d, gateways %s", config.host,
                                           config.port, config.gateways)
    # uvicorn handles SIGTERM/SIGINT itself: it stops accepting, finishes what runs, then exits.
    uvicorn.run(app, host=config.host, port=config.port, log_level=args.log_level.lower(), access_log=False)
    return 0


def build(config: HttpConfig):
    from gateway.http.app import create_app
    from gateway.http.prompts import Prompts, model_name

    return create_app(config, Prompts.load(config.tokenizer), model_name(config.tokenizer,
                                                                          config.served_model_name))


if __name__ == "__main__":
    sys.exit(main())
