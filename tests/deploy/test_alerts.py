"""The alert rules (deploy/prometheus/alerts.yml) and the Prometheus setups that load them: compose's
(deploy/prometheus/prometheus.yml) and the Prometheus Operator's (the monitoring component's PrometheusRule and
ServiceMonitors). Every metric a rule reads is one the workers or the gateway export, under the job names both
setups give their targets; where `promtool` is on PATH it checks the files and runs the rules' unit tests
(tests/deploy/alerts_test.yml)."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from client.store import LaneStatus, QueueStatus
from gateway.metrics import GatewayMetrics
from gateway.settings import GatewaySettings
from testing.scripted_engine import ScriptedEngine
from tests.deploy.support import (
    ALERTS,
    COMPOSE_FILE,
    MONITORING,
    OPERATOR_KINDS,
    PROMETHEUS_CONFIG,
    Obj,
    alert_rules,
    named,
    one,
    operator_validator,
    rendered,
    schema_errors,
    selects,
)
from worker.metrics import Metrics
from worker.publisher import PublisherStats

ALERTS_TEST = Path(__file__).with_name("alerts_test.yml")
PROMTOOL = shutil.which("promtool") or "promtool"
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
# The alerts issue 29 asks for, and the metric each one reads.
REQUIRED = {
    "LLMQNoLiveWorker": "up",
    "LLMQBacklogHigh": "llmq:backlog_seconds",
    "LLMQDeadLetters": "llmq:dead_letters_total",
    "LLMQKVCacheFull": "llmq:kv_cache_usage_perc",
    "LLMQEngineRestarts": "llmq:engine_restarts_total",
    "LLMQGatewayDown": "up",
}
JOBS = {"llmq-worker", "llmq-gateway"}
PROMETHEUS_BUILT_IN = {"up"}  # series Prometheus writes for every target itself
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless"}
DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


def rules() -> list[Obj]:
    return [rule for group in alert_rules()["groups"] for rule in group["rules"]]


# --- what the code exports ---------------------------------------------------------------------------------------


def _sample_names(family: Any) -> set[str]:
    """The series names of a family, also where it has no sample yet (labelled metrics nobody set)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count")}
    names = {sample.name for sample in family.samples}
    return names | {family.name + suffix for suffix in suffixes.get(family.type, ("",))}


@cache
def exported() -> dict[str, set[str]]:
    """Every series name a worker or a gateway exports, with the label names it carries, read from a scrape."""
    worker = Metrics(ScriptedEngine(), "default", "smollm2")
    worker.watch_publisher(PublisherStats())
    lane = LaneStatus(
        "default", depth=1, pending=0, lag=1, oldest_pending_age_s=None, backlog_tokens=9, backlog_seconds=1.0
    )
    worker.set_queue(QueueStatus("default", depth=1, pending=0, lag=1, dead=0, lanes=[lane]))
    labels: dict[str, set[str]] = {}
    for registry in (worker.registry, GatewayMetrics().registry):
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for name in _sample_names(family):
                labels.setdefault(name, set())
            for sample in family.samples:
                labels.setdefault(sample.name, set()).update(sample.labels)
    return labels


