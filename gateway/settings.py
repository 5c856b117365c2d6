"""Gateway settings: one object, built once at the edge (`__main__`), from `LLMQ_GATEWAY_*` environment
variables, an optional `.env` file, and command-line flags (highest priority). Nothing else reads the
environment."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from client.protocol import DEFAULT_PREFIX, MAX_RESULT_TTL_S, LimitSettings


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
    max_queue_len: int = Field(default=10000, ge=0, description="backlog at which a request gets 429 (0 = no limit)")
    result_ttl_s: int = Field(
        default=3600, ge=1, le=MAX_RESULT_TTL_S, description="seconds a result outlives its last write"
    )
    redis_max_connections: int = Field(default=32, ge=2, description="Redis connections held for all requests together")
    worker_stale_s: float = Field(default=15.0, gt=0, description="a worker silent this long no longer lists its model")
    models_refresh_s: float = Field(default=2.0, ge=0, description="how long the model -> queue map is reused")

    log_format: Literal["console", "json"] = "console"
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @property
    def queue_names(self) -> list[str]:
        return [name.strip() for name in self.queues.split(",") if name.strip()]

    @property
    def keys(self) -> list[bytes]:
        """The API keys, as bytes for `hmac.compare_digest`; empty = no authentication."""
        if self.api_keys is None:
            return []
        return [key.strip().encode() for key in self.api_keys.get_secret_value().split(",") if key.strip()]
