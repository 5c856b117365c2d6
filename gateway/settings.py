"""Gateway settings: one object, built once at the edge (`__main__`), from `LLMQ_GATEWAY_*` environment
variables, an optional `.env` file, and command-line flags (highest priority). Nothing else reads the
environment."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from client.connection import parse_url
from client.errors import TenantQuotaExceeded
from client.protocol import DEFAULT_PREFIX, MAX_RESULT_TTL_S, LimitSettings
from gateway.tenants import TenantKeys, load_tenants


class GatewaySettings(BaseSettings, LimitSettings):
    """Every field is `LLMQ_GATEWAY_<NAME>` in the environment and `--<name>` on the command line."""

    model_config = SettingsConfigDict(
        env_prefix="LLMQ_GATEWAY_",
        env_file=".env",
        extra="ignore",  # the .env file may hold the workers' LLMQ_* settings too
        cli_kebab_case=True,
        cli_prog_name="llmq-gateway",
        cli_implicit_flags=True,
    )

    # HTTP
    host: str = Field(default="0.0.0.0", description="address to listen on")
    port: int = Field(default=8000, ge=0, le=65535, description="port to listen on")
    api_keys: SecretStr | None = Field(
        default=None, description="comma-separated bearer keys; when set, every /v1 request needs one (401 otherwise)"
    )
    tenants_file: Path | None = Field(
        default=None,
        description="JSON file: tenant -> {keys, weight, limits, retry_after_s}; each key acts for its tenant only "
        "(docs/tenants.md)",
    )
    ssl_certfile: Path | None = Field(default=None, description="TLS certificate (PEM); with ssl_keyfile, serve https")
    ssl_keyfile: Path | None = Field(default=None, description="TLS private key (PEM)")
    max_body_bytes: int = Field(default=4_000_000, ge=1024, description="larger request bodies get 413")
    request_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="default deadline and wait of a request (the X-Request-Timeout header lowers it)",
    )
    retry_after_s: int = Field(default=1, ge=0, description="Retry-After of a 429 (queue full)")

    # Redis and the queues
    redis_url: SecretStr = Field(
        default=SecretStr("redis://localhost:6379/0"), description="a Redis URL, of any form the worker's takes"
    )
    redis_ca_file: Path | None = Field(default=None, description="CA bundle for rediss:// (TLS)")
    prefix: str = Field(default=DEFAULT_PREFIX, description="key prefix of the deployment")
    queues: str = Field(default="default", description="comma-separated queues whose workers' models are served")
    queue_partitions: int = Field(
        default=1, ge=1, le=1024, description="partitions of each queue, as the workers' LLMQ_QUEUE_PARTITIONS"
    )
    max_queue_len: int = Field(default=10000, ge=0, description="backlog at which a request gets 429 (0 = no limit)")
    result_ttl_s: int = Field(
        default=3600, ge=1, le=MAX_RESULT_TTL_S, description="seconds a result outlives its last write"
    )
    redis_max_connections: int = Field(default=32, ge=2, description="Redis connections held for all requests together")
    redis_wait_replicas: int = Field(
        default=0,
        ge=0,
        le=64,
        description="replicas that must acknowledge each submission (WAIT) before it is accepted",
    )
    redis_failover_timeout_s: float = Field(
        default=5.0,
        ge=0,
        le=3600,
        description="how long a request's Redis calls retry while Redis is away before a 503",
    )
    worker_stale_s: float = Field(default=15.0, gt=0, description="a worker silent this long no longer lists its model")
    models_refresh_s: float = Field(
        default=2.0,
        ge=0,
        description="how long the model -> queue map is reused (one with no live worker is read again at once)",
    )

    # The Batch API (/v1/files, /v1/batches): files, batches and their results are kept in Redis.
    batch_file_max_bytes: int = Field(
        default=50_000_000, ge=1024, le=512_000_000, description="largest file /v1/files accepts (413 beyond)"
    )
    batch_max_lines: int = Field(default=50_000, ge=1, le=1_000_000, description="most requests in one batch")
    batch_output_max_bytes: int = Field(
        default=200_000_000,
        ge=1024,
        le=512_000_000,  # one Redis string
        description="largest output (or error) file a batch writes: beyond, the batch fails with output_too_large",
    )
    batch_ttl_s: int = Field(
        default=7 * 24 * 3600,
        ge=60,
        le=365 * 24 * 3600,
        description="seconds a file or a finished batch (with its output) stays in Redis after its last change",
    )
    batch_lease_s: float = Field(
        default=30.0,
        ge=0.5,
        le=3600,
        description="a batch's lease: a batch whose gateway died is picked up by another this long after",
    )
    batch_window: int = Field(default=64, ge=1, le=10_000, description="requests of one batch in flight at once")
    batch_max_running: int = Field(
        default=4, ge=0, le=1000, description="batches one gateway drives at once (0: it only answers HTTP)"
    )
    batch_poll_s: float = Field(default=1.0, gt=0, le=60, description="how often a gateway looks for batches to drive")

    log_format: Literal["console", "json"] = Field(
        default="console", description="console for people, json for machines"
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="lowest level logged")

    # Refused here, as bad values of their flags, rather than by uvicorn or the first request after start-up.

    @field_validator("redis_url")
    @classmethod
    def _a_redis_url(cls, url: SecretStr) -> SecretStr:
        parse_url(url.get_secret_value())  # its ValueError shows no password
        return url

    @field_validator("ssl_certfile", "ssl_keyfile", "redis_ca_file", "tenants_file")
    @classmethod
    def _an_existing_file(cls, path: Path | None) -> Path | None:
        if path is not None and not path.is_file():
            raise ValueError(f"no file at {path}")
        return path

    @field_validator("api_keys")
    @classmethod
    def _some_key(cls, keys: SecretStr | None) -> SecretStr | None:
        if keys is not None and not any(key.strip() for key in keys.get_secret_value().split(",")):
            raise ValueError("names no key (leave it unset for an API without authentication)")
        return keys

    @property
    def queue_names(self) -> list[str]:
        return [name.strip() for name in self.queues.split(",") if name.strip()]

    @field_validator("tenants_file")
    @classmethod
    def _tenants(cls, path: Path | None) -> Path | None:
        if path is not None:
            load_tenants(path)  # checked whole at start: its ValueError names what is wrong, never a key
        return path

    @cached_property
    def tenants(self) -> TenantKeys:
        """The tenants file's keys, weights and quotas (none without one)."""
        return TenantKeys([]) if self.tenants_file is None else load_tenants(self.tenants_file)

    def retry_after_for(self, error: BaseException) -> int:
        """Retry-After of a 429 for `error`: the tenant's own when its quota refused it and the tenants file sets
        one, else `retry_after_s`."""
        if isinstance(error, TenantQuotaExceeded):
            return self.tenants.retry_after_s.get(error.tenant, self.retry_after_s)
        return self.retry_after_s

    @property
    def key_tenants(self) -> list[tuple[bytes, str | None]]:
        """Every API key, as bytes for `hmac.compare_digest`, with the tenant it acts for (None: the default);
        empty = no authentication."""
        plain: list[tuple[bytes, str | None]] = []
        if self.api_keys is not None:
            plain = [(k.strip().encode(), None) for k in self.api_keys.get_secret_value().split(",") if k.strip()]
        return [*plain, *self.tenants.keys]

    @property
    def keys(self) -> list[bytes]:
        """The API keys alone; empty = no authentication."""
        return [key for key, _ in self.key_tenants]
