"""Black-box checks of the deployment files against what docs/operations/kubernetes.md and scale-out.md promise.

Everything Kubernetes is checked on what `kubectl kustomize deploy/k8s/<overlay>` renders (not on the source
files), for every overlay: selectors are evaluated against the rendered pods' labels, port names against the
rendered Services and containers, and the settings the rendered env hands the worker and the gateway are loaded
by their own settings classes in a fresh interpreter. Compose is checked on what `docker-compose config`
interpolates (or, without it, the same `${VAR:-default}` rule), with and without REDIS_PASSWORD. Each selector
check also runs on a hostile edit in memory, to show that it would fail.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shutil
import subprocess
import sys
import urllib.parse
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("base", "gpu", "monitoring", "gpu-monitoring")
MONITORING_OVERLAYS = ("monitoring", "gpu-monitoring")
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
MAKEFILE = ROOT / "Makefile"
SECRET_EXAMPLE = K8S / "secret.example.yaml"
KEDA_CRDS = ROOT / "tests" / "data" / "keda"
NS = "llmq"
NAME = "app.kubernetes.io/name"

Obj = dict[str, Any]


# --- rendering --------------------------------------------------------------------------------------------------


@functools.cache
def _render(overlay: str) -> tuple[Obj, ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / overlay)], capture_output=True, text=True, timeout=120, check=True
    )
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def render(overlay: str) -> list[Obj]:
    """A fresh copy, so that a test may spoil it."""
    return copy.deepcopy(list(_render(overlay)))


def of_kind(objs: Iterable[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: Iterable[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def ns_of(obj: Obj) -> str:
    return obj["metadata"].get("namespace", "default")


# --- label selectors --------------------------------------------------------------------------------------------


def selects(selector: Obj | None, labels: dict[str, str]) -> bool:
    """A metav1.LabelSelector: None selects nothing, {} everything."""
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise AssertionError(f"unknown operator {op}")
    return True


def pod_labels(deploy: Obj) -> dict[str, str]:
    """The labels a pod of the Deployment carries (the template's, plus the hash the controller adds)."""
    return {**deploy["spec"]["template"]["metadata"].get("labels", {}), "pod-template-hash": "5d8f7c9b6"}


def deployments(objs: list[Obj]) -> dict[str, Obj]:
    return {d["metadata"]["name"]: d for d in of_kind(objs, "Deployment")}


def container_ports(deploy: Obj) -> dict[str, int]:
    return {
        p["name"]: p["containerPort"]
        for c in deploy["spec"]["template"]["spec"]["containers"]
        for p in c.get("ports", [])
        if "name" in p
    }


# --- the checks, as functions returning problems (so that hostile edits can show they fail) -------------------


def pdb_problems(objs: list[Obj]) -> list[str]:
    problems = []
    pdbs = of_kind(objs, "PodDisruptionBudget")
    for name, deploy in deployments(objs).items():
        labels = pod_labels(deploy)
        covering = [
            p["metadata"]["name"]
            for p in pdbs
            if ns_of(p) == ns_of(deploy) and selects(p["spec"].get("selector"), labels)
        ]
        if len(covering) != 1:
            # none: drains are unbounded; two: the eviction API refuses to evict the pod at all
            problems.append(f"Deployment {name}: pods selected by PDBs {covering}, want exactly one")
        elif covering[0] != name:
            problems.append(f"Deployment {name}: covered by PDB {covering[0]}")
    for pdb in pdbs:
        if not any(selects(pdb["spec"].get("selector"), pod_labels(d)) for d in deployments(objs).values()):
            problems.append(f"PDB {pdb['metadata']['name']} selects no rendered pod")
    return problems


def spread_problems(objs: list[Obj]) -> list[str]:
    problems = []
    deps = deployments(objs)
    for name, deploy in deps.items():
        tscs = deploy["spec"]["template"]["spec"].get("topologySpreadConstraints") or []
        keys = [t.get("topologyKey") for t in tscs]
        if keys != ["topology.kubernetes.io/zone", "kubernetes.io/hostname"]:
            problems.append(f"{name}: topology keys {keys}, want zone then hostname")
        for t in tscs:
            sel = t.get("labelSelector")
            if not selects(sel, pod_labels(deploy)):
                problems.append(f"{name}: spread over {t.get('topologyKey')} does not select its own pods")
            for other_name, other in deps.items():
                if other_name != name and selects(sel, pod_labels(other)):
                    problems.append(f"{name}: spread over {t.get('topologyKey')} also counts {other_name} pods")
            if t.get("maxSkew") != 1 or t.get("whenUnsatisfiable") != "ScheduleAnyway":
                problems.append(f"{name}: {t.get('topologyKey')}: maxSkew/whenUnsatisfiable not 1/ScheduleAnyway")
            if "pod-template-hash" not in (t.get("matchLabelKeys") or []):
                problems.append(f"{name}: {t.get('topologyKey')}: matchLabelKeys lacks pod-template-hash")
    return problems


def service_problems(objs: list[Obj]) -> list[str]:
    """Every Service selects pods of one Deployment and its targetPorts name ports those containers have."""
    problems = []
    for svc in of_kind(objs, "Service"):
        name = svc["metadata"]["name"]
        backing = [
            d for d in deployments(objs).values() if selects({"matchLabels": svc["spec"]["selector"]}, pod_labels(d))
        ]
        if len(backing) != 1:
            problems.append(f"Service {name} selects {len(backing)} Deployments' pods")
            continue
        ports = container_ports(backing[0])
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            if isinstance(target, str) and target not in ports:
                problems.append(f"Service {name}: targetPort {target} is no container port name {sorted(ports)}")
            if isinstance(target, int) and target not in ports.values():
                problems.append(f"Service {name}: targetPort {target} is no container port")
    return problems


def monitor_problems(objs: list[Obj]) -> list[str]:
    problems = []
    services = of_kind(objs, "Service")
    monitors = of_kind(objs, "ServiceMonitor")
    jobs = set()
    scraped = set()
    for sm in monitors:
        name = sm["metadata"]["name"]
        nsel = sm["spec"].get("namespaceSelector") or {}
        namespaces = set(nsel.get("matchNames") or [ns_of(sm)])
        if nsel.get("any"):
            namespaces = {ns_of(s) for s in services}
        chosen = [
            s
            for s in services
            if ns_of(s) in namespaces and selects(sm["spec"].get("selector"), s["metadata"].get("labels", {}))
        ]
        if len(chosen) != 1:
            problems.append(f"ServiceMonitor {name} selects {[s['metadata']['name'] for s in chosen]}, want one")
        for svc in chosen:
            scraped.add(svc["metadata"]["name"])
            port_names = {p.get("name") for p in svc["spec"]["ports"]}
            for ep in sm["spec"].get("endpoints", []):
                if "port" not in ep or ep["port"] not in port_names:
                    problems.append(f"ServiceMonitor {name}: port {ep.get('port')} not on Service {port_names}")
            job_label = sm["spec"].get("jobLabel")
            jobs.add(svc["metadata"].get("labels", {}).get(job_label, svc["metadata"]["name"]))
    for svc in services:
        if svc["metadata"]["name"] not in scraped:
            problems.append(f"Service {svc['metadata']['name']} has no ServiceMonitor")
    # the alert rules read up{job="llmq-worker"} and up{job="llmq-gateway"}
    if jobs != {"llmq-worker", "llmq-gateway"}:
        problems.append(f"scrape jobs {sorted(jobs)}, want llmq-worker and llmq-gateway")
    return problems


def pod_monitor_problems(objs: list[Obj]) -> list[str]:
    problems = []
    for pm in of_kind(objs, "PodMonitor"):
        chosen = [d for d in deployments(objs).values() if selects(pm["spec"].get("selector"), pod_labels(d))]
        if not chosen:
            problems.append(f"PodMonitor {pm['metadata']['name']} selects no pod")
        for d in chosen:
            for ep in pm["spec"].get("podMetricsEndpoints", []):
                if ep.get("port") not in container_ports(d):
                    problems.append(f"PodMonitor {pm['metadata']['name']}: no port {ep.get('port')}")
    return problems


# --- network policy evaluation ----------------------------------------------------------------------------------


class Pod:
    def __init__(self, namespace: str, labels: dict[str, str], ports: dict[str, int] | None = None) -> None:
        self.namespace, self.labels, self.ports = namespace, labels, ports or {}

    def ns_labels(self, objs: list[Obj]) -> dict[str, str]:
        labels = {"kubernetes.io/metadata.name": self.namespace}  # set by the API server on every namespace
        for ns in of_kind(objs, "Namespace"):
            if ns["metadata"]["name"] == self.namespace:
                labels.update(ns["metadata"].get("labels") or {})
        return labels


def _peer_admits(objs: list[Obj], policy: Obj, peer: Obj, source: Pod) -> bool:
    if "ipBlock" in peer:
        return False  # cluster pods are matched by selectors here
    pod_sel, ns_sel = peer.get("podSelector"), peer.get("namespaceSelector")
    # a bare podSelector: the policy's own namespace
    ns_ok = source.namespace == ns_of(policy) if ns_sel is None else selects(ns_sel, source.ns_labels(objs))
    return ns_ok and (pod_sel is None or selects(pod_sel, source.labels))


def _port_admits(rule_port: Obj, target: Pod, port: int, protocol: str) -> bool:
    if rule_port.get("protocol", "TCP") != protocol:
        return False
    number = rule_port.get("port")
    if number is None:
        return True
    if isinstance(number, str):
        number = target.ports.get(number)  # a named port: the target container's port of that name
        if number is None:
            return False
    return bool(number <= port <= rule_port.get("endPort", number))


def admitted(objs: list[Obj], target: Pod, source: Pod, port: int, protocol: str = "TCP") -> bool:
    """Whether the rendered NetworkPolicies let source open port on target (ingress only)."""
    policies = [
        p
        for p in of_kind(objs, "NetworkPolicy")
        if ns_of(p) == target.namespace
        and selects(p["spec"].get("podSelector"), target.labels)
        and "Ingress" in (p["spec"].get("policyTypes") or ["Ingress"])
    ]
    if not policies:
        return True  # no policy isolates the pod
    for policy in policies:
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from")
            if peers and not any(_peer_admits(objs, policy, peer, source) for peer in peers):
                continue
            ports = rule.get("ports")
            if not ports or any(_port_admits(p, target, port, protocol) for p in ports):
                return True
    return False


def cast(objs: list[Obj]) -> dict[str, Pod]:
    deps = deployments(objs)
    return {
        "worker": Pod(NS, pod_labels(deps["llmq-worker"]), container_ports(deps["llmq-worker"])),
        "gateway": Pod(NS, pod_labels(deps["llmq-gateway"]), container_ports(deps["llmq-gateway"])),
        "redis": Pod(NS, {NAME: "redis", "app.kubernetes.io/instance": "redis"}, {"redis": 6379}),
        "stranger": Pod(NS, {"app": "debug-shell"}),
        "keda": Pod("keda", {NAME: "keda-operator"}),
        "prometheus": Pod("monitoring", {NAME: "prometheus"}),
        # a pod elsewhere that carries a worker's labels must not pass for one
        "lookalike": Pod("default", pod_labels(deps["llmq-worker"])),
    }


def _redis_policy_problems(objs: list[Obj], pods: dict[str, Pod]) -> list[str]:
    problems = []
    want = {"worker", "gateway", "keda", "redis"}  # kubernetes.md's table, first row
    for port in (6379, 26379):  # Redis and Sentinel
        for who, pod in pods.items():
            got = admitted(objs, pods["redis"], pod, port)
            if got != (who in want):
                problems.append(f"{who} -> redis:{port}: admitted={got}, want {who in want}")
    if not admitted(objs, pods["redis"], pods["redis"], 16379):
        problems.append("redis -> redis:16379 (Cluster bus) refused")
    for who in ("worker", "gateway", "keda"):
        if admitted(objs, pods["redis"], pods[who], 16379):
            problems.append(f"{who} -> redis:16379 admitted")
    return problems


def _worker_policy_problems(objs: list[Obj], pods: dict[str, Pod]) -> list[str]:
    problems = []
    metrics = pods["worker"].ports["metrics"]
    for who, pod in pods.items():
        got = admitted(objs, pods["worker"], pod, metrics)
        if got != (who == "prometheus"):
            problems.append(f"{who} -> worker:{metrics}: admitted={got}")
    if admitted(objs, pods["worker"], pods["prometheus"], metrics + 1):
        problems.append("prometheus -> worker on another port admitted")
    return problems


def _gateway_policy_problems(objs: list[Obj], pods: dict[str, Pod]) -> list[str]:
    problems = []
    http = pods["gateway"].ports["http"]
    for who, pod in pods.items():
        if not admitted(objs, pods["gateway"], pod, http):
            problems.append(f"{who} -> gateway:{http} refused")
        if admitted(objs, pods["gateway"], pod, 9999):
            problems.append(f"{who} -> gateway:9999 admitted")
    return problems


def netpol_problems(objs: list[Obj]) -> list[str]:
    pods = cast(objs)
    return (
        _redis_policy_problems(objs, pods) + _worker_policy_problems(objs, pods) + _gateway_policy_problems(objs, pods)
    )


# --- Kubernetes: what every overlay renders ---------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_the_gateway_deployment_service_and_hpa(overlay: str) -> None:
    objs = render(overlay)
    deploy = one(objs, "Deployment", "llmq-gateway")
    svc = one(objs, "Service", "llmq-gateway")
    hpa = one(objs, "HorizontalPodAutoscaler", "llmq-gateway")
    assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert [(p["port"], p.get("name")) for p in svc["spec"]["ports"]] == [(8000, "http")]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llmq-gateway"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 10)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert metric["resource"]["target"] == {"type": "Utilization", "averageUtilization": 70}
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"]["cpu"] == "500m"  # the HPA's 70 % are of this
    assert "replicas" not in deploy["spec"]  # the HPA owns the count
    # the namespace is llmq for every namespaced object
    for obj in objs:
        if obj["kind"] != "Namespace":
            assert ns_of(obj) == NS, f"{obj['kind']}/{obj['metadata']['name']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_backs_onto_its_deployment_s_named_ports(overlay: str) -> None:
    assert service_problems(render(overlay)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_deployment_selects_its_own_template(overlay: str) -> None:
    for name, deploy in deployments(render(overlay)).items():
        assert selects(deploy["spec"]["selector"], pod_labels(deploy)), name


# --- the settings the rendered env really hands the processes ---------------------------------------------------

_LOAD_SETTINGS = r"""
import json, sys
which = sys.argv[1]
if which == "gateway":
    from gateway.settings import GatewaySettings as S
else:
    from worker.config import Settings as S
prefix = S.model_config["env_prefix"]
known = set()
for name, field in S.model_fields.items():
    alias = field.validation_alias
    known.add((alias if isinstance(alias, str) else prefix + name).upper())
import os
env = [k for k in os.environ if k.upper().startswith(prefix)]
unknown = sorted(k for k in env if k.upper() not in known)
if which == "worker":
    unknown = [k for k in unknown if not k.upper().startswith("LLMQ_GATEWAY_")]
try:
    s = S()
except Exception as e:
    print(json.dumps({"unknown": unknown, "error": str(e)}))
    sys.exit(0)
values = s.model_dump(mode="json")
for k in ("redis_url", "api_keys"):
    if getattr(s, k, None) is not None:
        values[k] = getattr(s, k).get_secret_value()
print(json.dumps({"unknown": unknown, "values": values}))
"""


def _secrets() -> dict[str, dict[str, str]]:
    return {
        s["metadata"]["name"]: dict(s.get("stringData") or {})
        for s in yaml.safe_load_all(SECRET_EXAMPLE.read_text())
        if s and s["kind"] == "Secret"
    }


def _cpu(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def container_env(objs: list[Obj], deploy: Obj, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The environment the kubelet builds for the Deployment's (only) container."""
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    configmaps = {c["metadata"]["name"]: c.get("data") or {} for c in of_kind(objs, "ConfigMap")}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source["configMapRef"]
        if ref["name"] not in configmaps:
            assert ref.get("optional"), f"envFrom names ConfigMap {ref['name']}, which is not rendered"
            continue
        env.update({source.get("prefix", "") + k: str(v) for k, v in configmaps[ref["name"]].items()})
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
            continue
        vf = var["valueFrom"]
        if "secretKeyRef" in vf:
            ref = vf["secretKeyRef"]
            if ref["name"] in secrets and ref["key"] in secrets[ref["name"]]:
                env[var["name"]] = secrets[ref["name"]][ref["key"]]
            else:
                assert ref.get("optional"), f"{var['name']}: Secret {ref['name']}/{ref['key']} is not documented"
        elif "configMapKeyRef" in vf:
            ref = vf["configMapKeyRef"]
            env[var["name"]] = configmaps[ref["name"]][ref["key"]]
        elif "resourceFieldRef" in vf:
            ref = vf["resourceFieldRef"]
            kind, resource = ref["resource"].split(".")
            value = _cpu(str(container["resources"][kind][resource])) / _cpu(str(ref.get("divisor", "1")))
            env[var["name"]] = str(max(1, int(-(-value // 1))))
        else:
            env[var["name"]] = "fieldref"
    return env


def load_settings(which: str, env: dict[str, str], cwd: Path) -> dict[str, Any]:
    # a fresh interpreter, nothing of ours in its environment, and no .env file in its working directory
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(cwd)}
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_SETTINGS, which],
        env={**base, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("with_api_keys", [True, False])
def test_the_gateway_reads_every_variable_the_rendered_pod_gets(
    overlay: str, with_api_keys: bool, tmp_path: Path
) -> None:
    objs = render(overlay)
    secrets = _secrets()
    if not with_api_keys:
        del secrets["llmq-gateway"]  # optional: the docs say the API is then open
    env = container_env(objs, one(objs, "Deployment", "llmq-gateway"), secrets)
    assert "LLMQ_GATEWAY_REDIS_URL" in env
    loaded = load_settings("gateway", env, tmp_path)
    assert loaded["unknown"] == [], "variables GatewaySettings ignores (extra='ignore')"
    assert "error" not in loaded, loaded.get("error")
    got = loaded["values"]
    worker = load_settings("worker", container_env(objs, one(objs, "Deployment", "llmq-worker"), _secrets()), tmp_path)
    assert "error" not in worker, worker.get("error")
    assert got["redis_url"] == worker["values"]["redis_url"]  # the same Secret key
    assert got["prefix"] == worker["values"]["prefix"]
    assert worker["values"]["queue"] in got["queues"].split(",")
    assert got["api_keys"] == ("CHANGE-ME" if with_api_keys else None)
    ports = container_ports(one(objs, "Deployment", "llmq-gateway"))
    assert got["port"] == ports["http"] == 8000
    assert got["log_format"] == "json"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_worker_reads_every_variable_the_rendered_pod_gets(overlay: str, tmp_path: Path) -> None:
    objs = render(overlay)
    deploy = one(objs, "Deployment", "llmq-worker")
    env = container_env(objs, deploy, _secrets())
    assert env["LLMQ_REDIS_URL"].startswith("redis://")
    assert "LLMQ_REDIS_URL" not in one(objs, "ConfigMap", "llmq-worker")["data"]  # the password stays in the Secret
    loaded = load_settings("worker", env, tmp_path)
    assert loaded["unknown"] == []
    assert "error" not in loaded, loaded.get("error")
    got = loaded["values"]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert got["metrics_port"] == container_ports(deploy)["metrics"]
    assert env["OMP_NUM_THREADS"] == str(int(_cpu(str(container["resources"]["limits"]["cpu"]))))
    assert got["drain_timeout_s"] < deploy["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    if overlay.startswith("gpu"):
        assert (got["device"], got["kv_cache_tokens"], got["max_running"], got["max_batch_tokens"]) == (
            "cuda",
            262144,
            256,
            4096,
        )
    else:
        assert got["device"] == "cpu"
    # the ScaledObject watches the streams of the queue the worker reads, with a target of 3/4 of max_running
    (so,) = of_kind(objs, "ScaledObject")
    streams = {t["metadata"]["stream"] for t in so["spec"]["triggers"]}
    tag = "{" + f"{got['prefix']}:{got['queue']}" + "}"
    key = f"{tag}:requests"
    held = {f"{tag}:held:{lane}" for lane in ("interactive", "default", "batch")}  # fair share's held requests
    assert streams == {key, key + ":interactive", key + ":batch", *held}
    assert int(so["spec"]["advanced"]["scalingModifiers"]["target"]) * 4 == got["max_running"] * 3


def test_the_settings_check_sees_a_misspelt_variable(tmp_path: Path) -> None:
    objs = render("base")
    one(objs, "ConfigMap", "llmq-gateway")["data"]["LLMQ_GATEWAY_MAX_QUEUE_LENGTH"] = "5"
    env = container_env(objs, one(objs, "Deployment", "llmq-gateway"), _secrets())
    assert load_settings("gateway", env, tmp_path)["unknown"] == ["LLMQ_GATEWAY_MAX_QUEUE_LENGTH"]
    one(objs, "ConfigMap", "llmq-worker")["data"]["LLMQ_MAX_RUNNING"] = "lots"
    env = container_env(objs, one(objs, "Deployment", "llmq-worker"), _secrets())
    assert "max_running" in load_settings("worker", env, tmp_path)["error"]


# --- disruption budgets, spreading ------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_disruption_budget_per_deployment_selects_its_pods(overlay: str) -> None:
    objs = render(overlay)
    assert pdb_problems(objs) == []
    for pdb in of_kind(objs, "PodDisruptionBudget"):
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
        assert "minAvailable" not in pdb["spec"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_both_deployments_spread_their_own_pods_over_zones_then_nodes(overlay: str) -> None:
    assert spread_problems(render(overlay)) == []


def _relabel_worker_pods(objs: list[Obj]) -> None:
    """A consistent Deployment whose pods no longer carry the label every selector uses."""
    deploy = one(objs, "Deployment", "llmq-worker")
    deploy["spec"]["template"]["metadata"]["labels"][NAME] = "llmq-worker-v2"
    deploy["spec"]["selector"]["matchLabels"][NAME] = "llmq-worker-v2"


def _broaden_gateway_pdb(objs: list[Obj]) -> None:
    one(objs, "PodDisruptionBudget", "llmq-gateway")["spec"]["selector"] = {
        "matchLabels": {"app.kubernetes.io/part-of": "llmq"}
    }


def _spread_gateway_by_part_of(objs: list[Obj]) -> None:
    for t in one(objs, "Deployment", "llmq-gateway")["spec"]["template"]["spec"]["topologySpreadConstraints"]:
        t["labelSelector"] = {"matchLabels": {"app.kubernetes.io/part-of": "llmq"}}


def _typo_in_worker_spread(objs: list[Obj]) -> None:
    tsc = one(objs, "Deployment", "llmq-worker")["spec"]["template"]["spec"]["topologySpreadConstraints"][0]
    tsc["labelSelector"]["matchLabels"][NAME] = "llmq-workers"


def _service_label(objs: list[Obj]) -> None:
    one(objs, "Service", "llmq-worker-metrics")["metadata"]["labels"]["app.kubernetes.io/component"] = "worker"


def _monitor_port(objs: list[Obj]) -> None:
    one(objs, "ServiceMonitor", "llmq-gateway")["spec"]["endpoints"][0]["port"] = "metrics"


def _service_port_name(objs: list[Obj]) -> None:
    one(objs, "Service", "llmq-gateway")["spec"]["ports"][0]["name"] = "web"


def _monitor_elsewhere(objs: list[Obj]) -> None:
    one(objs, "ServiceMonitor", "llmq-worker")["spec"]["namespaceSelector"] = {"matchNames": ["monitoring"]}


def _redis_policy_from_any_namespace(objs: list[Obj]) -> None:
    policy = one(objs, "NetworkPolicy", "llmq-redis")
    policy["spec"]["ingress"][0]["from"][0]["namespaceSelector"] = {}


def _redis_policy_expression(objs: list[Obj]) -> None:
    policy = one(objs, "NetworkPolicy", "llmq-redis")
    policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"][0]["values"] = ["llmq-worker"]


def _worker_policy_open(objs: list[Obj]) -> None:
    del one(objs, "NetworkPolicy", "llmq-worker")["spec"]["ingress"][0]["from"]


def _redis_policy_wrong_pods(objs: list[Obj]) -> None:
    one(objs, "NetworkPolicy", "llmq-redis")["spec"]["podSelector"] = {"matchLabels": {"app": "redis"}}


HOSTILE: list[tuple[str, Callable[[list[Obj]], None], Callable[[list[Obj]], list[str]]]] = [
    ("worker pods relabelled / PDB", _relabel_worker_pods, pdb_problems),
    ("worker pods relabelled / spread", _relabel_worker_pods, spread_problems),
    ("worker pods relabelled / services", _relabel_worker_pods, service_problems),
    ("worker pods relabelled / network policies", _relabel_worker_pods, netpol_problems),
    ("gateway PDB selects every llmq pod", _broaden_gateway_pdb, pdb_problems),
    ("gateway spread counts workers", _spread_gateway_by_part_of, spread_problems),
    ("typo in worker spread selector", _typo_in_worker_spread, spread_problems),
    ("redis policy admits lookalikes from any namespace", _redis_policy_from_any_namespace, netpol_problems),
    ("redis policy forgets the gateway", _redis_policy_expression, netpol_problems),
    ("worker policy admits everyone", _worker_policy_open, netpol_problems),
    ("redis policy selects the wrong pods", _redis_policy_wrong_pods, netpol_problems),
]
HOSTILE_MONITORING: list[tuple[str, Callable[[list[Obj]], None], Callable[[list[Obj]], list[str]]]] = [
    ("metrics Service relabelled", _service_label, monitor_problems),
    ("gateway monitor names a missing port", _monitor_port, monitor_problems),
    ("gateway Service port renamed", _service_port_name, monitor_problems),
    ("worker monitor looks in another namespace", _monitor_elsewhere, monitor_problems),
]


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize(("what", "spoil", "check"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_edits_fail_the_selector_checks(
    overlay: str, what: str, spoil: Callable[[list[Obj]], None], check: Callable[[list[Obj]], list[str]]
) -> None:
    objs = render(overlay)
    assert check(objs) == []
    spoil(objs)
    assert check(objs) != [], what


@pytest.mark.parametrize("overlay", MONITORING_OVERLAYS)
@pytest.mark.parametrize(("what", "spoil", "check"), HOSTILE_MONITORING, ids=[h[0] for h in HOSTILE_MONITORING])
def test_hostile_edits_fail_the_monitor_checks(
    overlay: str, what: str, spoil: Callable[[list[Obj]], None], check: Callable[[list[Obj]], list[str]]
) -> None:
    objs = render(overlay)
    assert check(objs) == []
    spoil(objs)
    assert check(objs) != [], what


def test_the_selector_matcher_follows_kubernetes() -> None:
    labels = {"a": "1", "b": "2"}
    assert selects({}, labels)
    assert not selects(None, labels)
    assert selects({"matchLabels": {"a": "1"}}, labels)
    assert not selects({"matchLabels": {"a": "1", "c": "3"}}, labels)
    assert selects({"matchExpressions": [{"key": "a", "operator": "In", "values": ["0", "1"]}]}, labels)
    assert not selects({"matchExpressions": [{"key": "c", "operator": "In", "values": ["3"]}]}, labels)
    assert selects({"matchExpressions": [{"key": "c", "operator": "NotIn", "values": ["3"]}]}, labels)
    assert not selects({"matchExpressions": [{"key": "b", "operator": "DoesNotExist"}]}, labels)
    assert selects({"matchExpressions": [{"key": "b", "operator": "Exists"}]}, labels)


# --- network policies -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_admit_what_the_docs_list_and_nothing_else(overlay: str) -> None:
    objs = render(overlay)
    assert netpol_problems(objs) == []
    for policy in of_kind(objs, "NetworkPolicy"):
        assert policy["spec"]["policyTypes"] == ["Ingress"]  # outbound stays open for model downloads


# --- monitoring overlays ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_operator_objects_only_in_the_monitoring_overlays(overlay: str) -> None:
    kinds = {o["kind"] for o in render(overlay)}
    if overlay in MONITORING_OVERLAYS:
        assert {"ServiceMonitor", "PrometheusRule"} <= kinds
        assert len(of_kind(render(overlay), "ServiceMonitor")) == 2
    else:
        assert not kinds & {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


@pytest.mark.parametrize("overlay", MONITORING_OVERLAYS)
def test_service_monitors_select_the_services_on_ports_they_have(overlay: str) -> None:
    objs = render(overlay)
    assert monitor_problems(objs) == []
    assert pod_monitor_problems(objs) == []
    # Prometheus scrapes the pods behind each Service: the worker policy must let it in on that port
    pods = cast(objs)
    assert admitted(objs, pods["worker"], pods["prometheus"], pods["worker"].ports["metrics"])
    assert admitted(objs, pods["gateway"], pods["prometheus"], pods["gateway"].ports["http"])
    for sm in of_kind(objs, "ServiceMonitor"):
        for ep in sm["spec"]["endpoints"]:
            assert (ep.get("path"), ep.get("interval")) == ("/metrics", "15s")


def _rules_of(objs: list[Obj]) -> list[Obj]:
    (rule,) = of_kind(objs, "PrometheusRule")
    assert rule["metadata"]["name"] == "llmq"
    return rule["spec"]["groups"]


@pytest.mark.parametrize("overlay", MONITORING_OVERLAYS)
def test_the_rendered_prometheus_rule_is_the_rules_file(overlay: str, tmp_path: Path) -> None:
    groups = _rules_of(render(overlay))
    assert groups == yaml.safe_load(ALERTS.read_text())["groups"]
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed")
    path = tmp_path / "rendered.yml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "6 rules found" in out.stdout


# --- the alerts -------------------------------------------------------------------------------------------------


def _alerts() -> dict[str, Obj]:
    return {r["alert"]: r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"] if "alert" in r}


def _by_metric(needle: str) -> Obj:
    found = [r for r in _alerts().values() if needle in r["expr"]]
    assert len(found) == 1, f"alerts reading {needle}: {[r['alert'] for r in found]}"
    return found[0]


def test_each_promised_alert_exists_with_the_documented_threshold_and_severity() -> None:
    no_worker = _by_metric('up{job="llmq-worker"}')
    assert "absent(" in no_worker["expr"] and no_worker["for"] == "2m"
    assert no_worker["labels"]["severity"] == "critical"
    backlog = _by_metric("llmq:backlog_seconds")
    assert re.search(r">\s*300\b", backlog["expr"]) and backlog["for"] == "10m"
    dead = _by_metric("llmq:dead_letters_total")
    assert re.search(r"(increase|rate|delta)\(llmq:dead_letters_total\[15m\]\)", dead["expr"])
    kv = _by_metric("llmq:kv_cache_usage_perc")
    assert re.search(r">\s*0\.95\b", kv["expr"]) and kv["for"] == "5m"
    restarts = _by_metric("llmq:engine_restarts_total")
    assert re.search(r"(increase|rate)\(llmq:engine_restarts_total\[15m\]\)", restarts["expr"])
    gateway = _by_metric('up{job="llmq-gateway"}')
    assert gateway["labels"]["severity"] == "critical"
    for r in (backlog, dead, kv, restarts):
        assert r["labels"]["severity"] == "warning"
    # the names the docs' table uses
    assert {r["alert"] for r in (no_worker, backlog, dead, kv, restarts, gateway)} == set(_alerts())
    assert set(_alerts()) == {
        "LLMQNoLiveWorker",
        "LLMQBacklogHigh",
        "LLMQDeadLetters",
        "LLMQKVCacheFull",
        "LLMQEngineRestarts",
        "LLMQGatewayDown",
    }


def test_the_metrics_the_alerts_read_are_exported_by_the_worker() -> None:
    source = (ROOT / "worker" / "metrics.py").read_text()
    # prometheus_client appends _total to counters
    for family in ("llmq:backlog_seconds", "llmq:kv_cache_usage_perc", "llmq:dead_letters", "llmq:engine_restarts"):
        assert f'"{family}"' in source, family


def test_promtool_accepts_the_rules_file() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed")
    out = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _case(series: list[tuple[str, str]], at: str, alert: str, fires: list[dict[str, str]]) -> Obj:
    return {
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series],
        "alert_rule_test": [{"eval_time": at, "alertname": alert, "exp_alerts": [{"exp_labels": f} for f in fires]}],
    }


def test_the_alerts_fire_as_the_docs_table_says(tmp_path: Path) -> None:
    """Unit tests of our own, written from the docs' table (annotations stripped so only the logic is compared)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed")
    rules = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for r in group["rules"]:
            r.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    crit, warn = {"severity": "critical"}, {"severity": "warning"}
    w = 'instance="w1:9400", job="llmq-worker", queue="default", model="smollm2"'
    wl = {"instance": "w1:9400", "job": "llmq-worker", "queue": "default", "model": "smollm2"}
    lane = 'llmq:backlog_seconds{instance="w1:9400", job="llmq-worker", queue="default", lane="batch"}'
    cases = [
        # no live worker: the worker target down, or gone entirely, for 2 minutes; the gateway's up is no worker
        _case([('up{job="llmq-worker", instance="w1:9400"}', "0x10")], "3m", "LLMQNoLiveWorker", [crit]),
        _case([('up{job="llmq-gateway", instance="g:8000"}', "1x10")], "3m", "LLMQNoLiveWorker", [crit]),
        _case([('up{job="llmq-worker", instance="w1:9400"}', "1x10")], "5m", "LLMQNoLiveWorker", []),
        _case([('up{job="llmq-worker", instance="w1:9400"}', "0x10")], "1m", "LLMQNoLiveWorker", []),
        _case(
            [('up{job="llmq-worker", instance="w1:9400"}', "0x10"), ('up{job="llmq-worker", instance="w2"}', "1x10")],
            "5m",
            "LLMQNoLiveWorker",
            [],
        ),
        # backlog: over 300 s for 10 minutes, +Inf counts; 300 itself, or a shorter spell, does not
        _case([(lane, "301x20")], "11m", "LLMQBacklogHigh", [{**warn, "queue": "default", "lane": "batch"}]),
        _case(
            [(lane, " ".join(["+Inf"] * 20))], "11m", "LLMQBacklogHigh", [{**warn, "queue": "default", "lane": "batch"}]
        ),
        _case([(lane, "300x20")], "15m", "LLMQBacklogHigh", []),
        _case([(lane, "301x20")], "8m", "LLMQBacklogHigh", []),
        # dead letters: any growth in the last 15 minutes, none once it stopped growing for longer
        _case(
            [(f"llmq:dead_letters_total{{{w}}}", "0 0 1 1 1")], "4m", "LLMQDeadLetters", [{**warn, "queue": "default"}]
        ),
        _case([(f"llmq:dead_letters_total{{{w}}}", "5x30")], "20m", "LLMQDeadLetters", []),
        _case([(f"llmq:dead_letters_total{{{w}}}", "0 1x30")], "25m", "LLMQDeadLetters", []),
        # KV cache: above 0.95 for 5 minutes
        _case([(f"llmq:kv_cache_usage_perc{{{w}}}", "0.96x10")], "6m", "LLMQKVCacheFull", [{**warn, **wl}]),
        _case([(f"llmq:kv_cache_usage_perc{{{w}}}", "0.95x10")], "6m", "LLMQKVCacheFull", []),
        _case([(f"llmq:kv_cache_usage_perc{{{w}}}", "0.96x10")], "3m", "LLMQKVCacheFull", []),
        # engine restarts: growth in the last 15 minutes
        _case([(f"llmq:engine_restarts_total{{{w}}}", "0 0 1 1")], "3m", "LLMQEngineRestarts", [{**warn, **wl}]),
        _case([(f"llmq:engine_restarts_total{{{w}}}", "2x30")], "20m", "LLMQEngineRestarts", []),
        # gateway down
        _case([('up{job="llmq-gateway", instance="g:8000"}', "0x10")], "3m", "LLMQGatewayDown", [crit]),
        _case([('up{job="llmq-gateway", instance="g:8000"}', "1x10")], "3m", "LLMQGatewayDown", []),
    ]
    test = tmp_path / "test.yml"
    test.write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": cases}))
    out = subprocess.run(
        [promtool, "test", "rules", str(test)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stdout + out.stderr


# --- schema validation ------------------------------------------------------------------------------------------

_CORE_VERSIONS = ("1.27.0", None)  # the oldest the docs support, and kubernetes-validate's newest


def _strict(schema: Any) -> Any:
    """A CRD schema that refuses unknown fields, as `kubectl apply --validate=strict` does."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def _keda_schemas() -> dict[str, Obj]:
    schemas = {}
    for path in KEDA_CRDS.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
        schema = _strict(version["schema"]["openAPIV3Schema"])
        schema["properties"]["metadata"] = {"type": "object"}
        schemas[crd["spec"]["names"]["kind"]] = schema
    return schemas


# The Prometheus Operator's monitoring.coreos.com/v1 fields for these kinds (a subset: every field listed is one
# the CRD has), with unknown fields refused.
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": _LABELS,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_META = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _LABELS},
}
_OPERATOR_SCHEMAS = {
    "ServiceMonitor": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "ServiceMonitor"},
            "metadata": _META,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["selector", "endpoints"],
                "properties": {
                    "jobLabel": {"type": "string"},
                    "targetLabels": {"type": "array", "items": {"type": "string"}},
                    "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                    "selector": _SELECTOR,
                    "namespaceSelector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"any": {"type": "boolean"}, "matchNames": {"type": "array"}},
                    },
                    "sampleLimit": {"type": "integer"},
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "port": {"type": "string"},
                                "targetPort": {},
                                "path": {"type": "string", "pattern": "^/"},
                                "scheme": {"enum": ["http", "https"]},
                                "interval": _DURATION,
                                "scrapeTimeout": _DURATION,
                                "honorLabels": {"type": "boolean"},
                                "relabelings": {"type": "array"},
                                "metricRelabelings": {"type": "array"},
                            },
                        },
                    },
                },
            },
        },
    },
    "PrometheusRule": {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "PrometheusRule"},
            "metadata": _META,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "groups": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "required": ["name", "rules"],
                            "properties": {
                                "name": {"type": "string", "minLength": 1},
                                "interval": _DURATION,
                                "limit": {"type": "integer"},
                                "partial_response_strategy": {"type": "string"},
                                "rules": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "required": ["expr"],
                                        "properties": {
                                            "alert": {"type": "string"},
                                            "record": {"type": "string"},
                                            "expr": {"type": ["string", "integer"]},
                                            "for": _DURATION,
                                            "keep_firing_for": _DURATION,
                                            "labels": _LABELS,
                                            "annotations": _LABELS,
                                        },
                                    },
                                },
                            },
                        },
                    }
                },
            },
        },
    },
}


