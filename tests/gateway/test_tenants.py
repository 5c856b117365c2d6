"""The gateway's tenants (`LLMQ_GATEWAY_TENANTS_FILE`): each API key submits as its tenant and no other, whatever
its request says, and the file's weights reach Redis, where workers read them."""

from __future__ import annotations

import asyncio
import json
import time
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


async def test_the_files_weights_and_quotas_reach_every_partition(gateway: Any, redis_url: str, tmp_path: Path) -> None:
    limited = {**TENANTS, "search": {"keys": ["key-search"], "limits": {"max_running": 4, "tokens_per_minute": 90}}}
    await gateway(tenants_file=tenants_file(tmp_path, limited), queues="default,other", queue_partitions=2)
    async with aioredis.Redis.from_url(redis_url) as redis:
        for queue in ("default", "other"):
            for part in Keys(queue).partitioned(2):
                assert await redis.hgetall(part.tenant_weights) == {b"billing": b"3.0"}
                assert await redis.hgetall(part.tenant_limits) == {b"search": b"0 0 4 90"}


async def test_a_tenant_past_its_queued_quota_gets_a_429_with_its_retry_after(
    gateway: Any, start_worker: Any, redis_url: str, tmp_path: Path
) -> None:
    """One worker, one slot: billing's first request runs, its second waits (held: its quota of one queued), its
    third is refused; search, another tenant, is still queued."""
    quotas = {
        "billing": {"keys": ["key-billing"], "limits": {"max_queued": 1}, "retry_after_s": 7},
        "search": {"keys": ["key-search"]},
    }
    await start_worker(step_s=0.1, max_running=1)
    served = await gateway(tenants_file=tenants_file(tmp_path, quotas), retry_after_s=2)
    model = await model_for(served, "key-billing")
    body = {"model": model, "prompt": "hello", "max_tokens": 20}
    async with served.http(timeout=60) as http, aioredis.Redis.from_url(redis_url) as redis:

        def post(key: str) -> Any:
            return http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})

        first = asyncio.create_task(post("key-billing"))
        await wait_until(lambda: redis.xlen(KEYS.lane("default")))  # running
        second = asyncio.create_task(post("key-billing"))
        await wait_until(lambda: redis.xlen(KEYS.held("default")))  # held: billing's one queued
        refused = await post("key-billing")
        assert refused.status_code == 429, refused.text
        assert refused.headers["Retry-After"] == "7"
        assert refused.json()["error"]["code"] == "tenant_quota_exceeded"
        other = asyncio.create_task(post("key-search"))
        answers = await asyncio.gather(first, second, other)
    assert [answer.status_code for answer in answers] == [200, 200, 200]


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
        ({"a": {"keys": ["k"], "quota": 1}}, "an object of keys, limits, retry_after_s, weight"),
        ({"a": {"keys": ["k"], "limits": {"max_queued": 0}}}, "max_queued must be a whole number"),
        ({"a": {"keys": ["k"], "limits": {"max_running": 2.5}}}, "max_running must be a whole number"),
        ({"a": {"keys": ["k"], "limits": {"max_runing": 2}}}, "max_runing"),
        ({"a": {"keys": ["k"], "limits": [1]}}, "'limits' must be an object"),
        ({"a": {"keys": ["k"], "retry_after_s": -1}}, "'retry_after_s' must be"),
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


async def test_a_tenants_key_reaches_nothing_of_another_tenant(
    gateway: Any, start_worker: Any, redis_url: str, tmp_path: Path
) -> None:
    """Isolation with a second key: another tenant's Idempotency-Key names another generation (no attaching to
    billing's), and billing's batch and files are 404 to search, as if they did not exist."""
    await start_worker()
    served = await gateway(tenants_file=tenants_file(tmp_path), batch_poll_s=0.1)
    model = await model_for(served, "key-billing")
    billing = {"Authorization": "Bearer key-billing"}
    search = {"Authorization": "Bearer key-search"}
    body = {"model": model, "prompt": "hello", "max_tokens": 4}
    async with served.http(timeout=30) as http:
        same = {"Idempotency-Key": "shared-key"}
        first = await http.post("/v1/completions", json=body, headers={**billing, **same})
        other = await http.post("/v1/completions", json=body, headers={**search, **same})
        assert first.status_code == other.status_code == 200
        assert first.json()["id"] != other.json()["id"]  # two generations, each its key's
        line = {"custom_id": "1", "method": "POST", "url": "/v1/completions", "body": body}
        upload = await http.post(
            "/v1/files",
            headers=billing,
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", json.dumps(line).encode() + b"\n")},
        )
        assert upload.status_code == 200, upload.text
        file_id = upload.json()["id"]
        created = await http.post(
            "/v1/batches",
            headers=billing,
            json={"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"},
        )
        assert created.status_code == 200, created.text
        batch_id = created.json()["id"]
        for method, path in [
            ("GET", f"/v1/batches/{batch_id}"),
            ("POST", f"/v1/batches/{batch_id}/cancel"),
            ("GET", f"/v1/files/{file_id}"),
            ("GET", f"/v1/files/{file_id}/content"),
            ("DELETE", f"/v1/files/{file_id}"),
        ]:
            refused = await http.request(method, path, headers=search)
            assert refused.status_code == 404, (method, path, refused.text)
        listed = await http.get("/v1/batches", headers=search)
        assert batch_id not in [batch["id"] for batch in listed.json()["data"]]
        assert (await http.get(f"/v1/batches/{batch_id}", headers=billing)).status_code == 200
    hour = int(time.time()) // 3600
    async with aioredis.Redis.from_url(redis_url) as redis:  # this hour's usage and the last's: a test may cross one
        usage = {**await redis.hgetall(KEYS.usage(hour - 1)), **await redis.hgetall(KEYS.usage(hour))}
    assert usage.get(b"billing|requests|length") and usage.get(b"search|requests|length")  # each its own
