"""llmq client: submit generation requests to a Redis-fed worker pool and stream the results.

    from client import Client

    with Client("redis://localhost:6379/0", queue="default") as llm:
        job = llm.submit("Tell me a joke", max_new_tokens=64, temperature=0.7)
        for delta in job.stream(timeout=60):
            print(delta.text, end="", flush=True)

`AsyncClient` has the same surface (`await client.submit(...)`, `async for delta in job.stream()`).
This package never imports torch or transformers; `client.protocol` is the wire format both sides speak.
"""

__version__ = "0.3.0"  # the distribution's one version (pyproject reads it); `llmq --version` prints it

from client import protocol, store
from client._core import Delta, Outcome, Result, TokenLogprob
from client.aio import AsyncChoices, AsyncClient, AsyncJob
from client.errors import (
    Cancelled,
    ClientClosed,
    InvalidRequest,
    LimitExceeded,
    LLMQError,
    MalformedEntry,
    ProtocolError,
    QueueFull,
    RedisUnavailable,
    RequestExpired,
    RequestFailed,
    ResultTimeout,
    TenantQuotaExceeded,
    UnsupportedVersion,
)
from client.protocol import ErrorCode, error_from_event
from client.store import QueueStatus
from client.sync import Choices, Client, Job

__all__ = [
    "AsyncChoices",
    "AsyncClient",
    "AsyncJob",
    "Cancelled",
    "Choices",
    "Client",
    "ClientClosed",
    "Delta",
    "ErrorCode",
    "InvalidRequest",
    "Job",
    "LLMQError",
    "LimitExceeded",
    "MalformedEntry",
    "Outcome",
    "ProtocolError",
    "QueueFull",
    "QueueStatus",
    "RedisUnavailable",
    "RequestExpired",
    "RequestFailed",
    "Result",
    "ResultTimeout",
    "TenantQuotaExceeded",
    "TokenLogprob",
    "UnsupportedVersion",
    "__version__",
    "error_from_event",
    "protocol",
    "store",
]
