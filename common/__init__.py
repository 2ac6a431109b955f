"""Code shared by the gateway and the worker: tiers, errors, configuration."""
