"""Worker settings: one object, built once at the edge (`service.py`), from `LLMQ_*` environment variables,
an optional `.env` file, and command-line flags (highest priority). Nothing else reads the environment."""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, DotEnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from client.protocol import DEFAULT_PREFIX, LimitSettings
from client.scripts import Routing

# No value here needs torch, so nothing here imports the engine (which imports torch): `python -m worker.health`
# reads these settings every 15 s and must stay cheap. The engine sizing defaults below are `EngineConfig`'s;
# tests/test_imports.py keeps the two equal.


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class KernelBuildSettings(BaseSettings):
    """How the native CPU kernels are built (`worker.engine.kernels`): the machine's own conventions, not `LLMQ_*`
    settings, read from the environment (no `.env`, no flags) whenever a kernel is first built."""

    model_config = SettingsConfigDict(case_sensitive=True, extra="ignore")

    cc: str | None = Field(default=None, validation_alias="CC", description="C compiler (else cc or gcc on PATH)")
    xdg_cache_home: str | None = Field(
        default=None,
        validation_alias="XDG_CACHE_HOME",
        description="built kernels go under <this>/llmq/kernels (else ~/.cache)",
    )


class _WorkerDotEnv(DotEnvSettingsSource):
    """The .env file's lines for the worker: its `LLMQ_*` ones (`dotenv_filtering`), less the gateway's
    `LLMQ_GATEWAY_*`, which a .env shared by both holds too."""

    def _load_env_vars(self) -> dict[str, str | None]:
        gateway = "LLMQ_GATEWAY_" if self.case_sensitive else "llmq_gateway_"
        return {name: value for name, value in super()._load_env_vars().items() if not name.startswith(gateway)}


