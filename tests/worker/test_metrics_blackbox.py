"""Black-box tests of the worker's Prometheus metrics (issue 29, item 4), read as an operator reads them: a real
`python -m worker` process on a tiny random model and a redis-server of its own, requests sent with the public
client, and `/metrics` scraped over HTTP on `LLMQ_METRICS_PORT`. Counts are compared as deltas between scrapes,
so the tests do not depend on each other's order. docs/operations/metrics.md is the contract."""

from __future__ import annotations

import itertools
import math
import os
import platform
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from client import Client
from testing.tiny_models import save_tiny_model
from worker.embedded_redis import RedisServer, free_port

# Real redis-server, models on disk and several worker processes: never the `unit` tier.
pytestmark = [pytest.mark.redis, pytest.mark.model, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
START_S = 180.0  # a worker imports torch and loads the model: a bound on waiting, never asserted as a duration
Labels = frozenset[tuple[str, str]]


# --- scraping ---------------------------------------------------------------------------------------------------


@dataclass
class Scrape:
    """One scrape of a /metrics page: the raw text, and every sample by (name, labels)."""

    text: str
    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)  # family name -> type

    @classmethod
    def parse(cls, text: str) -> Scrape:
        scrape = cls(text)
        for family in text_string_to_metric_families(text):
            scrape.types[family.name] = family.type
            for sample in family.samples:
                scrape.samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
        return scrape

    def named(self, name: str, **labels: str) -> dict[Labels, float]:
        """The samples called `name` whose labels include `labels`."""
        wanted = set(labels.items())
        return {key: value for (sample, key), value in self.samples.items() if sample == name and wanted <= key}

    def value(self, name: str, **labels: str) -> float:
        """The one sample called `name` with `labels` (all of its labels, or a subset matching exactly one)."""
        found = self.named(name, **labels)
        assert len(found) == 1, f"{name}{labels}: {len(found)} series: {found}"
        return next(iter(found.values()))

    def total(self, name: str, **labels: str) -> float:
        """Sum over the matching series (0 where there is none)."""
        return sum(self.named(name, **labels).values())

    def label_values(self, label: str) -> set[str]:
        return {value for (_, labels) in self.samples for key, value in labels if key == label}


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return Scrape.parse(response.read().decode())


def wait_for(predicate: Callable[[], Any], within_s: float = 60.0, what: str = "condition") -> Any:
    """Polls `predicate` until it returns something truthy (returned); fails after `within_s`. A bound on waiting
    for something that should happen, never a measurement."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            value = predicate()
        except (OSError, AssertionError):  # not up yet, or not yet what we wait for
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def monotonic_series(scrape: Scrape) -> dict[tuple[str, Labels], float]:
    """The samples that may only grow: counters (`_total`) and every histogram's `_count`, `_sum` and buckets."""
    out = {}
    for (name, labels), value in scrape.samples.items():
        family = name.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
        histogram = scrape.types.get(family) == "histogram" and name != family
        counter = name.endswith("_total") and scrape.types.get(name.removesuffix("_total")) == "counter"
        if histogram or counter:
            out[(name, labels)] = value
    return out


def assert_never_decreased(before: Scrape, after: Scrape) -> None:
    earlier, later = monotonic_series(before), monotonic_series(after)
    shrunk = {key: (value, later.get(key)) for key, value in earlier.items() if later.get(key, -1.0) < value}
    assert not shrunk, f"series that went down or disappeared: {shrunk}"


def assert_process_metrics(page: Scrape) -> None:
    """prometheus_client's process and platform collectors are there, and no `_created` series anywhere."""
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"):
        assert page.value(name) > 0, name
    info = page.named("python_info")
    assert len(info) == 1
    labels = dict(next(iter(info)))
    assert labels["implementation"] == platform.python_implementation()
    assert labels["major"] == str(sys.version_info.major)
    assert not [line for line in page.text.splitlines() if re.match(r"^(# (HELP|TYPE) )?\S+_created\b", line)]
    assert not [name for name, _ in page.samples if name.endswith("_created")]


# --- processes --------------------------------------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a child: ours without any LLMQ_* setting of the session, plus `extra`."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("LLMQ_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), **extra)
    return env


