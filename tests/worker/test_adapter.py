"""The boundary between the wire and the engine: every engine error has a wire code, requests and settings
translate field by field."""

from __future__ import annotations

from client.protocol import ErrorCode, GenerateRequest, ms_now
from worker import adapter
from worker.config import Settings
from worker.engine import errors as engine_errors
from worker.engine.types import GenerationParams


def all_subclasses(cls: type) -> set[type]:
    return {cls}.union(*(all_subclasses(sub) for sub in cls.__subclasses__()))


def test_every_engine_error_has_its_own_row_and_a_known_code() -> None:
    defined = {
        value
        for value in vars(engine_errors).values()
        if isinstance(value, type) and issubclass(value, engine_errors.EngineError)
    }
    assert defined == all_subclasses(engine_errors.EngineError) == set(adapter.ERRORS)
    for cls, wire in adapter.ERRORS.items():
        assert wire.code in set(ErrorCode), cls
        error = cls("x") if cls is not engine_errors.EngineFailed else cls("x", implicated=False)
        assert adapter.wire_error(error) == wire
    assert adapter.wire_error(engine_errors.RequestRejected("x")).code == ErrorCode.INVALID_REQUEST


def test_a_wire_request_becomes_the_same_engine_request() -> None:
    request = GenerateRequest(
        id="r",
        input_ids=[1, 2],
        submitted=ms_now(),
        params={"max_new_tokens": 9, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "stop": ["x"], "ignore_eos": True},
    )
    engine = adapter.engine_request(request, suspect=True)
    assert engine.request_id == "r" and engine.input_ids == [1, 2] and engine.suspect
    assert engine.params == GenerationParams(
        max_new_tokens=9, temperature=0.5, top_p=0.9, top_k=7, stop=("x",), ignore_eos=True
    )


def test_settings_and_engine_config_share_their_defaults() -> None:
    config = adapter.engine_config(Settings(_env_file=None))
    assert config == type(config)()  # the settings' sizing defaults are the engine's
    assert GenerationParams().max_new_tokens == GenerateRequest.model_fields["params"].default_factory().max_new_tokens