class Settings(BaseSettings, LimitSettings):
    """Every field is `LLMQ_<NAME>` in the environment and `--<name>` on the command line; the request limits
    (`LimitSettings`) too."""

    model_config = SettingsConfigDict(
        env_prefix="LLMQ_",
        env_file=".env",
        # A .env file may hold other programs' lines (compose's REDIS_PASSWORD, the gateway's LLMQ_GATEWAY_*): only
        # an LLMQ_* line that names no worker setting is refused, as a typo.
        dotenv_filtering="match_prefix",
        extra="forbid",
        cli_kebab_case=True,
        cli_prog_name="llmq-worker",
        cli_implicit_flags=True,
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        assert isinstance(dotenv_settings, DotEnvSettingsSource)
        dotenv = _WorkerDotEnv(settings_cls, env_file=dotenv_settings.env_file)
        return init_settings, env_settings, dotenv, file_secret_settings

    # Redis and the queue
    redis_url: SecretStr = Field(
        SecretStr("redis://localhost:6379/0"),
        description="redis://, rediss://, unix://, redis+cluster://host:port[,host:port...] or "
        "redis+sentinel://host[:port][,...]/<service>[/db] (TLS: rediss+cluster://, rediss+sentinel://)",
    )
    redis_ca_file: Path | None = Field(None, description="CA bundle for rediss:// (TLS)")
    redis_wait_replicas: int = Field(
        0,
        ge=0,
        le=64,
        description="replicas that must acknowledge a claim and a terminal event (WAIT), so no failover loses it",
    )
    queue: str = Field("default", description="queue name; keys are {<prefix>:<queue>}:*")
    prefix: str = Field(DEFAULT_PREFIX, description="key prefix, so deployments can share a Redis")
    queue_partitions: int = Field(
        1, ge=1, le=1024, description="hash slots the queue is spread over (the same in every process of a deployment)"
    )
    worker_id: str = Field(
        default_factory=default_worker_id, description="consumer name in the group (default: <host>-<pid>-<6 hex>)"
    )

    # Model
    model: str = Field("smollm2", description="'smollm2' (offline default), a hub id, a folder or a .gguf file")
    device: str = Field("cpu", description="cpu, cuda, cuda:1, ...")
    dtype: str = Field("auto", description="auto (bfloat16 on CUDA, float32 on CPU), float16, bfloat16, float32")
    attn_implementation: str | None = Field(None, description="e.g. sdpa, flash_attention_2")
    trust_remote_code: bool = Field(False, description="run code shipped with a hub model")
    model_cache_dir: Path = Field(Path.home() / ".cache" / "llmq" / "models", description="converted GGUF models")
    quantize: Literal["none", "int8"] = Field(
        "none", description="int8: int8 weights for batches of up to 32 rows (CPU float32 only; faster decode)"
    )
    float32_few_rows: bool = Field(
        False,
        description="CPU float32: steps of up to 6 rows (16 with AVX-512) multiply with a native kernel, faster; "
        "outputs close to generate's but not bitwise equal",
    )

    # Engine sizing
    kv_cache_tokens: int = Field(16384, ge=16, description="KV cache size in tokens (all requests together)")
    page_size: int = Field(32, ge=4, description="tokens per KV cache block")
    max_batch_tokens: int = Field(512, ge=1, description="tokens per forward step (prefill chunk budget)")
    max_running: int = Field(32, ge=1, description="requests decoding at once; the intake reads no more")
    prefix_sharing: bool = Field(
        True, description="prefix caching: reuse the KV blocks of identical prompt prefixes (computed once)"
    )
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
    affinity_wait_ms: int = Field(
        50,
        ge=0,
        le=60_000,
        description="cache affinity: how long an entry assigned to the worker holding its prefix waits for it before "
        "this worker takes it; 0 turns routing off (the same on every worker)",
    )
    affinity_queue: int = Field(
        8,
        ge=0,
        le=1024,
        description="cache affinity: requests that may wait for a full worker that holds their prompt's start "
        "(it takes them first as slots free); more run wherever a slot is free",
    )
    max_tenants: int = Field(
        10_000,
        ge=1,
        le=1_000_000,
        description="tenants that may submit to each queue partition within an hour; a new one past it is refused "
        "(TenantQuotaExceeded), so made-up tenant names cannot grow Redis without bound",
    )
    idle_tenant_slots: int = Field(
        0,
        ge=0,
        description="free slots each worker keeps for tenants with nothing running (default and batch lanes): a quiet "
        "tenant's request starts at once while another floods the fleet; a flooding tenant runs on the others",
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
    usage_ttl_days: int = Field(
        35, ge=1, le=3650, description="days each hour's usage counts per tenant are kept (`llmq usage`)"
    )
    metrics_port: int = Field(9400, ge=0, le=65535, description="Prometheus /metrics port; 0 turns it off")
    metrics_address: str = Field("0.0.0.0", description="address the metrics endpoint listens on")
    log_format: Literal["console", "json"] = Field("console", description="console for people, json for machines")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="lowest level logged")

    @field_validator("model")
    @classmethod
    def _names_a_model(cls, model: str) -> str:
        if not model.strip():  # else the tokenizer's loader would fail on it, in a traceback about sentencepiece
            raise ValueError("names no model: give 'smollm2', a hub id, a folder or a .gguf file")
        return model

    @model_validator(mode="after")
    def _a_page_fits_the_cache(self) -> Settings:
        if self.page_size > self.kv_cache_tokens:
            raise ValueError(
                f"page_size ({self.page_size}) must not exceed kv_cache_tokens ({self.kv_cache_tokens}): "
                "the cache would hold no page"
            )
        return self

    @model_validator(mode="after")
    def _kept_slots_leave_room(self) -> Settings:
        if self.idle_tenant_slots >= self.max_running:
            raise ValueError(
                f"idle_tenant_slots ({self.idle_tenant_slots}) must be below max_running ({self.max_running}): "
                "a tenant with a request running could never start another"
            )
        return self

    @property
    def routing(self) -> Routing:
        """Cache affinity for the intake: a worker reports at least every read block, so ten of them make it gone."""
        return Routing(self.affinity_wait_ms, max(3000, 10 * self.read_block_ms), queue=self.affinity_queue)
