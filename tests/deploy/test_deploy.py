"""No Docker engine runs here: the compose file is parsed and checked instead, with its `${VAR:-default}`
variables filled in as compose fills them (the Dockerfile's checks are in test_dockerfile.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.deploy.support import COMPOSE_FILE, ROOT, gateway_settings_env
from worker.config import Settings
from worker.health import check

COMPOSE = yaml.safe_load(COMPOSE_FILE.read_text())
SETTING_ENV = {f"LLMQ_{name.upper()}" for name in Settings.model_fields}
# The services that talk to Redis, and where each finds its URL or password.
REDIS_CLIENTS = {"worker": "LLMQ_REDIS_URL", "worker-cuda": "LLMQ_REDIS_URL", "gateway": "LLMQ_GATEWAY_REDIS_URL"}


def seconds(value: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(s|m)", value).groups()  # type: ignore[union-attr]
    return float(number) * (60 if unit == "m" else 1)


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """`value` with compose's variables filled from `env`: `${VAR}`, `${VAR:-default}` (default when unset or
    empty), `${VAR-default}` (when unset) and `$$` (a literal `$`)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def fill(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, operator, default = match.group(1), match.group(2), match.group(3) or ""
        if operator == ":-":
            return env.get(name) or default
        if operator == "-":
            return env.get(name, default)
        assert name in env, f"${{{name}}} has no default"
        return env[name]

    return re.sub(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:-|-)([^}]*))?\}", fill, value)


def services(env: dict[str, str] | None = None) -> dict[str, Any]:
    return interpolate(COMPOSE, env or {})["services"]


def test_interpolation_is_compose_s() -> None:
    assert interpolate("a${X:-d}b${Y-e}$$", {}) == "adbe$"
    assert interpolate("${X:-d}|${X-e}", {"X": ""}) == "d|"
    assert interpolate(["${X:-d}"], {"X": "v"}) == ["v"]


def test_services_and_profiles() -> None:
    found = COMPOSE["services"]
    assert {"redis", "worker", "gateway", "worker-cuda", "prometheus", "grafana", "redis-exporter"} <= set(found)
    for name in ("redis", "worker", "gateway"):  # `docker compose up` starts these
        assert "profiles" not in found[name], name
    assert found["worker-cuda"]["profiles"] == ["cuda"]
    for name in ("prometheus", "grafana", "redis-exporter"):
        assert found[name]["profiles"] == ["monitoring"], name


def test_redis_keeps_data_and_never_evicts() -> None:
    command = " ".join(services()["redis"]["command"])
    assert "--appendonly yes" in command and "--appendfsync everysec" in command
    assert "--maxmemory-policy noeviction" in command
    assert "healthcheck" in COMPOSE["services"]["redis"]


def test_redis_is_reachable_only_on_the_internal_network() -> None:
    redis = COMPOSE["services"]["redis"]
    assert "ports" not in redis and "expose" not in redis, "Redis must publish no port"
    assert redis["networks"] == ["redis"]
    assert COMPOSE["networks"]["redis"]["internal"] is True
    joined = {name for name, service in COMPOSE["services"].items() if "redis" in service.get("networks", [])}
    assert joined == {"redis", *REDIS_CLIENTS, "redis-exporter"}
    # The clients also keep the default network: the gateway's port, Prometheus's scrapes, model downloads.
    for name in (*REDIS_CLIENTS, "redis-exporter"):
        assert "default" in COMPOSE["services"][name]["networks"], name


def redis_password(found: dict[str, Any]) -> str:
    command = found["redis"]["command"]
    return command[command.index("--requirepass") + 1]


@pytest.mark.parametrize("env", [{}, {"REDIS_PASSWORD": "s3cret-from-env"}], ids=["default", "REDIS_PASSWORD"])
def test_every_redis_client_carries_the_password(env: dict[str, str]) -> None:
    """Out of the box (the documented default) and with REDIS_PASSWORD set, every client logs in with what Redis
    requires."""
    found = services(env)
    password = redis_password(found)
    assert password == env.get("REDIS_PASSWORD", "llmq-compose")
    for name, variable in REDIS_CLIENTS.items():
        url = urlsplit(found[name]["environment"][variable])
        assert (url.scheme, url.hostname, url.port, url.path) == ("redis", "redis", 6379, "/0"), name
        assert url.password == password, name
        assert "command" not in found[name] or "--redis-url" not in found[name]["command"], name
    exporter = found["redis-exporter"]["environment"]
    assert urlsplit(exporter["REDIS_ADDR"]).hostname == "redis" and exporter["REDIS_PASSWORD"] == password
    assert found["redis"]["environment"]["REDISCLI_AUTH"] == password  # the health check logs in