def validation_errors(obj: Obj) -> list[str]:
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    kind = obj["kind"]
    where = f"{kind}/{obj['metadata']['name']}"
    if kind in _OPERATOR_SCHEMAS:
        errors = jsonschema.Draft7Validator(_OPERATOR_SCHEMAS[kind]).iter_errors(obj)
        return [f"{where}: {e.json_path}: {e.message}" for e in errors]
    if kind in _keda_schemas():
        errors = jsonschema.Draft7Validator(_keda_schemas()[kind]).iter_errors(obj)
        return [f"{where}: {e.json_path}: {e.message}" for e in errors]
    problems = []
    for version in _CORE_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version or latest_version(), strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{where} ({version or 'latest'}): {e.message}")
    return problems


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_validates(overlay: str) -> None:
    objs = render(overlay)
    problems = [p for obj in objs for p in validation_errors(obj)]
    assert problems == []


@pytest.mark.parametrize(
    ("kind", "name", "spoil"),
    [
        ("Deployment", "llmq-gateway", lambda o: o["spec"]["template"]["spec"].update(topologySpread=[])),
        ("PodDisruptionBudget", "llmq-worker", lambda o: o["spec"].update(maxUnavailable=[1])),
        ("NetworkPolicy", "llmq-redis", lambda o: o["spec"]["ingress"][0].update(form=[])),
        ("ScaledObject", "llmq-worker", lambda o: o["spec"].update(maxReplicas=3)),
        ("ServiceMonitor", "llmq-worker", lambda o: o["spec"]["endpoints"][0].update(intervall="15s")),
        ("PrometheusRule", "llmq", lambda o: o["spec"]["groups"][0]["rules"][0].update(fro="2m")),
        ("PrometheusRule", "llmq", lambda o: o["spec"]["groups"][0]["rules"][0].update({"for": "2 minutes"})),
    ],
)
def test_validation_refuses_a_spoilt_object(kind: str, name: str, spoil: Callable[[Obj], None]) -> None:
    obj = one(render("monitoring"), kind, name)
    assert validation_errors(obj) == []
    spoil(obj)
    assert validation_errors(obj) != []


