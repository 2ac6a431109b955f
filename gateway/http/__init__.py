"""The OpenAI-compatible HTTP front door (``python -m gateway.http``): stateless, it talks to the
gateways through the async SDK, so any number of them can run beside the gateways."""
