"""Worker settings: one object, built once at the edge (`service.py`), from `LLMQ_*` environment variables,
an optional `.env` file, and command-line flags (highest priority). Nothing else reads the environment."""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from client.protocol import DEFAULT_PREFIX, LimitSettings
from worker.engine import EngineConfig

_ENGINE = EngineConfig()  # the engine's sizing defaults are the settings' defaults


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Settings(BaseSettings, LimitSettings):
    """Every field is `LLMQ_<NAME>` in the environment and `--<name>` on the command line; the request limits
    (`LimitSettings`) too."""

    model_config = SettingsConfigDict(
        env_prefix="LLMQ_",
        env_file=".env",
        extra="forbid",
        cli_kebab_case=True,
        cli_prog_name="llmq-worker",
        cli_implicit_flags=True,
    )

    # Redis and the queue
    redis_url: SecretStr = Field(
        SecretStr("redis://localhost:6379/0"),
        description="redis://, rediss://, unix://, redis+cluster://host:port[,host:port...] or "
        "redis+sentinel://host[:port][,...]/<service>[/db] (TLS: rediss+cluster://, rediss+sentinel://)",
    )
    redis_ca_file: Path | None = Field(None, description="CA bundle for rediss:// (TLS)")
    queue: str = Field("default", description="queue name; keys are {<prefix>:<queue>}:*")
    prefix: str = Field(DEFAULT_PREFIX, description="key prefix, so deployments can share a Redis")
    worker_id: str = Field(default_factory=default_worker_id, description="consumer name in the group")

    # Model
    model: str = Field("smollm2", description="'smollm2' (offline default), a hub id, a folder or a .gguf file")
    device: str = Field("cpu", description="cpu, cuda, cuda:1, ...")
    dtype: str = Field("auto", description="auto (bfloat16 on CUDA, float32 on CPU), float16, bfloat16, float32")
    attn_implementation: str | None = Field(None, description="e.g. sdpa, flash_attention_2")
    trust_remote_code: bool = Field(False, description="run code shipped with a hub model (off unless set)")
    model_cache_dir: Path = Field(Path.home() / ".cache" / "llmq" / "models", description="converted GGUF models")
    quantize: Literal["none", "int8"] = Field(
        "none", description="int8: int8 weights for batches of up to 32 rows (CPU float32 only; faster decode)"
    )

    # Engine sizing
    kv_cache_tokens: int = Field(
        _ENGINE.kv_cache_tokens, ge=16, description="KV cache size in tokens (all requests together)"
    )
    page_size: int = Field(_ENGINE.page_size, ge=4, description="tokens per KV cache block")
    max_batch_tokens: int = Field(
        _ENGINE.max_batch_tokens, ge=1, description="tokens per forward step (prefill chunk budget)"
    )
    max_running: int = Field(
        _ENGINE.max_running, ge=1, description="requests decoding at once; the intake reads no more"
    )
    prefix_sharing: bool = Field(_ENGINE.prefix_sharing, description="share KV blocks of identical prompt prefixes")
    seed: int | None = Field(None, description="seed for sampling (per engine)")

    # Service
    read_block_ms: int = Field(500, ge=1, description="XREADGROUP BLOCK; also how fast a stop is noticed")
    heartbeat_s: float = Field(2.0, gt=0, description="how often the worker publishes its stats")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, how long requests in flight may finish")
    lease_timeout_s: float = Field(15.0, gt=0, description="a request idle this long (its worker died) is claimed")
    lease_renew_s: float = Field(2.0, gt=0, description="how often a worker renews the leases of its requests")
    claim_interval_s: float = Field(1.0, gt=0, description="how often a worker looks for requests to claim")
    max_deliveries: int = Field(3, ge=1, description="claims after which a request goes to the dead letters")
    max_engine_failures: int = Field(
        2, ge=1, description="engine failures a request may be implicated in before it is quarantined"
    )
    max_hand_backs: int = Field(
        10, ge=0, description="hand-backs (shutdowns, engine failures) that do not count as deliveries"
    )
    lane_share: float = Field(
        0.1, ge=0, le=0.5, description="share of max_running each lower lane (default, batch) keeps while it has work"
    )
    preemption: bool = Field(True, description="hand back lower-lane requests to start a waiting interactive one")
    max_preemptions: int = Field(3, ge=0, description="times one request may be preempted; then it runs to the end")
    max_buffered_events: int = Field(100_000, ge=1, description="events held while Redis is down; then intake pauses")
    health_file: Path = Field(
        Path(tempfile.gettempdir()) / "llmq-worker.health",
        description="touched each heartbeat while Redis answers and the engine runs (`python -m worker.health`)",
    )
    dead_letter_maxlen: int = Field(10000, ge=1, description="dead-letter stream is trimmed to about this")
    reply_maxlen: int = Field(100_000, ge=1, description="each reply_to stream is trimmed to about this")
    metrics_port: int = Field(9400, ge=0, le=65535, description="Prometheus /metrics port; 0 turns it off")
    metrics_address: str = Field("0.0.0.0", description="address the metrics endpoint listens on")
    log_format: Literal["console", "json"] = "console"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
