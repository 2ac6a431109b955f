"""The gateway: admission, per-tier Redis queues and dispatch to workers (to be built; see the issues)."""