# --- compose ----------------------------------------------------------------------------------------------------


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default} and $$ (what this file needs of it)."""

    def one_var(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")

    return re.sub(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}", one_var, text)


def compose_config(env: dict[str, str], tmp_path: Path) -> Obj:
    """The file as compose interpolates it: docker-compose config where installed, else the same rule here."""
    exe = shutil.which("docker-compose")
    if exe is None:
        return yaml.safe_load(_interpolate(COMPOSE.read_text(), env))
    work = tmp_path / "compose"
    work.mkdir(exist_ok=True)
    empty = work / "empty.env"  # so that a .env file beside docker-compose.yml cannot take part
    empty.write_text("")
    out = subprocess.run(
        [exe, "-f", str(COMPOSE), "--project-directory", str(ROOT), "--env-file", str(empty), "config"],
        env={"PATH": "/usr/bin:/bin:/usr/local/bin", "HOME": str(work), **env},
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def _env_of(service: Obj) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: str(v) for k, v in env.items()}


def _networks_of(service: Obj) -> set[str]:
    nets = service.get("networks") or ["default"]
    return set(nets)


PASSWORDS = [
    ({}, "llmq-compose"),
    ({"REDIS_PASSWORD": "s3cret-Pw.9_~x"}, "s3cret-Pw.9_~x"),
    ({"REDIS_PASSWORD": ""}, "llmq-compose"),  # set but empty: ':-' takes the default, everywhere alike
]


@pytest.mark.parametrize(("env", "password"), PASSWORDS, ids=["unset", "set", "empty"])
def test_compose_redis_is_private_and_every_client_uses_its_password(
    env: dict[str, str], password: str, tmp_path: Path
) -> None:
    config = compose_config(env, tmp_path)
    services = config["services"]
    redis = services["redis"]
    assert not redis.get("ports"), "Redis publishes a host port"
    assert redis.get("network_mode") is None
    assert _networks_of(redis) == {"redis"}
    assert config["networks"]["redis"].get("internal") is True
    command = redis["command"]
    assert command[command.index("--requirepass") + 1] == password
    assert _env_of(redis)["REDISCLI_AUTH"] == password  # the health check logs in
    on_redis_net = {name for name, s in services.items() if name != "redis" and "redis" in _networks_of(s)}
    assert on_redis_net == {"worker", "worker-cuda", "gateway", "redis-exporter"}
    for name in on_redis_net:
        env_vars = _env_of(services[name])
        urls = {k: v for k, v in env_vars.items() if re.match(r"rediss?://", v)}
        assert urls, f"{name} has no Redis URL"
        for key, url in urls.items():
            parsed = urllib.parse.urlsplit(url)
            if name == "redis-exporter":
                assert env_vars["REDIS_PASSWORD"] == password
                assert parsed.hostname == "redis"
                continue
            assert urllib.parse.unquote(parsed.password or "") == password, f"{name}: {key}"
            assert (parsed.hostname, parsed.port) == ("redis", 6379), f"{name}: {key}"
    assert set(_env_of(services["worker"])) >= {"LLMQ_REDIS_URL"}
    assert set(_env_of(services["worker-cuda"])) >= {"LLMQ_REDIS_URL"}
    assert set(_env_of(services["gateway"])) >= {"LLMQ_GATEWAY_REDIS_URL"}
    if password != "llmq-compose":
        assert "llmq-compose" not in yaml.safe_dump(config)  # no client left on the default
    # nothing but the workers, the gateway and the exporter can reach Redis: no one else on its network
    for name, s in services.items():
        assert s.get("network_mode") != "host", name


def test_compose_interpolation_fallback_agrees_with_docker_compose(tmp_path: Path) -> None:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed")
    for env, _ in PASSWORDS:
        ours = yaml.safe_load(_interpolate(COMPOSE.read_text(), env))
        theirs = compose_config(env, tmp_path)
        for name in ("redis", "worker", "gateway", "redis-exporter", "worker-cuda"):
            assert _env_of(ours["services"][name]) == _env_of(theirs["services"][name]), name
        assert ours["services"]["redis"]["command"] == theirs["services"]["redis"]["command"]


def test_compose_services_env_names_are_settings(tmp_path: Path) -> None:
    services = compose_config({}, tmp_path)["services"]
    for name in ("worker", "worker-cuda"):
        loaded = load_settings("worker", _env_of(services[name]), tmp_path)
        assert loaded["unknown"] == [] and "error" not in loaded, (name, loaded)
        assert loaded["values"]["metrics_port"] == 9400  # what prometheus.yml scrapes
    loaded = load_settings("gateway", _env_of(services["gateway"]), tmp_path)
    assert loaded["unknown"] == [] and "error" not in loaded, loaded
    assert loaded["values"]["port"] == 8000
    assert loaded["values"]["queues"] == _env_of(services["worker"])["LLMQ_QUEUE"]


def test_compose_prometheus_scrapes_workers_gateway_and_exporter_and_loads_the_rules(tmp_path: Path) -> None:
    services = compose_config({}, tmp_path)["services"]
    prom_yml = yaml.safe_load(PROMETHEUS_YML.read_text())
    targets: dict[str, set[tuple[str, int]]] = {}
    for job in prom_yml["scrape_configs"]:
        found = set()
        for sd in job.get("dns_sd_configs", []):
            found |= {(n, sd["port"]) for n in sd["names"]}
        for sc in job.get("static_configs", []):
            for t in sc["targets"]:
                host, port = t.rsplit(":", 1)
                found.add((host, int(port)))
        targets[job["job_name"]] = found
    assert targets["llmq-worker"] == {("worker", 9400), ("worker-cuda", 9400)}
    assert targets["llmq-gateway"] == {("gateway", 8000)}
    assert targets["redis"] == {("redis-exporter", 9121)}  # scale-out.md: the job `redis`, through the exporter
    assert "oliver006/redis_exporter" in services["redis-exporter"]["image"]
    # every scrape target shares a network with Prometheus
    prom = services["prometheus"]
    for job, found in targets.items():
        for host, _ in found:
            assert _networks_of(services[host]) & _networks_of(prom), f"{job}: {host} unreachable"
    assert not _networks_of(prom) & {"redis"}  # Prometheus itself never reaches Redis
    # rule files: each resolves, beside the config in the container, to a mounted file that exists here
    mounts = {}
    for volume in prom["volumes"]:
        if isinstance(volume, str):
            src, dst = volume.split(":")[:2]
        else:
            src, dst = volume["source"], volume["target"]
        mounts[dst] = (COMPOSE.parent / src).resolve()
    config_in_container = "/etc/prometheus/prometheus.yml"
    assert mounts[config_in_container] == PROMETHEUS_YML.resolve()
    assert prom_yml.get("rule_files"), "Prometheus loads no rules"
    for rule_file in prom_yml["rule_files"]:
        in_container = rule_file if rule_file.startswith("/") else f"/etc/prometheus/{rule_file}"
        assert in_container in mounts, f"{rule_file} is not mounted"
        assert mounts[in_container].is_file(), mounts[in_container]
        assert mounts[in_container] == ALERTS.resolve()
    promtool = shutil.which("promtool")
    if promtool:
        out = subprocess.run(
            [promtool, "check", "config", str(PROMETHEUS_YML)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stdout + out.stderr


# --- Dockerfile -------------------------------------------------------------------------------------------------


def _stages(text: str) -> tuple[dict[str, str], list[tuple[str, str, list[str]]]]:
    """Global ARGs and (name, parent, instructions) per stage, continuation lines joined."""
    logical, buf = [], ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):
            continue
        buf += line.rstrip("\\").strip() + " "
        if not line.rstrip().endswith("\\"):
            logical.append(buf.strip())
            buf = ""
    global_args: dict[str, str] = {}
    stages: list[tuple[str, str, list[str]]] = []
    for ins in logical:
        word = ins.split()[0].upper()
        if word == "FROM":
            m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", ins, re.I)
            assert m
            stages.append((m.group(2) or f"#{len(stages)}", m.group(1), []))
        elif not stages:
            if word == "ARG":
                k, _, v = ins.split(None, 1)[1].partition("=")
                global_args[k] = v
        else:
            stages[-1][2].append(ins)
    return global_args, stages


def _chain(stages: list[tuple[str, str, list[str]]], index: int) -> list[tuple[str, str, list[str]]]:
    by_name = {s[0]: s for s in stages}
    chain, stage = [], stages[index]
    while True:
        chain.append(stage)
        if stage[1] not in by_name:
            return chain
        stage = by_name[stage[1]]


_COMPILERS = re.compile(r"\b(gcc|g\+\+|cc|c\+\+|clang|build-essential|libc6-dev|cpp|make|tcc)\b")


def _torch_problems(stage: tuple[str, str, list[str]]) -> list[str]:
    name, _, instructions = stage
    problems = []
    declared = torch_done = installs_worker = False
    for ins in instructions:
        if re.match(r"ARG\s+TORCH_SPEC\b", ins):
            declared = True
        if not (ins.startswith("RUN") and "pip install" in ins):
            continue
        if "$TORCH_SPEC" in ins or "${TORCH_SPEC}" in ins:
            if not declared:
                problems.append(f"stage {name}: uses $TORCH_SPEC without ARG TORCH_SPEC (it is empty there)")
            torch_done = True
        elif re.search(r"""["' ]torch([=<>~!]|["' ]|$)""", ins):
            problems.append(f"stage {name}: installs torch without the pin: {ins}")
        if ".[worker" in ins:
            installs_worker = True
            if not torch_done:
                problems.append(f"stage {name}: installs the worker before the pinned torch")
    if installs_worker and not torch_done:
        problems.append(f"stage {name}: worker without the pinned torch")
    return problems


def _compiler_problems(stage: tuple[str, str, list[str]]) -> list[str]:
    name, _, instructions = stage
    problems = []
    for ins in instructions:
        if ins.startswith("RUN") and re.search(r"apt-get\s+install|apk\s+add", ins):
            for pkg_list in re.findall(r"(?:install|add)\s+(.*?)(?:&&|;|$)", ins):
                hit = _COMPILERS.search(pkg_list)
                if hit:
                    problems.append(f"runtime stage {name} installs {hit.group(1)}")
        if ins.startswith("COPY") and "--from=" in ins and re.search(r"/usr/(bin|lib|libexec)/(gcc|cc|x86_64)", ins):
            problems.append(f"runtime stage {name} copies a compiler: {ins}")
    return problems


def dockerfile_problems(text: str, makefile: str) -> list[str]:
    problems = []
    spec = re.search(r"^TORCH_SPEC\s*\?=\s*(\S+)", makefile, re.M)
    assert spec
    global_args, stages = _stages(text)
    if global_args.get("TORCH_SPEC") != spec.group(1):
        problems.append(f"Dockerfile TORCH_SPEC {global_args.get('TORCH_SPEC')} != Makefile {spec.group(1)}")
    for stage in stages:
        problems += _torch_problems(stage)
    # the runtime images: the CPU worker, and the default target (the last stage), with every stage below them
    names = [s[0] for s in stages]
    for index in sorted({names.index("cpu"), len(stages) - 1}):
        for stage in _chain(stages, index):
            problems += _compiler_problems(stage)
    if not global_args.get("PYTHON_IMAGE", "").endswith("-slim"):
        problems.append("the base image is not a slim one (the full python images carry gcc)")
    return problems


def test_dockerfile_pins_the_makefiles_torch_and_keeps_compilers_out_of_the_runtime() -> None:
    assert dockerfile_problems(DOCKERFILE.read_text(), MAKEFILE.read_text()) == []


def test_the_pinned_torch_satisfies_the_worker_extra() -> None:
    from packaging.requirements import Requirement

    pin = re.search(r"^TORCH_SPEC\s*\?=\s*torch==(\S+)", MAKEFILE.read_text(), re.M)
    assert pin
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["worker"]
    (torch,) = [Requirement(r) for r in extra if Requirement(r).name == "torch"]
    # otherwise `pip install .[worker]` after the pinned torch would replace it
    assert torch.specifier.contains(pin.group(1), prereleases=True)


@pytest.mark.parametrize(
    "spoil",
    [
        lambda t: t.replace("ARG TORCH_SPEC=torch==", "ARG TORCH_SPEC=torch==9."),
        lambda t: t.replace("libgomp1", "libgomp1 gcc"),
        lambda t: t.replace("libgomp1", "build-essential libgomp1"),
        lambda t: re.sub(r"(FROM base AS cuda\n(?:.*\n)*?)ARG TORCH_SPEC\n", r"\1", t),
        lambda t: t.replace('"$TORCH_SPEC"', "torch", 1),
        lambda t: t.rstrip().rsplit("\n", 1)[0] + "\nFROM cpu-compiler\n",
    ],
    ids=["other pin", "gcc in cpu", "build-essential in cpu", "ARG missing in cuda", "unpinned torch", "default gcc"],
)
def test_the_dockerfile_check_sees_a_hostile_edit(spoil: Callable[[str], str]) -> None:
    text = DOCKERFILE.read_text()
    spoilt = spoil(text)
    assert spoilt != text
    assert dockerfile_problems(spoilt, MAKEFILE.read_text()) != []


def test_the_runtime_cc_wrapper_compiles_nothing(tmp_path: Path) -> None:
    _, stages = _stages(DOCKERFILE.read_text())
    (cpu,) = [s for s in stages if s[0] == "cpu"]
    copies = [ins.split() for ins in cpu[2] if ins.startswith("COPY") and "llmq-cc" in ins]
    assert copies, "the cpu stage sets no CC wrapper"
    src = ROOT / copies[0][1]
    assert src.name == "llmq-cc-none"
    (tmp_path / "k.c").write_text("int main(void){return 0;}\n")
    out = subprocess.run(["sh", str(src), "-o", str(tmp_path / "k"), str(tmp_path / "k.c")], capture_output=True)
    assert out.returncode != 0 and not (tmp_path / "k").exists()


# --- probes and scaling behaviour, run where they can be -------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_hpa_grows_at_once_and_shrinks_one_pod_a_minute_after_five_minutes(overlay: str) -> None:
    behavior = one(render(overlay), "HorizontalPodAutoscaler", "llmq-gateway")["spec"]["behavior"]
    assert behavior["scaleUp"].get("stabilizationWindowSeconds") == 0
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 300
    assert behavior["scaleDown"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 60}]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_probe_budgets_are_the_documented_ones(overlay: str) -> None:
    deploy = one(render(overlay), "Deployment", "llmq-worker")
    (c,) = deploy["spec"]["template"]["spec"]["containers"]

    def budget(probe: Obj) -> int:
        return int(probe["periodSeconds"] * probe["failureThreshold"])

    assert budget(c["startupProbe"]) == (600 if overlay.startswith("gpu") else 300)  # 5 minutes, 10 on GPU
    assert c["readinessProbe"]["periodSeconds"] == c["livenessProbe"]["periodSeconds"] == 30
    assert budget(c["livenessProbe"]) == 180  # 3 minutes of failures
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["exec"]["command"] == ["python", "-m", "worker.health"]
    gateway = one(render(overlay), "Deployment", "llmq-gateway")["spec"]["template"]["spec"]
    (g,) = gateway["containers"]
    assert g["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert g["livenessProbe"]["httpGet"]["path"] == g["startupProbe"]["httpGet"]["path"] == "/metrics"
    assert gateway["terminationGracePeriodSeconds"] == 40


_HEALTH = r"""
import os, runpy, sys
sys.argv = ["worker.health"]
code = 0
try:
    runpy.run_module("worker.health", run_name="__main__")
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else 1
print("torch" in sys.modules, code)
"""


@pytest.mark.parametrize("overlay", ["base", "gpu"])
def test_the_worker_probe_command_works_with_the_rendered_env_and_imports_no_torch(
    overlay: str, tmp_path: Path
) -> None:
    import time

    objs = render(overlay)
    env = container_env(objs, one(objs, "Deployment", "llmq-worker"), _secrets())
    health = tmp_path / "llmq-worker.health"
    env["LLMQ_HEALTH_FILE"] = str(health)  # the rendered /tmp path, moved into this test's directory
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}

    def probe() -> tuple[bool, int]:
        out = subprocess.run(
            [sys.executable, "-c", _HEALTH], env={**base, **env}, cwd=tmp_path, capture_output=True, text=True
        )
        torch, code = out.stdout.split()
        return torch == "True", int(code)

    assert probe() == (False, 1)  # no heartbeat yet: unhealthy
    health.write_text(str(int(time.time() * 1000)))
    assert probe() == (False, 0)  # a fresh heartbeat: healthy, without importing torch
    health.write_text(str(int((time.time() - 600) * 1000)))
    assert probe() == (False, 1)  # a stale one: unhealthy


