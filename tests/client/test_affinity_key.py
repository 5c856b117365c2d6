"""The cache-affinity key (`client.affinity`): prompts that start alike share it, whatever follows, and every caller
computes it the same way; the client puts it on the request's entry."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from client.affinity import WINDOW_CHARS, WINDOW_IDS, affinity_key
from client.protocol import AFFINITY_FIELD, ChatMessage, GenerateRequest
from client.store import Keys
from tests.client.twins import Twin

SYSTEM = "You are a support agent for ACME. " * 10  # longer than the window


def key(**prompt: Any) -> bytes:
    return affinity_key(GenerateRequest(id="r", submitted=1, **prompt))


def test_prompts_that_share_the_window_share_the_key_and_others_do_not() -> None:
    assert key(prompt=SYSTEM + "Where is my order?") == key(prompt=SYSTEM + "Cancel it.")
    assert key(prompt="Where is my order?") != key(prompt="Cancel it.")
    start = "x" * (WINDOW_CHARS - 1)
    assert key(prompt=start + "a") != key(prompt=start + "b")  # the window's last character counts
    assert key(prompt=start + "ab") != key(prompt=start + "bb")
    assert key(prompt=start + "a" + "b") == key(prompt=start + "a" + "c")  # the one past it does not
    ids = list(range(3, 3 + WINDOW_IDS))
    assert key(input_ids=[*ids, 1]) == key(input_ids=[*ids, 2]) != key(input_ids=[*ids[:-1], 99, 1])
    assert len(key(prompt="hi")) == 16 and int(key(prompt="hi"), 16) >= 0


def test_chat_messages_are_keyed_by_their_leading_messages() -> None:
    system = ChatMessage(role="system", content=SYSTEM)
    first = key(messages=[system, ChatMessage(role="user", content="Where is my order?")])
    second = key(messages=[system, ChatMessage(role="user", content="Cancel it.")])
    other = key(messages=[ChatMessage(role="system", content="Be terse."), ChatMessage(role="user", content="Hi")])
    assert first == second != other
    as_user = key(messages=[ChatMessage(role="user", content=SYSTEM), ChatMessage(role="user", content="x")])
    assert as_user != first  # the role is part of what the template renders
    assert key(prompt=SYSTEM) != first  # a text prompt and a chat do not render alike


def test_a_long_conversation_costs_no_more_than_its_window() -> None:
    many = [ChatMessage(role="user", content="y" * 100_000) for _ in range(50)]
    assert key(messages=many) == key(messages=many[:1])


async def test_the_client_puts_the_key_on_the_entry(twin: Twin, server: aioredis.Redis) -> None:
    job = await twin.submit(SYSTEM + "Where is my order?", max_new_tokens=5)
    [(_, fields)] = await server.xrange(Keys("default").requests)
    assert fields[AFFINITY_FIELD] == key(prompt=SYSTEM + "Where is my order?")
    assert job.id
