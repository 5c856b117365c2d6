"""Engine errors, named by what the caller can do about them (as vLLM's `v1/engine/exceptions.py`). They know
nothing of the wire: `worker.adapter` maps each to an error code, in one table.

EngineError
├── RequestRejected  the request can never run here: fix it, do not retry
├── EngineFailed     the engine thread died under this request: retrying elsewhere may succeed
└── EngineClosed     the engine is shutting down: hand the request to another worker
"""

from __future__ import annotations


class EngineError(Exception):
    """Root of every error the engine raises or ends a stream with."""


class RequestRejected(EngineError, ValueError):
    """Rejected before it reached the model: empty prompt, ids outside the vocabulary, too long, bad params.
    `param` names the request field at fault by its wire name (`input_ids`, `params.top_k`...) when one is."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineFailed(EngineError):
    """The generation thread died while this request was in flight (or the library failed this request alone);
    the engine restarts itself. `implicated` says whether this request may have caused it: every request in a
    failed step is, unless a suspect (`EngineRequest.suspect`) was running, which then takes the blame alone."""

    def __init__(self, message: str, *, implicated: bool = True) -> None:
        super().__init__(message)
        self.implicated = implicated


class EngineClosed(EngineError):
    """Submitted to, or still running in, an engine that is closing."""