_GATEWAY_PROBES = r"""
import json, time
from starlette.testclient import TestClient
from gateway.app import create_app
from gateway.settings import GatewaySettings
out = {}
with TestClient(create_app(GatewaySettings())) as client:
    for path in ("/health", "/metrics"):
        start = time.monotonic()
        out[path] = [client.get(path).status_code, time.monotonic() - start]
print(json.dumps(out))
"""


def test_gateway_readiness_fails_and_liveness_holds_while_redis_is_away(tmp_path: Path) -> None:
    """kubernetes.md: /health answers 503 while Redis does not (the pod leaves the Service); /metrics needs no Redis,
    so an outage never restarts a gateway. Run on the rendered env, with the Secret's URL pointing nowhere."""
    import socket

    objs = render("base")
    env = container_env(objs, one(objs, "Deployment", "llmq-gateway"), _secrets())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    env["LLMQ_GATEWAY_REDIS_URL"] = f"redis://:CHANGE-ME@127.0.0.1:{closed_port}/0"
    # the default (5 s) is how long /health retries before its 503; 1 s keeps this test short
    env["LLMQ_GATEWAY_REDIS_FAILOVER_TIMEOUT_S"] = "1"
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", _GATEWAY_PROBES],
        env={**base, **env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    (g,) = one(objs, "Deployment", "llmq-gateway")["spec"]["template"]["spec"]["containers"]
    assert got["/health"][0] == 503
    assert got["/metrics"][0] == 200
    assert got["/metrics"][1] < g["livenessProbe"]["timeoutSeconds"]


# --- the edits the docs tell a user to make, made on a copy -----------------------------------------------------


def render_edited(tmp_path: Path, edit: Callable[[Path], None], overlay: str) -> subprocess.CompletedProcess[str]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    copy_root = tmp_path / "k8s"
    if not copy_root.exists():
        shutil.copytree(K8S, copy_root)
        edit(copy_root)
    return subprocess.run([kubectl, "kustomize", str(copy_root / overlay)], capture_output=True, text=True, timeout=120)


def _set_images(overlay: str, root: Path) -> None:
    """What `cd deploy/k8s/<overlay> && kustomize edit set image llmq-worker=<registry>/llmq-worker
    llmq-gateway=<registry>/llmq-gateway` writes (kubernetes.md's deploy steps: in the overlay applied): newName
    only, tags kept."""
    path = root / overlay / "kustomization.yaml"
    kustomization = yaml.safe_load(path.read_text())
    kustomization["images"] = [
        {"name": "llmq-gateway", "newName": "registry.example.com/llmq-gateway"},
        {"name": "llmq-worker", "newName": "registry.example.com/llmq-worker"},
    ]
    path.write_text(yaml.safe_dump(kustomization))


@pytest.mark.parametrize(
    "overlay",
    [
        "base",
        "monitoring",
        "gpu",
        "gpu-monitoring",
    ],
)
def test_the_documented_image_step_points_every_overlay_at_the_registry(overlay: str, tmp_path: Path) -> None:
    out = render_edited(tmp_path, functools.partial(_set_images, overlay), overlay)
    assert out.returncode == 0, out.stderr
    images = {
        c["image"]
        for d in of_kind(yaml.safe_load_all(out.stdout), "Deployment")
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    want_worker = "cuda" if overlay.startswith("gpu") else "cpu"
    assert images == {"registry.example.com/llmq-gateway:latest", f"registry.example.com/llmq-worker:{want_worker}"}


def _drop_keda(root: Path) -> None:
    """kubernetes.md: 'Without KEDA ... drop triggerauthentication.yaml and scaledobject.yaml from
    base/kustomization.yaml (and, for the GPU overlays, scaledobject-patch.yaml from gpu/kustomization.yaml) and set
    replicas yourself.'"""
    gpu = root / "gpu" / "kustomization.yaml"
    gpu_kustomization = yaml.safe_load(gpu.read_text())
    gpu_kustomization["patches"] = [p for p in gpu_kustomization["patches"] if p["path"] != "scaledobject-patch.yaml"]
    gpu.write_text(yaml.safe_dump(gpu_kustomization))
    path = root / "base" / "kustomization.yaml"
    kustomization = yaml.safe_load(path.read_text())
    kustomization["resources"] = [
        r for r in kustomization["resources"] if r not in ("triggerauthentication.yaml", "scaledobject.yaml")
    ]
    path.write_text(yaml.safe_dump(kustomization))
    deploy_path = root / "base" / "deployment.yaml"
    deploy = yaml.safe_load(deploy_path.read_text())
    deploy["spec"]["replicas"] = 2
    deploy_path.write_text(yaml.safe_dump(deploy))


@pytest.mark.parametrize(
    "overlay",
    [
        "base",
        "monitoring",
        "gpu",
        "gpu-monitoring",
    ],
)
def test_every_overlay_renders_without_keda_as_the_docs_say(overlay: str, tmp_path: Path) -> None:
    out = render_edited(tmp_path, _drop_keda, overlay)
    assert out.returncode == 0, out.stderr
    objs = [o for o in yaml.safe_load_all(out.stdout) if o]
    assert not [o for o in objs if o["apiVersion"].startswith("keda.sh/")]
    assert one(objs, "Deployment", "llmq-worker")["spec"]["replicas"] == 2
    assert pdb_problems(objs) == [] and netpol_problems(objs) == []


def _release_label(root: Path) -> None:
    """monitoring/kustomization.yaml: uncomment the labels: block for kube-prometheus-stack."""
    path = root / "monitoring" / "kustomization.yaml"
    text = path.read_text()
    for commented, plain in (
        ("# labels:", "labels:"),
        ("#   - pairs:", "  - pairs:"),
        ("#       release:", "      release:"),
    ):
        assert commented in text
        text = text.replace(commented, plain)
    path.write_text(text)


def test_the_release_label_edit_labels_the_operator_objects_and_breaks_no_selector(tmp_path: Path) -> None:
    out = render_edited(tmp_path, _release_label, "monitoring")
    assert out.returncode == 0, out.stderr
    objs = [o for o in yaml.safe_load_all(out.stdout) if o]
    for kind in ("ServiceMonitor", "PrometheusRule"):
        for obj in of_kind(objs, kind):
            assert obj["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor_problems(objs) == []
    assert pdb_problems(objs) == spread_problems(objs) == service_problems(objs) == netpol_problems(objs) == []
    for d in of_kind(objs, "Deployment"):  # metadata only: a selector change would orphan running pods
        assert "release" not in d["spec"]["selector"]["matchLabels"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_scrape_annotations_name_the_services_own_ports(overlay: str) -> None:
    for svc in of_kind(render(overlay), "Service"):
        ann = svc["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true"
        assert int(ann["prometheus.io/port"]) in {p["port"] for p in svc["spec"]["ports"]}
        assert ann["prometheus.io/path"] == "/metrics"
