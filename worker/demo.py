"""`make run`: the whole service on one machine, nothing prepared.

Starts an embedded Redis, one worker on the offline default model (SmolLM2-135M-Instruct), submits a few
chat prompts through the client at once (they share the worker's batch), streams each answer to the
terminal, and stops every process it started, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from client import Client
from worker.embedded_redis import RedisServer

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about a queue of patient requests.",
    "Explain continuous batching in one sentence.",
]


@contextlib.contextmanager
def embedded_redis(workdir: Path) -> Iterator[RedisServer]:
    server = RedisServer(workdir / "redis").start()
    print(f"redis: started {server.binary} on port {server.port} (embedded, removed on exit)")
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def worker_process(url: str, model: str, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    command = [
        sys.executable,
        "-m",
        "worker",
        "--redis-url",
        url,
        "--model",
        model,
        "--heartbeat-s",
        "0.5",
        "--log-format",
        "json",
        "--metrics-port",
        "0",
    ]
    with log.open("wb") as sink:
        # Its own session: Ctrl-C reaches only us, and we stop the worker before Redis, in order.
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    print(f"worker: pid {process.pid}, model {model}, log {log}")
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def wait_until_ready(client: Client, process: subprocess.Popen[bytes], log: Path) -> None:
    """Shows progress while the worker loads the model (the first run converts the GGUF file once)."""
    start = time.monotonic()
    while not client.status().workers:
        if process.poll() is not None:
            sys.exit(f"the worker exited while starting:\n{log.read_text()[-3000:]}")
        last = _last_line(log)
        print(f"\rloading model... {time.monotonic() - start:5.1f} s  {last[:70]:<70}", end="", flush=True)
        time.sleep(0.5)
    print(f"\rworker ready after {time.monotonic() - start:.1f} s{' ' * 80}")


def _last_line(log: Path) -> str:
    """The worker's latest log event (its JSON lines), for the progress line."""
    for line in reversed(log.read_text(errors="replace").splitlines()):
        with contextlib.suppress(ValueError):
            return str(json.loads(line).get("event", ""))
    return ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' (offline default), a folder, a .gguf file")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("prompts", nargs="*", help="prompts to ask (default: three examples)")
    args = parser.parse_args(argv)
    # Ctrl-C and SIGTERM both clean up, even when started with SIGINT ignored (as a background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    workdir = Path(tempfile.mkdtemp(prefix="llmq-run-"))
    try:
        with (
            embedded_redis(workdir) as server,
            worker_process(server.url, args.model, workdir / "worker.log") as process,
            Client(server.url) as client,
        ):
            wait_until_ready(client, process, workdir / "worker.log")
            jobs = [
                client.submit(
                    messages=[{"role": "user", "content": p}], max_new_tokens=args.max_new_tokens, temperature=0
                )
                for p in args.prompts or PROMPTS
            ]
            for prompt, job in zip(args.prompts or PROMPTS, jobs, strict=True):
                print(f"\n> {prompt}\n", flush=True)
                for delta in job.stream(timeout=300):
                    print(delta.text, end="", flush=True)
                print(f"\n[{job.finish_reason}]")
            status = client.status()
            print(f"\nqueue depth {status.depth}, pending {status.pending}; stopping worker and redis")
    except KeyboardInterrupt:
        print("\ninterrupted: stopping worker and redis")


if __name__ == "__main__":
    main()
