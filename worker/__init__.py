"""The worker: a paged-KV continuous batcher over Hugging Face causal LMs.

Only ``worker.engine`` and ``worker.model_runner`` import torch; the scheduler,
block manager and request state are pure Python.
"""

from common.errors import DuplicateRequest, InvalidRequest
from worker.config import ConfigError, EngineConfig
from worker.request import FinishReason, RequestOutput, SamplingParams

__all__ = ["ConfigError", "DuplicateRequest", "Engine", "EngineConfig", "FinishReason", "InvalidRequest",
           "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # Lazy, so `import worker.scheduler` (simulator, unit tests) never pulls in torch.
    if name == "Engine":
        from worker.engine import Engine
        return Engine
    raise AttributeError(name)
