"""HTTP front door configuration. Defaults here, overridden by a TOML file (--config) and then by
environment variables TS_HTTP_<KEY> (e.g. TS_HTTP_GATEWAYS='["tcp://gateway:5555"]')."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.settings import ConfigError, require

ENV_PREFIX = "TS_HTTP_"


@dataclass(frozen=True)
class HttpConfig:
    # Address the HTTP server listens on.
    host: str = "127.0.0.1"
    # Port of the OpenAI routes, /health and /metrics.
    port: int = 8000
    # Client endpoints of the gateways (ZeroMQ); the front door keeps no state of its own.
    gateways: list = field(default_factory=lambda: ["tcp://127.0.0.1:5555"])
    # The gateways' CURVE public key (z85, or the path of their gateway.key) when their client socket is
    # encrypted (client_curve, on in compose); "" connects in the clear.
    gateway_public_key: str = ""
    # The model's tokenizer (directory or hub name): chat templates, prompt token counts for `usage`.
    # It must be the tokenizer the workers' model uses (compose and up.py pass the model path to both).
    tokenizer: str = ""
    # The model id served under /v1/models and echoed in responses; "" uses the tokenizer's directory name.
    served_model_name: str = ""
    # An API key of any tenant: /health asks a gateway with it whether workers are registered.
    health_api_key: str = ""
    # Seconds without any frame from a gateway (an answer, a token or a keepalive: a gateway sends one every
    # keepalive_interval_s, 2 s, to a stream it serves) after which the door takes it for dead and goes on
    # through the next gateway (a stream from the next token index); 504 once none answers. It bounds
    # silence, not a job's wait: a queued job keeps its request open as long as its tier's queue timeout allows.
    # Keep it several times the gateways' keepalive_interval_s.
    upstream_timeout_s: float = 15.0
    # Largest max_tokens a request may leave unset and get: the default when the body gives none.
    default_max_tokens: int = 256
    # Largest request body accepted, in bytes.
    max_body_bytes: int = 4 * 2**20
    # Seconds a client has, once its headers are in, to send its whole body; then 408 (code request_timeout).
    # Unbounded, a client that sent its headers and then nothing held its request open for ever, and a door
    # stopping on SIGTERM (uvicorn waits for every request in progress) never exited.
    body_timeout_s: float = 60.0
    # Gateway clients kept, one per API key in use (gateway/http/upstream.py): past it, the least recently used
    # idle one is closed. Keys with a request in flight are kept whatever their number.
    max_clients: int = 1024
    # Seconds a stream may send nothing before the door sends an SSE comment (`: keep-alive`, which SSE clients
    # ignore): a stream queued behind other work has nothing to say until its first token, and a proxy's idle
    # timeout (nginx's proxy_read_timeout, an AWS ALB's: 60 s) cut it, which cancelled a job that would have run.
    # A stream's status line waits this long for its first token (so a job refused or expired sooner has its real
    # status), then goes out as 200. 0 sends none: the status line waits for the first token however long.
    sse_keepalive_s: float = 15.0

    def __post_init__(self) -> None:
        """Refuse, naming the key, a value the door could not serve with (a zero timeout failed every request
        as a 504; a zero body limit refused every body)."""
        require(self, positive=("upstream_timeout_s", "body_timeout_s"),
                at_least={"port": 0, "default_max_tokens": 1, "max_body_bytes": 1, "max_clients": 1},
                non_negative={"sse_keepalive_s": "no keep-alives"})
        if self.port > 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port!r}")
        if not (isinstance(self.gateways, list) and self.gateways and all(isinstance(g, str) and g
                                                                          for g in self.gateways)):
            raise ConfigError(f"gateways must be a non-empty list of endpoints, got {self.gateways!r}")
        if self.health_api_key != self.health_api_key.strip():
            # No tenant's key has it (gateway/tenants.py refuses one): /health told every caller "unknown key".
            raise ConfigError("health_api_key has white space at its start or end; remove it")
