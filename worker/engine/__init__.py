"""The continuous-batching engine and model loading. Knows nothing of Redis."""

from worker.engine.core import Engine, EngineConfig
from worker.engine.errors import EngineClosed, EngineError, EngineFailed, InvalidRequest
from worker.engine.loader import DEFAULT_MODEL, LoadOptions, load_model
from worker.engine.stream import RequestStream
from worker.engine.types import Delta, EngineRequest, EngineStats, FinishReason, Resume, SamplingParams

__all__ = [
    "DEFAULT_MODEL",
    "Delta",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "EngineError",
    "EngineFailed",
    "EngineRequest",
    "EngineStats",
    "FinishReason",
    "InvalidRequest",
    "LoadOptions",
    "RequestStream",
    "Resume",
    "SamplingParams",
    "load_model",
]
