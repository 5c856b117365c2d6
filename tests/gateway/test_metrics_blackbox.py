"""Black-box tests of the gateway's Prometheus metrics (issue 29, item 4): a real `python -m gateway` in front of a
real `python -m worker` (tiny random model) and a redis-server of their own, driven over HTTP, `/metrics` scraped
as an operator scrapes it. docs/operations/metrics.md (Gateway, Process) and docs/gateway.md are the contract."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from testing.tiny_models import save_tiny_model
from tests.worker.test_metrics_blackbox import (
    START_S,
    Process,
    Scrape,
    WorkerProcess,
    assert_never_decreased,
    assert_process_metrics,
    clean_env,
    free_port,
    wait_for,
)
from worker.embedded_redis import RedisServer

# Real redis-server, models on disk and several worker processes: never the `unit` tier.
pytestmark = [pytest.mark.redis, pytest.mark.model, pytest.mark.slow]
QUEUE = "gw"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
KNOWN_ROUTES = {CHAT, COMPLETIONS, "/v1/models", "/health", "/metrics", "other"}
MARK = "zzhostile"  # in every hostile name, so the page can be searched for any trace of one


class GatewayProcess(Process):
    def __init__(self, redis_url: str, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        settings = {
            "LLMQ_GATEWAY_REDIS_URL": redis_url,
            "LLMQ_GATEWAY_HOST": "127.0.0.1",
            "LLMQ_GATEWAY_PORT": str(self.port),
            "LLMQ_GATEWAY_QUEUES": QUEUE,
            "LLMQ_GATEWAY_MODELS_REFRESH_S": "0",
        }
        super().__init__([sys.executable, "-m", "gateway"], clean_env(**settings), workdir, "gateway")
        self.url = f"http://127.0.0.1:{self.port}"

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60)

    def scrape(self) -> Scrape:
        with self.http() as http:
            response = http.get("/metrics")
        assert response.status_code == 200
        return Scrape.parse(response.text)


@dataclass
class Stack:
    gateway: GatewayProcess
    worker: WorkerProcess

    @property
    def model(self) -> str:
        return self.worker.model  # a worker announces its LLMQ_MODEL

    def chat(self, model: Any, **body: Any) -> httpx.Response:
        with self.gateway.http() as http:
            return http.post(CHAT, json={"model": model, "messages": [{"role": "user", "content": "Hi"}], **body})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("gateway-metrics-blackbox")
    server = RedisServer(root / "redis").start()
    model_dir = save_tiny_model(root / "tiny-llama", "llama", max_positions=512)
    worker = WorkerProcess(server.url, model_dir, root / "worker", QUEUE, root / "kernels")
    gateway = GatewayProcess(server.url, root / "gateway")
    try:
        worker.wait_ready()

        def serving() -> bool:
            assert gateway.alive(), gateway.output()[-4000:]
            with gateway.http() as http:
                models = http.get("/v1/models").json()["data"]
            return [m["id"] for m in models] == [worker.model]

        wait_for(serving, START_S, "the gateway listing the worker's model")
        yield Stack(gateway, worker)
    finally:
        gateway.stop()
        worker.stop()
        server.stop()


def in_flight(page: Scrape) -> dict[tuple[str, str], float]:
    """The in-flight gauge by (route, model), but for the scrape that reads it (in flight while it renders)."""
    series = {
        (dict(labels)["route"], dict(labels).get("model", "")): value
        for labels, value in page.named("llmq:gateway_requests_in_flight").items()
    }
    assert series.pop(("/metrics", "")) == 1
    return series


def models_on(page: Scrape) -> set[str]:
    """Every `model` label value of the gateway's series ("" where it has none), but the queue's name, which
    `test_a_queue_name_as_model_is_not_a_label_of_its_own` looks at (so the tests hold in any order)."""
    values = set()
    for name, labels in page.samples:
        if name.startswith("llmq:gateway_"):
            values.add(dict(labels).get("model", ""))
    return values - {QUEUE}


def test_served_model_labels_every_gateway_series(stack: Stack) -> None:
    before = stack.gateway.scrape()
    whole = stack.chat(stack.model, max_tokens=4, temperature=0)
    assert whole.status_code == 200, whole.text
    with stack.gateway.http() as http:
        with http.stream(
            "POST",
            CHAT,
            json={
                "model": stack.model,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
                "stream": True,
            },
        ) as streamed:
            assert streamed.status_code == 200
            assert "[DONE]" in "".join(streamed.iter_text())
        completion = http.post(COMPLETIONS, json={"model": stack.model, "prompt": "Hi", "max_tokens": 3})
        assert completion.status_code == 200, completion.text
    after = stack.gateway.scrape()
    model = stack.model

    def grew(name: str, **labels: str) -> float:
        return after.total(name, **labels) - before.total(name, **labels)

    assert grew("llmq:gateway_requests_total", route=CHAT, status="200", model=model) == 2
    assert grew("llmq:gateway_requests_total", route=COMPLETIONS, status="200", model=model) == 1
    assert grew("llmq:gateway_request_duration_seconds_count", route=CHAT, model=model) == 2
    assert grew("llmq:gateway_request_duration_seconds_count", route=COMPLETIONS, model=model) == 1
    assert grew("llmq:gateway_time_to_first_token_seconds_count", route=CHAT, model=model) == 1  # streams only
    # nothing of these requests stayed under the empty model: they named a served one
    assert grew("llmq:gateway_requests_total", route=CHAT, model="") == 0
    # the in-flight gauge moved to the model and back: nothing in flight now, under any label
    assert set(in_flight(after).values()) <= {0.0}
    assert (CHAT, model) in in_flight(after)
    assert_never_decreased(before, after)


HOSTILE = [
    MARK + "x" * 100_000,  # very long
    f"{MARK}-模型-😀-\u202e-ß",  # unicode, a right-to-left override
    f'{MARK}a",b="c',  # label injection
    f'{MARK}"}} 1\nllmq:injected_total 1\n# ',  # a line of its own
    f"{MARK}\\",  # a trailing backslash
    f"{MARK}\x00\x1b[31m",  # NUL and an escape sequence
    f'{MARK}{{model="x"}}',
]


def hostile_variants(stack: Stack) -> list[str]:
    """Names that look like the served one but are not it (a worker serves exactly its LLMQ_MODEL)."""
    return [f" {stack.model}", f"{stack.model}\n", stack.model.upper(), f"{stack.model}/{MARK}"]


def test_unknown_models_never_become_labels(stack: Stack) -> None:
    before = stack.gateway.scrape()
    names = HOSTILE + hostile_variants(stack)
    for name in names:
        response = stack.chat(name, max_tokens=2)
        assert response.status_code == 404, (name[:80], response.status_code, response.text[:300])
    with stack.gateway.http() as http:
        for name in HOSTILE[:3]:
            response = http.post(COMPLETIONS, json={"model": name, "prompt": "Hi", "max_tokens": 2})
            assert response.status_code == 404
    after = stack.gateway.scrape()
    assert models_on(after) <= {"", stack.model}
    assert MARK not in after.text
    assert "injected" not in after.text
    grew = after.total("llmq:gateway_requests_total", route=CHAT, status="404", model="") - before.total(
        "llmq:gateway_requests_total", route=CHAT, status="404", model=""
    )
    assert grew == len(names)  # each counted, under no model
    assert set(in_flight(after).values()) <= {0.0}
    assert_never_decreased(before, after)


@pytest.mark.parametrize("model", [123, 1.5, True, ["x"], {"name": MARK}, None, ""])
def test_a_model_that_is_no_string_makes_no_label(stack: Stack, model: Any) -> None:
    before = stack.gateway.scrape()
    response = stack.chat(model, max_tokens=2)
    assert 400 <= response.status_code < 500, response.text
    after = stack.gateway.scrape()
    assert models_on(after) <= {"", stack.model}
    assert MARK not in after.text
    grew = after.total("llmq:gateway_requests_total", route=CHAT, model="") - before.total(
        "llmq:gateway_requests_total", route=CHAT, model=""
    )
    assert grew == 1


def test_a_queue_name_as_model_is_not_a_label_of_its_own(stack: Stack) -> None:
    response = stack.chat(QUEUE, max_tokens=2, temperature=0)
    assert response.status_code == 200, response.text
    page = stack.gateway.scrape()
    labels = {dict(labels).get("model", "") for name, labels in page.samples if name.startswith("llmq:gateway_")}
    assert labels <= {"", stack.model}


def test_hostile_paths_are_one_route(stack: Stack) -> None:
    with stack.gateway.http() as http:
        for path in (f"/{MARK}", f"/v1/models/{MARK}", f"/v1/chat/completions/{MARK}", f"/{MARK}/%22%7D"):
            assert http.get(path).status_code == 404
        assert http.post(f"/v1/{MARK}", json={"model": stack.model}).status_code == 404
    page = stack.gateway.scrape()
    routes = {dict(labels)["route"] for name, labels in page.samples if name.startswith("llmq:gateway_")}
    assert routes <= KNOWN_ROUTES
    assert MARK not in page.text


def test_gateway_has_process_metrics_and_no_created_series(stack: Stack) -> None:
    assert stack.chat(stack.model, max_tokens=2).status_code == 200  # a counter and a histogram exist
    page = stack.gateway.scrape()
    assert_process_metrics(page)
    assert page.named("python_gc_collections_total")
    process = [dict(labels) for name, labels in page.samples if name.startswith(("process_", "python_"))]
    assert not [labels for labels in process if "model" in labels or "route" in labels]


def test_gateway_counters_never_decrease_across_scrapes(stack: Stack) -> None:
    pages = [stack.gateway.scrape()]
    for model in (stack.model, f"{MARK}-unknown", stack.model):
        stack.chat(model, max_tokens=3)
        pages.append(stack.gateway.scrape())
    for earlier, later in itertools.pairwise(pages):
        assert_never_decreased(earlier, later)
    assert pages[-1].total("llmq:gateway_requests_total") - pages[0].total("llmq:gateway_requests_total") >= 3


def test_a_client_that_leaves_mid_stream_counts_499_under_the_model_and_leaves_nothing_in_flight(
    stack: Stack,
) -> None:
    before = stack.gateway.scrape()
    body = {
        "model": stack.model,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 400,
        "stream": True,
        "temperature": 0,
    }
    with stack.gateway.http() as http, http.stream("POST", CHAT, json=body) as streamed:
        assert streamed.status_code == 200
        next(streamed.iter_bytes())  # the first event, then hang up

    def counted() -> Scrape | None:
        page = stack.gateway.scrape()
        left = page.total("llmq:gateway_requests_total", route=CHAT, status="499", model=stack.model)
        return (
            page
            if left - before.total("llmq:gateway_requests_total", route=CHAT, status="499", model=stack.model) == 1
            else None
        )

    after = wait_for(counted, 60, "the 499")
    assert set(in_flight(after).values()) <= {0.0}
    assert models_on(after) <= {"", stack.model}
    assert_never_decreased(before, after)