def test_the_default_password_is_documented() -> None:
    docs = (ROOT / "docs" / "operations" / "scale-out.md").read_text()
    default = redis_password(services())
    assert f"`{default}`" in docs and "REDIS_PASSWORD" in docs
    assert "REDIS_PASSWORD" in COMPOSE_FILE.read_text().split("x-redis-password")[0]  # the header explains it


def test_the_health_check_wants_a_pong() -> None:
    """redis-cli exits 0 on an error reply (NOAUTH, LOADING): the check must look for PONG itself."""
    test = COMPOSE["services"]["redis"]["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL" and "redis-cli ping" in test[1] and "PONG" in test[1]


def test_workers_scale_and_drain_before_being_killed() -> None:
    for name in ("worker", "worker-cuda"):
        worker = services()[name]
        assert worker["deploy"]["replicas"] >= 1
        drain = float(worker["environment"]["LLMQ_DRAIN_TIMEOUT_S"])
        assert seconds(worker["stop_grace_period"]) > drain, name
        assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
        assert any(volume.endswith(":/models") for volume in worker["volumes"])


def test_the_gateway_waits_for_redis_and_publishes_its_port() -> None:
    gateway = services()["gateway"]
    assert gateway["depends_on"]["redis"]["condition"] == "service_healthy"
    assert gateway["ports"] == ["8000:8000"]
    assert gateway["environment"]["LLMQ_GATEWAY_QUEUES"] == services()["worker"]["environment"]["LLMQ_QUEUE"]


def test_cuda_worker_reserves_a_gpu() -> None:
    devices = COMPOSE["services"]["worker-cuda"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert COMPOSE["services"]["worker-cuda"]["environment"]["LLMQ_DEVICE"] == "cuda"


def test_environment_names_are_settings() -> None:
    for name, service in COMPOSE["services"].items():
        names = {n for n in service.get("environment", {}) if n.startswith("LLMQ_")}
        known = gateway_settings_env() if name == "gateway" else SETTING_ENV
        assert names <= known, (name, names - known)
    dockerfile = (ROOT / "Dockerfile").read_text()
    names = set(re.findall(r"\b(LLMQ_[A-Z_]+)=", dockerfile))
    assert names and names <= SETTING_ENV, names - SETTING_ENV


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_compose_itself_accepts_the_file() -> None:
    """Where a compose binary is at hand, it reads the file with every profile and fills the same password."""
    out = subprocess.run(
        ["docker-compose", "--profile", "monitoring", "--profile", "cuda", "config"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "REDIS_PASSWORD": "from-env"},
    )
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    assert redis_password(config["services"]) == "from-env"
    assert urlsplit(config["services"]["gateway"]["environment"]["LLMQ_GATEWAY_REDIS_URL"]).password == "from-env"


def test_health_check_follows_the_heartbeat_file(tmp_path: Path) -> None:
    settings = Settings(_env_file=None, health_file=tmp_path / "health", heartbeat_s=1.0)
    assert "no heartbeat" in (check(settings) or "")
    settings.health_file.write_text(str(int(time.time() * 1000)))
    assert check(settings) is None
    settings.health_file.write_text(str(int(time.time() * 1000) - 60_000))
    assert "ago" in (check(settings) or "")


def test_grafana_dashboard_charts_every_worker_metric() -> None:
    import json

    from worker import metrics

    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/llmq.json").read_text())
    exprs = " ".join(t["expr"] for panel in dashboard["panels"] for t in panel["targets"])
    defined = set(re.findall(r'"(llmq:[a-z_]+)"', (ROOT / "worker/metrics.py").read_text()))
    assert metrics.__name__ and defined
    for name in defined - {"llmq:kv_cache_blocks_total", "llmq:engine_steps"}:
        assert name in exprs, f"no panel for {name}"
    for quantile in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({quantile}, sum by (le) (rate(llmq:batch_fill_ratio_bucket" in exprs
    provisioning = ROOT / "deploy/grafana"
    assert (provisioning / "datasources/prometheus.yml").exists() and (
        provisioning / "dashboards/provider.yml"
    ).exists()
