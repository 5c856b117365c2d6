"""The gateway's tenants (`LLMQ_GATEWAY_TENANTS_FILE`): each API key submits as its tenant and no other, whatever
its request says, and the file's weights reach Redis, where workers read them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from pydantic import ValidationError

from client.protocol import TENANT_FIELD
from client.store import Keys
from gateway.settings import GatewaySettings
from tests.polling import wait_until

KEYS = Keys("default")
TENANTS = {"billing": {"keys": ["key-billing"], "weight": 3}, "search": {"keys": ["key-search", "key-search-2"]}}


def tenants_file(tmp_path: Path, content: Any = TENANTS) -> Path:
    path = tmp_path / "tenants.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


async def model_for(served: Any, api_key: str) -> str:
    """The first live worker's model, as `api_key` lists it."""
    found: list[str] = []

    async def listed() -> bool:
        async with served.http(headers={"Authorization": f"Bearer {api_key}"}) as http:
            found[:] = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
        return bool(found)

    await wait_until(listed)
    return found[0]


async def tenant_while_running(served: Any, redis_url: str, api_key: str, **extra: Any) -> str:
    """Streams one slow completion with `api_key` and reads, while it runs, the tenant on its request's entry."""
    model = await model_for(served, api_key)
    async with aioredis.Redis.from_url(redis_url) as redis, served.http() as http:
        body = {"model": model, "prompt": "hello", "max_tokens": 30, "stream": True, **extra.pop("body", {})}
        headers = {"Authorization": f"Bearer {api_key}", **extra.pop("headers", {})}
        async with http.stream("POST", "/v1/completions", json=body, headers=headers, timeout=30) as answer:
            assert answer.status_code == 200, await answer.aread()
            entries: list[Any] = []

            async def running() -> bool:
                entries[:] = await redis.xrange(KEYS.lane("default"))
                return bool(entries)

            await wait_until(running)
            async for _ in answer.aiter_lines():
                pass
    [(_, fields)] = entries
    return str(fields[TENANT_FIELD].decode())


async def test_each_key_submits_as_its_tenant_and_plain_keys_as_the_default(
    gateway: Any, start_worker: Any, redis_url: str, tmp_path: Path
) -> None:
    await start_worker(step_s=0.05)
    served = await gateway(api_keys="key-plain", tenants_file=tenants_file(tmp_path))
    assert await tenant_while_running(served, redis_url, "key-billing") == "billing"
    assert await tenant_while_running(served, redis_url, "key-search-2") == "search"
    assert await tenant_while_running(served, redis_url, "key-plain") == "default"


async def test_a_key_cannot_act_for_another_tenant(
    gateway: Any, start_worker: Any, redis_url: str, tmp_path: Path
) -> None:
    """Neither a header nor a body field moves a request to another tenant: the key alone decides."""
    await start_worker(step_s=0.05)
    served = await gateway(tenants_file=tenants_file(tmp_path))
    forged = {"headers": {"X-LLMQ-Tenant": "billing", "OpenAI-Organization": "billing"}, "body": {"user": "billing"}}
    assert await tenant_while_running(served, redis_url, "key-search", **forged) == "search"
    async with served.http() as http:
        model = await model_for(served, "key-search")
        refused = await http.post(
            "/v1/completions",
            json={"model": model, "prompt": "x", "max_tokens": 1},
            headers={"Authorization": "Bearer billing"},  # a tenant's name is no key
        )
    assert refused.status_code == 401


async def test_the_files_weights_reach_every_partition(gateway: Any, redis_url: str, tmp_path: Path) -> None:
    await gateway(tenants_file=tenants_file(tmp_path), queues="default,other", queue_partitions=2)
    async with aioredis.Redis.from_url(redis_url) as redis:
        for queue in ("default", "other"):
            for part in Keys(queue).partitioned(2):
                assert await redis.hgetall(part.tenant_weights) == {b"billing": b"3.0"}


@pytest.mark.parametrize(
    ("content", "complaint"),
    [
        ("{not json", "not a readable JSON file"),
        ([], "must be a JSON object"),
        ({"bad name": {"keys": ["k"]}}, "must be 1-128 characters"),
        ({"a": {"keys": []}}, "needs 'keys'"),
        ({"a": {"keys": ["k"], "weight": 0}}, "a weight must be"),
        ({"a": {"keys": ["k"], "weight": "3"}}, "a weight must be"),
        ({"a": {"keys": ["dup-secret"]}, "b": {"keys": ["dup-secret"]}}, "listed twice"),
        ({"a": {"keys": ["k"], "quota": 1}}, "an optional 'weight'"),
    ],
)
def test_a_bad_tenants_file_is_refused_at_start_without_showing_a_key(
    tmp_path: Path, content: Any, complaint: str
) -> None:
    with pytest.raises(ValidationError) as refused:
        GatewaySettings(_env_file=None, tenants_file=tenants_file(tmp_path, content))  # type: ignore[call-arg]
    assert complaint in str(refused.value) and "dup-secret" not in str(refused.value)


async def test_without_a_tenants_file_nothing_is_written(gateway: Any, redis_url: str) -> None:
    await gateway()
    await asyncio.sleep(0.1)
    async with aioredis.Redis.from_url(redis_url) as redis:
        assert await redis.exists(KEYS.tenant_weights) == 0
