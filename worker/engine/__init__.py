"""The continuous-batching engine and model loading. Knows nothing of Redis."""

from worker.engine.core import Engine, EngineConfig
from worker.engine.errors import EngineClosed, EngineError, EngineFailed, RequestRejected
from worker.engine.interface import DeltaStream, GenerationEngine
from worker.engine.loader import DEFAULT_MODEL, LoadOptions, load_model
from worker.engine.stream import RequestStream
from worker.engine.types import (
    EngineRequest,
    EngineStats,
    Finish,
    GenerationParams,
    OutputDelta,
    OutputFormat,
    Resume,
    ScoredPrompt,
    Step,
    TokenLogprob,
)

__all__ = [
    "DEFAULT_MODEL",
    "DeltaStream",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "EngineError",
    "EngineFailed",
    "EngineRequest",
    "EngineStats",
    "Finish",
    "GenerationEngine",
    "GenerationParams",
    "LoadOptions",
    "OutputDelta",
    "OutputFormat",
    "RequestRejected",
    "RequestStream",
    "Resume",
    "ScoredPrompt",
    "Step",
    "TokenLogprob",
    "load_model",
]