def _strip(expr: str) -> str:
    """The expression without strings, label matchers, ranges and grouping clauses: what is left names metrics,
    functions and operators."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    return re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)


def metric_names(expr: str) -> set[str]:
    stripped = _strip(expr)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", stripped):
        following = stripped[match.end() :].lstrip()
        if match.group() not in PROMQL_WORDS and not following.startswith("("):
            names.add(match.group())
    return names


def grouping_labels(expr: str) -> set[str]:
    return {
        label.strip()
        for clause in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
        for label in clause.split(",")
        if label.strip()
    }


def balanced(expr: str) -> bool:
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    for char in re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr):
        if char in "([{":
            stack.append(char)
        elif char in pairs and (not stack or stack.pop() != pairs[char]):
            return False
    return not stack


def test_the_parser_finds_metric_names() -> None:
    """The helpers below are not vacuous."""
    expr = 'sum by (queue) (increase(llmq:dead_letters_total{lane="a b"}[15m])) > 0 and on (queue) up == 1'
    assert metric_names(expr) == {"llmq:dead_letters_total", "up"}
    assert grouping_labels(expr) == {"queue"}
    assert balanced(expr) and not balanced("sum(rate(x[5m])")


# --- the rules file ----------------------------------------------------------------------------------------------


def test_every_required_alert_is_there_and_reads_its_metric() -> None:
    by_name = {rule["alert"]: rule for rule in rules()}
    assert len(by_name) == len(rules()), "alert names must be unique"
    for alert, metric in REQUIRED.items():
        assert metric in metric_names(by_name[alert]["expr"]), alert


def test_every_rule_is_complete() -> None:
    assert [group["name"] for group in alert_rules()["groups"]] == ["llmq"]
    for rule in rules():
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert re.fullmatch(r"LLMQ[A-Za-z]+", rule["alert"])
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]
        assert "for" not in rule or DURATION.match(rule["for"]), rule["alert"]
        assert balanced(rule["expr"]), rule["alert"]


def test_rules_read_only_exported_metrics_and_labels() -> None:
    """A renamed metric would leave its alert silent forever: every name a rule reads is one a worker or the
    gateway exports (or Prometheus's own `up`), and every label it groups by is on that metric."""
    labels = exported()
    for rule in rules():
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        unknown = names - set(labels) - PROMETHEUS_BUILT_IN
        assert not unknown, f"{rule['alert']} reads {unknown}, which nothing exports"
        for label in grouping_labels(rule["expr"]):
            assert any(label in labels.get(name, set()) for name in names), (rule["alert"], label)
        for label in re.findall(r"\$labels\.([a-z_]+)", str(rule["annotations"])):
            grouped = grouping_labels(rule["expr"])
            kept = grouped or set().union(*(labels.get(n, set()) for n in names)) | {"instance", "job"}
            assert label in kept, (rule["alert"], label)


def test_up_rules_name_the_jobs_both_setups_scrape() -> None:
    jobs = {job for rule in rules() for job in re.findall(r'up\{job="([^"]+)"\}', rule["expr"])}
    assert jobs == JOBS
    compose_jobs = {job["job_name"] for job in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]}
    assert compose_jobs >= JOBS
    assert set(service_monitor_jobs().values()) == JOBS


@needs_promtool
def test_promtool_accepts_the_rules() -> None:
    out = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def render_annotations(rule: Obj, labels: dict[str, str]) -> dict[str, str]:
    """The rule's annotations for an alert with `labels`, as Prometheus renders the `$labels` templates we use."""
    out = {}
    for name, template in rule["annotations"].items():
        text = re.sub(r"\{\{\s*\$labels\.([a-z_]+)\s*\}\}", lambda m: labels[m.group(1)], template)
        assert "{{" not in text, f"{rule['alert']}: only $labels templates are rendered here"
        out[name] = text
    return out


@needs_promtool
def test_the_rules_fire_when_they_should_and_only_then(tmp_path: Path) -> None:
    by_name = {rule["alert"]: rule for rule in rules()}
    cases = yaml.safe_load(ALERTS_TEST.read_text())
    tested = set()
    for case in cases["tests"]:
        for check in case["alert_rule_test"]:
            tested.add(check["alertname"])
            for alert in check["exp_alerts"]:
                alert["exp_annotations"] = render_annotations(by_name[check["alertname"]], alert["exp_labels"])
    assert tested == set(by_name), "every alert needs a unit test"
    filled = copy.deepcopy(cases)
    filled["rule_files"] = [str(ALERTS)]
    path = tmp_path / "alerts_test.yml"
    path.write_text(yaml.safe_dump(filled))
    out = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# --- compose's Prometheus ----------------------------------------------------------------------------------------


def test_compose_prometheus_loads_the_rules_and_scrapes_every_part() -> None:
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    compose = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    # rule_files resolve against the config's directory: the mounts put both files in /etc/prometheus.
    mounts = dict(volume.rsplit(":", 1)[0].split(":", 1) for volume in compose["prometheus"]["volumes"])
    assert mounts["./deploy/prometheus/prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    for rule_file in config["rule_files"]:
        assert mounts[f"./deploy/prometheus/{rule_file}"] == f"/etc/prometheus/{rule_file}"
        assert (PROMETHEUS_CONFIG.parent / rule_file).resolve() == ALERTS
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == JOBS | {"redis"}
    (workers,) = jobs["llmq-worker"]["dns_sd_configs"]
    assert set(workers["names"]) == {"worker", "worker-cuda"} and workers["port"] == 9400
    (gateways,) = jobs["llmq-gateway"]["dns_sd_configs"]
    assert gateways["names"] == ["gateway"]
    assert gateways["port"] == GatewaySettings.model_fields["port"].default
    (exporter,) = jobs["redis"]["static_configs"]
    host, port = exporter["targets"][0].split(":")
    assert host in compose and compose[host]["image"].startswith("oliver006/redis_exporter:") and port == "9121"
    for service in ("worker", "worker-cuda", "gateway", host):
        assert service in compose, service


def test_worker_scrape_port_is_the_metrics_default() -> None:
    from worker.config import Settings

    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "llmq-worker"]
    assert job["dns_sd_configs"][0]["port"] == Settings.model_fields["metrics_port"].default


