"""The gateway in-process under uvicorn on a free port, in front of a real Redis and in-process workers (the
scripted engine, or `real_model=True` for a tiny random model), driven by the real `openai` SDK."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from starlette.applications import Starlette

from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway.state import Gateway
from tests.polling import wait_until
from tests.worker.conftest import model_dir, start_worker  # noqa: F401 - fixtures shared with the worker tests


@dataclass
class Served:
    app: Starlette
    url: str  # http://127.0.0.1:<port>

    @property
    def state(self) -> Gateway:
        return self.app.state.gateway

    def sdk(self, api_key: str = "unused", **options: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **options)

    def sync_sdk(self, api_key: str = "unused", **options: Any) -> openai.OpenAI:
        """Call it through `asyncio.to_thread`: the gateway runs on the test's event loop."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **options)

    def http(self, **options: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, **options)

    async def model(self) -> str:
        """The id of the first live worker's model, once its heartbeat is in."""
        found: list[str] = []

        async def listed() -> bool:
            async with self.http() as http:
                found[:] = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
            return bool(found)

        await wait_until(listed)
        return found[0]


@pytest.fixture
async def gateway(redis_url: str) -> AsyncIterator[Callable[..., Any]]:
    """Starts gateways on free ports (`await gateway(**settings)`); all are stopped after the test."""
    servers: list[tuple[uvicorn.Server, asyncio.Task[None]]] = []

    async def start(**overrides: Any) -> Served:
        values: dict[str, Any] = {"redis_url": redis_url, "models_refresh_s": 0.0, **overrides}
        app = create_app(GatewaySettings(_env_file=None, **values))  # type: ignore[call-arg]
        # Bounded like `llmq-gateway`'s (30 s there): a connection still open at the end cannot hold the stop.
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=5)
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        servers.append((server, task))
        await wait_until(lambda: server.started or task.done())
        port = server.servers[0].sockets[0].getsockname()[1]
        return Served(app, f"http://127.0.0.1:{port}")

    yield start
    for server, _ in servers:
        server.should_exit = True
    for _, task in servers:
        try:
            await asyncio.wait_for(asyncio.shield(task), 30)
        except TimeoutError:  # say what still runs: the gateway's stop is what failed
            stacks = io.StringIO()
            for pending in asyncio.all_tasks():
                pending.print_stack(limit=8, file=stacks)
            raise AssertionError(f"a gateway did not stop within 30 s; tasks:\n{stacks.getvalue()}") from None