class Process:
    """A child process with its output in a file, stopped with SIGTERM (then SIGKILL) at the end."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path, name: str) -> None:
        self.log_path = cwd / f"{name}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)  # in case a test stopped it
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


class WorkerProcess(Process):
    """`python -m worker` serving `queue` of `redis_url` with the tiny model, /metrics on a free port."""

    def __init__(
        self,
        redis_url: str,
        model_dir: Path,
        workdir: Path,
        queue: str,
        kernel_cache: Path,
        module: str = "worker",
        **env: str,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.queue = queue
        self.model = str(model_dir)
        settings = {
            "LLMQ_REDIS_URL": redis_url,
            "LLMQ_MODEL": str(model_dir),
            "LLMQ_QUEUE": queue,
            "LLMQ_METRICS_PORT": str(self.port),
            "LLMQ_METRICS_ADDRESS": "127.0.0.1",
            "LLMQ_HEALTH_FILE": str(workdir / "health"),
            "LLMQ_MODEL_CACHE_DIR": str(workdir / "models"),
            "LLMQ_KV_CACHE_TOKENS": "4096",
            "LLMQ_PAGE_SIZE": "16",
            "LLMQ_MAX_BATCH_TOKENS": "128",
            "LLMQ_MAX_RUNNING": "8",
            "LLMQ_READ_BLOCK_MS": "50",
            "LLMQ_HEARTBEAT_S": "0.2",
            "XDG_CACHE_HOME": str(kernel_cache),
            **env,
        }
        super().__init__([sys.executable, "-m", module], clean_env(**settings), workdir, f"worker-{queue}")
        self.url = f"http://127.0.0.1:{self.port}/metrics"

    def scrape(self) -> Scrape:
        return scrape(self.url)

    def wait_ready(self) -> Scrape:
        """Until /metrics answers and a heartbeat has filled the queue gauges."""

        def ready() -> Scrape | None:
            assert self.alive(), f"worker exited:\n{self.output()[-4000:]}"
            page = self.scrape()
            return page if page.named("llmq:backlog_seconds") else None

        try:
            return wait_for(ready, START_S, f"worker on {self.queue}")
        except AssertionError:
            raise AssertionError(f"worker not ready:\n{self.output()[-4000:]}") from None


@dataclass
class Fleet:
    redis: RedisServer
    model_dir: Path
    root: Path
    kernel_cache: Path  # shared by the workers that build kernels normally: compiled once
    started: list[Process] = field(default_factory=list)

    def worker(
        self, queue: str, *, kernel_cache: Path | None = None, module: str = "worker", **env: str
    ) -> WorkerProcess:
        worker = WorkerProcess(
            self.redis.url, self.model_dir, self.root / queue, queue, kernel_cache or self.kernel_cache, module, **env
        )
        self.started.append(worker)
        return worker

    def client(self, queue: str) -> Client:
        return Client(self.redis.url, queue=queue)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("metrics-blackbox")
    server = RedisServer(root / "redis").start()
    fleet = Fleet(server, save_tiny_model(root / "model", "llama", max_positions=512), root, root / "kernels")
    try:
        yield fleet
    finally:
        for process in fleet.started:
            process.stop()
        server.stop()


@pytest.fixture(scope="module")
def served(fleet: Fleet) -> Iterator[WorkerProcess]:
    """One worker on queue `tokens`, shared by the tests that read deltas."""
    worker = fleet.worker("tokens")
    worker.wait_ready()
    yield worker


def settled(worker: WorkerProcess, before: Scrape, finished: int) -> Scrape:
    """The first scrape after `finished` more requests were observed (their per-request histograms), the engine
    is idle, and the token counter reads as it did one scrape before: what the operator reads once the requests
    are done. (A cancel takes a request out of the engine's books at once, while the step already running may
    still count a token of it: the counter settles a step later.)"""
    last: list[float] = []

    def done() -> Scrape | None:
        page = worker.scrape()
        observed = page.total("llmq:request_generation_tokens_count") - before.total(
            "llmq:request_generation_tokens_count"
        )
        idle = page.value("llmq:num_requests_running") == 0 and page.value("llmq:num_requests_waiting") == 0
        tokens = page.total("llmq:generation_tokens_total")
        steady, last[:] = last == [tokens], [tokens]
        return page if observed >= finished and idle and steady else None

    return wait_for(done, 60, f"{finished} finished requests")


def delta(before: Scrape, after: Scrape, name: str, **labels: str) -> float:
    return after.total(name, **labels) - before.total(name, **labels)


# --- 1. tokens and per-request histograms ----------------------------------------------------------------------

PROMPTS = ([5, 6, 7, 8, 9], [10, 11, 12])  # 5 and 3 prompt tokens
NEW_TOKENS = (6, 3)


@pytest.fixture(scope="module")
def two_requests(served: WorkerProcess, fleet: Fleet) -> tuple[Scrape, Scrape, list[Any]]:
    """Two greedy requests of 6 and 3 tokens run together; the scrapes before and after, and their results."""
    before = served.scrape()
    with fleet.client(served.queue) as client:
        jobs = [
            client.submit(input_ids=ids, max_new_tokens=n, temperature=0, ignore_eos=True)
            for ids, n in zip(PROMPTS, NEW_TOKENS, strict=True)
        ]
        results = [job.result(timeout=60) for job in jobs]
    return before, settled(served, before, 2), results


def test_two_requests_generate_nine_tokens_counting_each_first_token(two_requests: Any) -> None:
    before, after, results = two_requests
    assert [len(r.token_ids) for r in results] == list(NEW_TOKENS)
    assert [r.usage.completion_tokens for r in results] == list(NEW_TOKENS)
    assert delta(before, after, "llmq:generation_tokens_total") == 9
    assert delta(before, after, "llmq:request_success_total", finished_reason="length") == 2


def test_prompt_tokens_count_each_prompt_once(two_requests: Any) -> None:
    before, after, results = two_requests
    assert [r.usage.prompt_tokens for r in results] == [len(ids) for ids in PROMPTS]
    assert delta(before, after, "llmq:prompt_tokens_total") == 8


def test_per_request_token_histograms(two_requests: Any) -> None:
    before, after, _ = two_requests
    assert delta(before, after, "llmq:request_generation_tokens_count") == 2
    assert delta(before, after, "llmq:request_generation_tokens_sum") == 9
    assert delta(before, after, "llmq:request_prompt_tokens_count") == 2
    assert delta(before, after, "llmq:request_prompt_tokens_sum") == 8
    # the buckets place each request: 3 and 6 generated, 5 and 3 prompt tokens (1-2-5 buckets)
    assert delta(before, after, "llmq:request_generation_tokens_bucket", le="2.0") == 0
    assert delta(before, after, "llmq:request_generation_tokens_bucket", le="5.0") == 1
    assert delta(before, after, "llmq:request_generation_tokens_bucket", le="10.0") == 2
    assert delta(before, after, "llmq:request_prompt_tokens_bucket", le="2.0") == 0
    assert delta(before, after, "llmq:request_prompt_tokens_bucket", le="5.0") == 2


def test_per_request_times_follow_their_definitions(two_requests: Any) -> None:
    """prefill: admission -> first token; decode: first token -> finish; inference: admission -> finish; so per
    request inference = prefill + decode, and TTFT (from submission) >= prefill, e2e (from submission) >=
    inference. Sums are compared with a millisecond of rounding per request, nothing is timed."""
    before, after, _ = two_requests
    counts = {
        name: delta(before, after, f"llmq:request_{name}_time_seconds_count")
        for name in ("prefill", "decode", "inference")
    }
    assert counts == {"prefill": 2, "decode": 2, "inference": 2}
    prefill, decode, inference = (
        delta(before, after, f"llmq:request_{name}_time_seconds_sum") for name in ("prefill", "decode", "inference")
    )
    slack = 2 * 0.0015
    assert prefill >= 0 and decode >= 0
    assert inference == pytest.approx(prefill + decode, abs=slack)
    assert delta(before, after, "llmq:time_to_first_token_seconds_count") == 2
    assert delta(before, after, "llmq:time_to_first_token_seconds_sum") + slack >= prefill
    assert delta(before, after, "llmq:e2e_request_latency_seconds_count") == 2
    assert delta(before, after, "llmq:e2e_request_latency_seconds_sum") + slack >= inference


def test_iteration_tokens_is_one_observation_per_engine_step(two_requests: Any) -> None:
    """Tokens per engine step: one observation a step (engine_steps_total); batch_fill_ratio divides what the
    forward pass was fed by max_batch_tokens (128 here), which is one token fewer per request (its last generated
    token is never fed back)."""
    before, after, _ = two_requests
    steps = delta(before, after, "llmq:engine_steps_total")
    assert steps >= 3  # 6 tokens need 6 steps, whatever runs together
    assert delta(before, after, "llmq:iteration_tokens_total_count") == steps
    assert delta(before, after, "llmq:batch_fill_ratio_count") == steps
    tokens = delta(before, after, "llmq:iteration_tokens_total_sum")
    # every prompt token is run once and every generated token but each request's last is fed back once
    assert 128 * delta(before, after, "llmq:batch_fill_ratio_sum") == pytest.approx(tokens - 2)


def test_iteration_tokens_sum_is_prompt_plus_generation_tokens_as_in_vllm(two_requests: Any) -> None:
    before, after, _ = two_requests
    prompt = delta(before, after, "llmq:prompt_tokens_total")
    generated = delta(before, after, "llmq:generation_tokens_total")
    assert delta(before, after, "llmq:iteration_tokens_total_sum") == prompt + generated == 17


def test_iteration_tokens_buckets_are_vllms(two_requests: Any) -> None:
    _, after, _ = two_requests
    bounds = sorted(
        float(dict(labels)["le"]) for labels in after.named("llmq:iteration_tokens_total_bucket", queue="tokens")
    )
    assert bounds == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, math.inf]
    assert after.types["llmq:iteration_tokens_total"] == "histogram"


# --- labels and process metrics ----------------------------------------------------------------------------------


def test_every_llmq_series_carries_queue_and_model_name_and_process_series_do_not(
    served: WorkerProcess, two_requests: Any
) -> None:
    page = served.scrape()
    llmq = [(name, dict(labels)) for name, labels in page.samples if name.startswith("llmq:")]
    assert len(llmq) > 50
    wrong = [(n, lab) for n, lab in llmq if lab.get("queue") != served.queue or lab.get("model_name") != served.model]
    assert not wrong
    process = [dict(labels) for name, labels in page.samples if name.startswith(("process_", "python_"))]
    assert process and not [lab for lab in process if "queue" in lab or "model_name" in lab]


def test_worker_has_process_metrics_and_no_created_series(served: WorkerProcess, two_requests: Any) -> None:
    page = served.scrape()
    assert_process_metrics(page)
    assert page.value("process_resident_memory_bytes") > 10_000_000  # torch and the model are loaded
    assert page.named("python_gc_collections_total")
    assert page.value("llmq:request_success_total", finished_reason="length") >= 2  # counters exist, no _created


# --- counters never decrease -------------------------------------------------------------------------------------


def test_counters_and_histograms_never_decrease_across_scrapes(served: WorkerProcess, fleet: Fleet) -> None:
    pages = [served.scrape()]
    with fleet.client(served.queue) as client:
        jobs = [client.submit(input_ids=[5, 6, 7], max_new_tokens=40, temperature=0, ignore_eos=True) for _ in range(3)]
        cancel = client.submit(input_ids=[8, 9], max_new_tokens=300, temperature=0, ignore_eos=True)
        for chunk in cancel.stream(timeout=60):
            pages.append(served.scrape())
            if chunk.seq >= 2:
                cancel.cancel()
                break
        for job in jobs:
            for _ in job.stream(timeout=60):
                pages.append(served.scrape())
    pages.append(settled(served, pages[0], 4))
    for earlier, later in itertools.pairwise(pages):
        assert_never_decreased(earlier, later)
    assert delta(pages[0], pages[-1], "llmq:generation_tokens_total") >= 3 * 40 + 3
    assert delta(pages[0], pages[-1], "process_cpu_seconds_total") >= 0


# --- cancelled and failed requests --------------------------------------------------------------------------------


def test_a_cancelled_request_counts_its_tokens_once_and_leaves_no_residue(served: WorkerProcess, fleet: Fleet) -> None:
    """A cancelled request is counted as finished_reason="cancelled"; its prompt ran (tokens came out), so it is
    counted; the tokens it generated before the cancel are counted, no more than asked; afterwards a clean request
    adds exactly its own tokens."""
    before = served.scrape()
    with fleet.client(served.queue) as client:
        job = client.submit(input_ids=[5, 6, 7, 8], max_new_tokens=400, temperature=0, ignore_eos=True)
        received = 0
        for chunk in job.stream(timeout=60):
            received += len(chunk.token_ids)
            if received >= 3:
                job.cancel()
                break
        with pytest.raises(Exception, match="cancelled"):
            job.result(timeout=60)
    cancelled = settled(served, before, 1)
    assert delta(before, cancelled, "llmq:request_success_total", finished_reason="cancelled") == 1
    assert delta(before, cancelled, "llmq:prompt_tokens_total") == 4
    generated = delta(before, cancelled, "llmq:generation_tokens_total")
    assert received <= generated < 400
    assert delta(before, cancelled, "llmq:request_generation_tokens_count") == 1
    assert delta(before, cancelled, "llmq:request_prompt_tokens_count") == 1
    assert delta(before, cancelled, "llmq:request_prompt_tokens_sum") == 4
    assert received <= delta(before, cancelled, "llmq:request_generation_tokens_sum") <= generated

    with fleet.client(served.queue) as client:
        result = client.submit(input_ids=[9, 10], max_new_tokens=4, temperature=0, ignore_eos=True).result(60)
    after = settled(served, cancelled, 1)
    assert len(result.token_ids) == 4
    assert delta(cancelled, after, "llmq:generation_tokens_total") == 4
    assert delta(cancelled, after, "llmq:prompt_tokens_total") == 2
    assert delta(cancelled, after, "llmq:request_generation_tokens_sum") == 4
    assert delta(cancelled, after, "llmq:request_success_total", finished_reason="cancelled") == 0


def test_rejected_requests_count_no_tokens(served: WorkerProcess, fleet: Fleet) -> None:
    """Requests the worker refuses (ids outside the vocabulary) never reach the engine: no prompt, generation or
    step counts, no per-request observations, no finish reason."""
    before = served.scrape()
    with fleet.client(served.queue) as client:
        for ids in ([100_000], [5, 6, 7, 429_000]):
            with pytest.raises(Exception, match="vocabulary"):
                client.submit(input_ids=ids, max_new_tokens=5, temperature=0).result(timeout=60)
        client.submit(input_ids=[5], max_new_tokens=2, temperature=0, ignore_eos=True).result(timeout=60)
    after = settled(served, before, 1)
    assert delta(before, after, "llmq:prompt_tokens_total") == 1
    assert delta(before, after, "llmq:generation_tokens_total") == 2
    assert delta(before, after, "llmq:request_prompt_tokens_count") == 1
    assert delta(before, after, "llmq:request_generation_tokens_count") == 1
    assert (
        sum(after.named("llmq:request_success_total").values())
        - sum(before.named("llmq:request_success_total").values())
        == 1
    )


def test_an_engine_failure_counts_no_tokens_for_the_request_and_keeps_the_counters(fleet: Fleet) -> None:
    """A request that kills the engine thread (testing.poison: a worker whose sampler raises for top_p 0.4375) is
    retried, then quarantined; it generated nothing, so it adds no generated tokens, and the restarted engine's
    counters carry on from where they were."""
    worker = fleet.worker("poison", module="testing.poison")
    start = worker.wait_ready()
    with fleet.client(worker.queue) as client:
        client.submit(input_ids=[5, 6, 7], max_new_tokens=5, temperature=0, ignore_eos=True).result(timeout=60)
        clean = settled(worker, start, 1)
        with pytest.raises(Exception, match="poison_request"):
            client.submit(input_ids=[5, 6, 7, 8], max_new_tokens=5, top_p=0.4375, ignore_eos=True).result(timeout=120)
        failed = worker.scrape()
        client.submit(input_ids=[9, 10], max_new_tokens=4, temperature=0, ignore_eos=True).result(timeout=60)
    after = settled(worker, failed, 1)
    assert_never_decreased(clean, failed)
    assert_never_decreased(failed, after)
    assert delta(clean, failed, "llmq:engine_restarts_total") >= 1
    assert delta(clean, failed, "llmq:requests_quarantined_total") == 1
    assert delta(clean, failed, "llmq:request_success_total", finished_reason="error") >= 1
    assert delta(clean, failed, "llmq:generation_tokens_total") == 0
    assert delta(clean, failed, "llmq:request_generation_tokens_sum") == 0
    assert clean.value("llmq:generation_tokens_total") == 5
    assert delta(failed, after, "llmq:generation_tokens_total") == 4
    assert delta(failed, after, "llmq:prompt_tokens_total") == 2
    assert delta(failed, after, "llmq:request_generation_tokens_sum") == 4


# --- 3. backlog seconds ------------------------------------------------------------------------------------------


def backlog(page: Scrape) -> dict[str, float]:
    return {dict(labels)["lane"]: value for labels, value in page.named("llmq:backlog_seconds").items()}


def test_backlog_seconds_is_zero_for_empty_lanes(served: WorkerProcess, two_requests: Any) -> None:
    zeros = {"interactive": 0.0, "default": 0.0, "batch": 0.0}
    wait_for(lambda: backlog(served.scrape()) == zeros, 30, "empty lanes read 0")


def test_backlog_seconds_is_inf_when_nothing_drains_then_finite_then_zero(fleet: Fleet) -> None:
    """A worker stops (SIGSTOP) holding two requests: another worker on the queue, idle, sees backlog and no
    rate: +Inf. New work it drains gives a rate: finite. Once all is done: 0. Never -1, negative or NaN."""
    stalled = fleet.worker("stall", LLMQ_LEASE_TIMEOUT_S="3600", LLMQ_WORKER_ID="stalled")
    stalled.wait_ready()
    seen: list[dict[str, float]] = []

    def read(worker: WorkerProcess) -> dict[str, float]:
        values = backlog(worker.scrape())
        seen.append(values)
        return values

    with fleet.client("stall") as client:
        held = [client.submit(input_ids=[5, 6, 7, 8], max_new_tokens=480, temperature=0, ignore_eos=True)]
        held.append(client.submit(input_ids=[5, 6, 7, 8], max_new_tokens=480, temperature=0, ignore_eos=True))
        wait_for(lambda: stalled.scrape().value("llmq:num_requests_running") == 2, 60, "the two requests running")
        os.kill(stalled.proc.pid, signal.SIGSTOP)
        lane = next(lane for lane in client.status().lanes if lane.lane == "default")
        assert lane.depth == 2 and lane.lag == 0  # both delivered to the stopped worker

        observer = fleet.worker("stall", LLMQ_LEASE_TIMEOUT_S="3600", LLMQ_WORKER_ID="observer")
        observer.wait_ready()
        wait_for(lambda: read(observer)["default"] == math.inf, 30, "+Inf backlog_seconds")
        assert seen[-1]["interactive"] == 0 and seen[-1]["batch"] == 0

        more = [
            client.submit(input_ids=[9, 10, 11], max_new_tokens=480, temperature=0, ignore_eos=True) for _ in range(6)
        ]
        wait_for(lambda: 0 < read(observer)["default"] < math.inf, 60, "a finite backlog_seconds while draining")
        os.kill(stalled.proc.pid, signal.SIGCONT)
        for job in held + more:
            assert len(job.result(timeout=120).token_ids) == 480
        wait_for(lambda: read(observer)["default"] == 0, 30, "backlog_seconds back to 0")
    values = [value for lanes in seen for value in lanes.values()]
    assert not [value for value in values if math.isnan(value) or value < 0]


# --- 5. engine path ------------------------------------------------------------------------------------------------

NATIVE = ("paged_decode", "rms_norm")  # the compiled kernels' components (docs: compiled or fallback)


def engine_paths(page: Scrape) -> dict[str, str]:
    series = page.named("llmq:engine_path")
    assert all(value == 1 for value in series.values())
    paths: dict[str, str] = {}
    for labels in series:
        found = dict(labels)
        assert found["component"] not in paths, f"two series for {found['component']}"
        paths[found["component"]] = found["kernel"]
    return paths


def test_engine_path_reads_compiled_with_the_normal_compiler(served: WorkerProcess) -> None:
    import shutil

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine")
    paths = engine_paths(served.scrape())
    assert {component: paths.get(component) for component in NATIVE} == dict.fromkeys(NATIVE, "compiled")
    assert "unavailable" not in served.output()


@pytest.mark.parametrize("compiler", ["missing", "failing"])
def test_engine_path_reads_fallback_with_a_broken_compiler(fleet: Fleet, compiler: str) -> None:
    import shutil

    cc = str(fleet.root / "no-such-cc") if compiler == "missing" else shutil.which("false")
    if cc is None:
        pytest.skip("no `false` executable")
    worker = fleet.worker(f"cc-{compiler}", kernel_cache=fleet.root / f"fresh-cache-{compiler}", CC=cc)
    page = worker.wait_ready()
    paths = engine_paths(page)
    assert {component: paths.get(component) for component in NATIVE} == dict.fromkeys(NATIVE, "fallback")
    with fleet.client(worker.queue) as client:
        result = client.submit(input_ids=[5, 6, 7], max_new_tokens=5, temperature=0, ignore_eos=True).result(60)
    assert len(result.token_ids) == 5  # the torch path runs
    assert engine_paths(worker.scrape()) == paths
    warnings = [line for line in worker.output().splitlines() if "unavailable" in line]
    assert len(warnings) == len(NATIVE), warnings  # one per kernel
    assert any("RMSNorm" in line for line in warnings) and any("paged-decode" in line for line in warnings)
    if compiler == "missing":
        assert all(cc in line for line in warnings)  # names what is missing
