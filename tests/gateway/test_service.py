"""API keys, /v1/models, /health, /metrics, settings, and what the gateway must never import."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import openai
import pytest

from gateway.settings import GatewaySettings

HI = [{"role": "user", "content": "hi"}]


async def test_api_keys(gateway: Any, start_worker: Any) -> None:
    await start_worker()
    served = await gateway(api_keys="first-key, second-key")
    async with served.http() as http:  # open: load balancers and Prometheus
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/metrics")).status_code == 200
        model = (await http.get("/v1/models", headers={"Authorization": "Bearer second-key"})).json()["data"][0]["id"]
    for key in ("wrong-key", "first-key-and-more", "first"):
        with pytest.raises(openai.AuthenticationError) as caught:
            await served.sdk(api_key=key).chat.completions.create(model=model, messages=HI, max_tokens=2)
        assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    async with served.http() as http:
        missing = await http.post("/v1/chat/completions", json={"model": model, "messages": HI})
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    for key in ("first-key", "second-key"):
        answer = await served.sdk(api_key=key).chat.completions.create(model=model, messages=HI, max_tokens=2)
        assert answer.usage is not None and answer.usage.completion_tokens == 2
    sync = served.sync_sdk(api_key="second-key")
    listed = await asyncio.to_thread(sync.models.list)
    assert [m.id for m in listed.data] == [model]


async def test_models_come_from_live_workers(gateway: Any, start_worker: Any, redis_url: str) -> None:
    served = await gateway(worker_stale_s=1.0)
    async with served.http() as http:
        assert (await http.get("/v1/models")).json() == {"object": "list", "data": []}
        assert (await http.get("/health")).json() == {"status": "ok", "models": []}
    running = await start_worker()
    model = await served.model()
    assert model == running.worker.settings.model  # the worker's own model name
    listed = await served.sdk().models.list()
    (entry,) = listed.data
    assert entry.id == model and entry.owned_by == "llmq" and entry.model_extra == {"queue": "default", "workers": 1}
    async with served.http() as http:
        one = await http.get(f"/v1/models/{model}")
        missing = await http.get("/v1/models/nope")
        health = await http.get("/health")
    assert one.json()["id"] == model and missing.status_code == 404
    assert health.json() == {"status": "ok", "models": [model]}


async def test_health_is_503_without_redis(gateway: Any) -> None:
    served = await gateway(redis_url="redis://127.0.0.1:1/0", redis_failover_timeout_s=0.5)
    async with served.http() as http:
        health = await http.get("/health")
        models = await http.get("/v1/models")
    assert health.status_code == 503 and health.json()["status"] == "unavailable"
    assert models.status_code == 503 and models.json()["error"]["code"] == "unavailable"


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMQ_GATEWAY_API_KEYS", " a1 ,b2,, ")
    monkeypatch.setenv("LLMQ_GATEWAY_QUEUES", "chat, code")
    monkeypatch.setenv("LLMQ_GATEWAY_PORT", "9001")
    settings = GatewaySettings(_env_file=None)  # type: ignore[call-arg]
    assert settings.keys == [b"a1", b"b2"] and settings.queue_names == ["chat", "code"] and settings.port == 9001
    assert "a1" not in repr(settings)  # keys are secrets
    flags = GatewaySettings(_env_file=None, _cli_parse_args=["--port", "9002", "--max-body-bytes", "5000"])  # type: ignore[call-arg]
    assert (flags.port, flags.max_body_bytes) == (9002, 5000)


def test_the_gateway_never_imports_torch() -> None:
    code = (
        "import sys, gateway.app, gateway.__main__\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'transformers', 'worker.engine'}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"
