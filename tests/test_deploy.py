"""No Docker engine runs here: the compose file and the Dockerfile are parsed and checked instead."""

from __future__ import annotations

import re
import time
from pathlib import Path

import yaml

from worker.config import Settings
from worker.health import check

ROOT = Path(__file__).parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()
SETTING_ENV = {f"LLMQ_{name.upper()}" for name in Settings.model_fields}


def seconds(value: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(s|m)", value).groups()  # type: ignore[union-attr]
    return float(number) * (60 if unit == "m" else 1)


def test_services_and_profiles() -> None:
    services = COMPOSE["services"]
    assert {"redis", "worker", "worker-cuda", "prometheus", "grafana"} <= set(services)
    assert "profiles" not in services["worker"] and "profiles" not in services["redis"]
    assert services["worker-cuda"]["profiles"] == ["cuda"]
    assert services["prometheus"]["profiles"] == services["grafana"]["profiles"] == ["monitoring"]


def test_redis_keeps_data_and_never_evicts() -> None:
    command = " ".join(COMPOSE["services"]["redis"]["command"])
    assert "--appendonly yes" in command and "--appendfsync everysec" in command
    assert "--maxmemory-policy noeviction" in command
    assert "healthcheck" in COMPOSE["services"]["redis"]


def test_workers_scale_and_drain_before_being_killed() -> None:
    for name in ("worker", "worker-cuda"):
        worker = COMPOSE["services"][name]
        assert worker["deploy"]["replicas"] >= 1
        drain = float(worker["environment"]["LLMQ_DRAIN_TIMEOUT_S"])
        assert seconds(worker["stop_grace_period"]) > drain, name
        assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
        assert worker["environment"]["LLMQ_REDIS_URL"].startswith("redis://redis:")
        assert any(volume.endswith(":/models") for volume in worker["volumes"])


def test_cuda_worker_reserves_a_gpu() -> None:
    devices = COMPOSE["services"]["worker-cuda"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert COMPOSE["services"]["worker-cuda"]["environment"]["LLMQ_DEVICE"] == "cuda"


def test_environment_names_are_settings() -> None:
    names = {n for s in COMPOSE["services"].values() for n in s.get("environment", {}) if n.startswith("LLMQ_")}
    names |= set(re.findall(r"\b(LLMQ_[A-Z_]+)=", DOCKERFILE))
    assert names and names <= SETTING_ENV, names - SETTING_ENV


def test_dockerfile_runs_as_non_root_with_a_health_check() -> None:
    for target in ("cpu", "cuda"):
        stage = DOCKERFILE.split(f"AS {target}\n", 1)[1].split("\nFROM ", 1)[0]
        assert re.search(r"^USER llmq$", stage, re.M), target
        assert "HEALTHCHECK" in stage and '"worker.health"' in stage, target
        assert 'ENTRYPOINT ["llmq-worker"]' in stage and "VOLUME /models" in stage, target
    assert DOCKERFILE.rstrip().endswith("FROM cpu")  # the default image is the small CPU one


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
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    (job,) = prometheus["scrape_configs"]
    assert job["dns_sd_configs"][0]["port"] == Settings.model_fields["metrics_port"].default
