"""Schema answers of the tiny random model (byte-level BPE, so it emits partial and invalid byte sequences
freely): each is valid UTF-8, and its string's length, as the caller decodes it, obeys the schema's
`maxLength`, so a Pydantic model validates it (what `chat.completions.parse` does)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field
from transformers.convert_slow_tokenizer import bytes_to_unicode

from worker.engine import EngineRequest, Finish, GenerationParams, RequestRejected, Resume
from worker.engine.constraints import json_schema_format

BYTE_OF = {char: byte for byte, char in bytes_to_unicode().items()}  # byte-level BPE's printable stand-ins


class Short(BaseModel):
    name: str = Field(max_length=3)


class Longer(BaseModel):
    name: str = Field(max_length=6)


def raw_bytes(tokenizer: Any, ids: list[int]) -> bytes:
    """The bytes the tokens stand for, straight from the vocabulary (no lossy decode in between)."""
    return b"".join(bytes(BYTE_OF[char] for char in token) for token in tokenizer.convert_ids_to_tokens(ids))


@pytest.mark.parametrize("model", [Short, Longer])
async def test_100_of_100_schema_answers_are_valid_utf8_and_validate(
    llama_dir: Path, make_engine: Any, model: type[BaseModel]
) -> None:
    engine = await make_engine(llama_dir, max_running=32, kv_cache_tokens=8192)
    schema = {**model.model_json_schema(), "additionalProperties": False}
    params = [
        GenerationParams(max_new_tokens=48, temperature=1.0, seed=seed, output_format=json_schema_format(schema))
        for seed in range(100)
    ]

    async def answer(index: int) -> tuple[list[int], str, str | None]:
        stream = engine.submit(EngineRequest(f"r{index}", input_ids=[5 + index % 50, 6], params=params[index]))
        ids, text, reason = [], "", None
        async for delta in stream:
            ids += delta.token_ids
            text += delta.text
            reason = delta.finish_reason
        return ids, text, reason

    answers = await asyncio.gather(*(answer(index) for index in range(100)))
    names = []
    for ids, text, reason in answers:
        assert reason == Finish.EOS and ids[-1] in engine.eos_token_ids
        assert raw_bytes(engine.tokenizer, ids[:-1]).decode("utf-8") == text  # strict: raises on invalid bytes
        names.append(model.model_validate_json(text).name)  # type: ignore[attr-defined]
    assert sum(not name.isascii() for name in names) >= 10  # the model does write multi-byte characters


async def test_a_resume_whose_delivered_bytes_are_not_utf8_is_refused(llama_dir: Path, make_engine: Any) -> None:
    engine = await make_engine(llama_dir)
    tokenizer = engine.tokenizer
    start = tokenizer.encode('{"name": "', add_special_tokens=False)
    surrogate = tokenizer.convert_tokens_to_ids([bytes_to_unicode()[byte] for byte in b"\xed\xac\x89"])
    params = GenerationParams(max_new_tokens=48, output_format=json_schema_format(Short.model_json_schema()))
    with pytest.raises(RequestRejected, match="does not match the response format"):
        engine.submit(
            EngineRequest("bad", input_ids=[5, 6], params=params, resume=Resume(start + surrogate, '{"name": "'))
        )
    emoji = tokenizer.encode("😀", add_special_tokens=False)  # three tokens: resumed after two, mid-character
    resume = Resume(start + emoji[:2], '{"name": "')
    deltas = [
        delta async for delta in engine.submit(EngineRequest("ok", input_ids=[5, 6], params=params, resume=resume))
    ]
    assert deltas[-1].finish_reason == Finish.EOS
    name = Short.model_validate_json(resume.text + "".join(delta.text for delta in deltas)).name
    assert name[0].encode().startswith(raw_bytes(tokenizer, emoji[:2]))  # the character was completed