@needs_promtool
def test_promtool_accepts_the_compose_config() -> None:
    out = subprocess.run(
        [PROMTOOL, "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


# --- the Prometheus Operator's objects ---------------------------------------------------------------------------


def test_the_prometheus_rule_holds_the_rules_file() -> None:
    """One source of truth: the PrometheusRule's groups are the rules file's, as compose's Prometheus loads it."""
    rule = one(rendered(MONITORING), "PrometheusRule")
    assert rule["spec"]["groups"] == alert_rules()["groups"], (
        "deploy/k8s/components/monitoring/prometheusrule.yaml differs from deploy/prometheus/alerts.yml: "
        "copy the groups over (the command is in the PrometheusRule's header)"
    )
    assert rule["metadata"]["namespace"] == "llmq"


def test_operator_kinds_validate_against_their_schema() -> None:
    checked = set()
    for obj in rendered(MONITORING):
        if obj["kind"] in OPERATOR_KINDS:
            assert schema_errors(operator_validator(obj["kind"]), obj) == [], obj["metadata"]["name"]
            checked.add(obj["kind"])
    assert checked == OPERATOR_KINDS


@pytest.mark.parametrize(
    ("kind", "spoil"),
    [
        ("ServiceMonitor", lambda sm: sm["spec"]["endpoints"][0].update(intervall="15s")),
        ("ServiceMonitor", lambda sm: sm["spec"]["endpoints"][0].update(interval="15 seconds")),
        ("ServiceMonitor", lambda sm: sm["spec"].pop("selector")),
        ("ServiceMonitor", lambda sm: sm["spec"]["endpoints"][0].update(port=9400)),
        ("PrometheusRule", lambda pr: pr["spec"]["groups"][0]["rules"][0].update({"for": "2 minutes"})),
        ("PrometheusRule", lambda pr: pr["spec"]["groups"][0]["rules"][0].pop("expr")),
        ("PrometheusRule", lambda pr: pr["spec"]["groups"][0].update(rule=[])),
    ],
    ids=["misspelt", "bad-duration", "no-selector", "numeric-port", "rule-duration", "no-expr", "group-field"],
)
def test_operator_validation_rejects_broken_objects(kind: str, spoil: Any) -> None:
    obj = copy.deepcopy(next(o for o in rendered(MONITORING) if o["kind"] == kind))
    spoil(obj)
    assert schema_errors(operator_validator(kind), obj)


def service_monitor_jobs() -> dict[str, str]:
    """Each ServiceMonitor's name and the job name its targets get (the Service's label named by jobLabel)."""
    objects = rendered(MONITORING)
    jobs = {}
    for monitor in (obj for obj in objects if obj["kind"] == "ServiceMonitor"):
        (service,) = [
            obj
            for obj in objects
            if obj["kind"] == "Service" and selects(monitor["spec"]["selector"], obj["metadata"]["labels"])
        ]
        jobs[monitor["metadata"]["name"]] = service["metadata"]["labels"][monitor["spec"]["jobLabel"]]
    return jobs


def test_each_service_monitor_scrapes_one_service_on_its_metrics_port() -> None:
    objects = rendered(MONITORING)
    expected = {"llmq-worker": "llmq-worker-metrics", "llmq-gateway": "llmq-gateway"}
    for name, service_name in expected.items():
        monitor, service = named(objects, "ServiceMonitor", name), named(objects, "Service", service_name)
        assert selects(monitor["spec"]["selector"], service["metadata"]["labels"])
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
        assert endpoint["path"] == service["metadata"]["annotations"]["prometheus.io/path"] == "/metrics"
        assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
    assert service_monitor_jobs() == {"llmq-worker": "llmq-worker", "llmq-gateway": "llmq-gateway"}


def test_the_manual_lists_every_alert() -> None:
    page = (ALERTS.parents[2] / "docs" / "operations" / "kubernetes.md").read_text()
    section = page.split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    for rule in rules():
        assert f"| `{rule['alert']}` |" in section, rule["alert"]
