"""The twins cannot drift: `AsyncClient`/`Client` and `AsyncJob`/`Job` expose the same public methods with the
same parameters (names, kinds, defaults and annotations), apart from the documented async/sync pairs; and
`submit`'s sampling parameters are exactly the wire model's fields, defaulting to it."""

from __future__ import annotations

import inspect

import pytest

from client import AsyncChoices, AsyncClient, AsyncJob, Choices, Client, Job
from client.protocol import SamplingParams

# Methods whose names differ by nature: the context-manager and close protocols.
RENAMED = {"aclose": "close", "__aenter__": "__enter__", "__aexit__": "__exit__"}


def public_methods(cls: type) -> dict[str, inspect.Signature]:
    return {
        RENAMED.get(name, name): inspect.signature(member)
        for name, member in inspect.getmembers(cls, callable)
        if (not name.startswith("_") or name in RENAMED or name in ("__enter__", "__exit__")) and name != "__init__"
    }


def comparable(signature: inspect.Signature) -> list[tuple[str, object, object, str]]:
    """Parameters with their annotations as written; `AsyncX`/`X` and `aioredis.Redis`/`Redis` are the same
    name across the twins."""
    return [
        (p.name, p.kind, p.default, str(p.annotation).replace("Async", "").replace("aioredis.", ""))
        for p in signature.parameters.values()
    ]


@pytest.mark.parametrize(("aio", "sync"), [(AsyncClient, Client), (AsyncJob, Job), (AsyncChoices, Choices)])
def test_the_twins_expose_the_same_methods_with_the_same_parameters(aio: type, sync: type) -> None:
    async_methods, sync_methods = public_methods(aio), public_methods(sync)
    assert set(async_methods) == set(sync_methods)
    for name, signature in async_methods.items():
        assert comparable(signature) == comparable(sync_methods[name]), name
    assert comparable(inspect.signature(aio.__init__)) == comparable(inspect.signature(sync.__init__))


@pytest.mark.parametrize("cls", [AsyncClient, Client])
def test_submit_takes_the_wire_models_sampling_fields_and_leaves_defaults_to_it(cls: type) -> None:
    parameters = inspect.signature(cls.submit).parameters
    for name in SamplingParams.model_fields:
        assert name in parameters, name
        assert parameters[name].default is None, f"{name}: the default lives in the wire model"
    others = {"self", "prompt", "messages", "input_ids", "tools", "queue", "deadline", "request_id", "reply_to"}
    others |= {"priority", "n", "tenant"}  # the entry's fields (lane, tenant) and the call's choices
    assert set(parameters) - set(SamplingParams.model_fields) == others
