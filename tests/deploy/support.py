"""What the deploy tests share: loading deploy/k8s, rendering its kustomizations offline, finding objects by kind
and name, and the schemas the custom kinds are checked against.

Overlays are rendered by a small strategic merge that covers what our patches use, and components are applied as
kustomize applies them (their resources added to the overlay's, then their patches); when `kubectl` is on PATH, a
test checks that `kubectl kustomize` renders the same objects.
"""

from __future__ import annotations

import ast
import copy
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
BASE, GPU = K8S / "base", K8S / "gpu"
MONITORING, GPU_MONITORING = K8S / "monitoring", K8S / "gpu-monitoring"
MONITORING_COMPONENT = K8S / "components" / "monitoring"
SECRET_EXAMPLE = K8S / "secret.example.yaml"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
COMPOSE_FILE = ROOT / "docker-compose.yml"
KEDA_CRDS = ROOT / "tests" / "data" / "keda"

# The names of each part's objects.
WORKER = {"Deployment": "llmq-worker", "ConfigMap": "llmq-worker", "Service": "llmq-worker-metrics"}
GATEWAY = {
    "Deployment": "llmq-gateway",
    "ConfigMap": "llmq-gateway",
    "Service": "llmq-gateway",
    "HorizontalPodAutoscaler": "llmq-gateway",
}
# What each variant renders, by kind.
BASE_KINDS = {
    "Namespace",
    "ConfigMap",
    "Deployment",
    "Service",
    "HorizontalPodAutoscaler",
    "PodDisruptionBudget",
    "NetworkPolicy",
    "ScaledObject",
    "TriggerAuthentication",
}
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}

Obj = dict[str, Any]


# --- loading and rendering ------------------------------------------------------------------------------------


def load(path: Path) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def merge(base: Any, patch: Any) -> Any:
    """Strategic merge, as far as our patches need it: maps merge key by key, lists of named items (containers,
    volumes, env) merge by name, any other list or value is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key_, value in patch.items():
            out[key_] = merge(base[key_], value) if key_ in base else copy.deepcopy(value)
        return out
    named_items = [*(base if isinstance(base, list) else []), *(patch if isinstance(patch, list) else [])]
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and named_items
        and all(isinstance(item, dict) and "name" in item for item in named_items)
    ):
        out_list = [copy.deepcopy(item) for item in base]
        for item in patch:
            index = next((i for i, old in enumerate(out_list) if old["name"] == item["name"]), None)
            if index is None:
                out_list.append(copy.deepcopy(item))
            else:
                out_list[index] = merge(out_list[index], item)
        return out_list
    return copy.deepcopy(patch)


def key(obj: Obj) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


@cache
def kustomization(directory: Path) -> Obj:
    (doc,) = load(directory / "kustomization.yaml")
    return doc


def _build(directory: Path, objects: list[Obj]) -> list[Obj]:
    """`directory`'s kustomization on top of `objects` (empty for a Kustomization, the overlay's for a Component):
    its resources, then its components, then its namespace and patches."""
    spec = kustomization(directory)
    for resource in spec.get("resources", []):
        path = (directory / resource).resolve()
        objects += _build(path, []) if path.is_dir() else load(path)
    for component in spec.get("components", []):
        objects = _build((directory / component).resolve(), objects)
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] != "Namespace":
                obj["metadata"]["namespace"] = spec["namespace"]
    for patch_ref in spec.get("patches", []):
        (patch,) = load(directory / patch_ref["path"])
        matches = [i for i, obj in enumerate(objects) if key(obj) == key(patch)]
        assert len(matches) == 1, f"{patch_ref['path']} must patch exactly one object, matches {len(matches)}"
        objects[matches[0]] = merge(objects[matches[0]], patch)
    return objects


@cache
def rendered(directory: Path) -> tuple[Obj, ...]:
    return tuple(_build(directory, []))


def one(objects: tuple[Obj, ...] | list[Obj], kind: str) -> Obj:
    found = [obj for obj in objects if obj["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def named(objects: tuple[Obj, ...] | list[Obj], kind: str, name: str) -> Obj:
    found = [obj for obj in objects if key(obj) == (kind, name)]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def worker_part(objects: tuple[Obj, ...], kind: str) -> Obj:
    return named(objects, kind, WORKER[kind])


def gateway_part(objects: tuple[Obj, ...], kind: str) -> Obj:
    return named(objects, kind, GATEWAY[kind])


def container(objects: tuple[Obj, ...], part: dict[str, str] = WORKER) -> Obj:
    containers = named(objects, "Deployment", part["Deployment"])["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def configmap_env(objects: tuple[Obj, ...], part: dict[str, str] = WORKER) -> dict[str, str]:
    return named(objects, "ConfigMap", part["ConfigMap"])["data"]


def pod_labels(deployment: Obj) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions with In / NotIn / Exists / DoesNotExist) against labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        value, operator = labels.get(expression["key"]), expression["operator"]
        if operator == "In" and value not in expression["values"]:
            return False
        if operator == "NotIn" and value in expression["values"]:
            return False
        if (operator == "Exists" and value is None) or (operator == "DoesNotExist" and value is not None):
            return False
    return True


@cache
def secrets() -> dict[str, Obj]:
    return {doc["metadata"]["name"]: doc for doc in load(SECRET_EXAMPLE)}


def secret() -> Obj:
    """The Redis Secret."""
    return secrets()["llmq-redis"]


def secret_data(obj: Obj) -> dict[str, str]:
    return {**obj.get("stringData", {}), **obj.get("data", {})}


def manifest_files() -> list[Path]:
    return sorted(K8S.rglob("*.yaml"))


@cache
def alert_rules() -> Obj:
    rules = yaml.safe_load(ALERTS.read_text())
    assert isinstance(rules, dict)
    return rules


def _fields(path: Path, class_name: str) -> list[str]:
    """The annotated fields of a settings class, read from its source (importing worker.config loads torch)."""
    tree = ast.parse(path.read_text())
    (settings,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name]
    return [n.target.id for n in settings.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


@cache
def settings_env() -> frozenset[str]:
    """LLMQ_<FIELD> for every field of worker.config.Settings."""
    fields = _fields(ROOT / "worker" / "config.py", "Settings")
    assert {"redis_url", "drain_timeout_s", "metrics_port"} <= set(fields)
    return frozenset(f"LLMQ_{name.upper()}" for name in fields)


@cache
def gateway_settings_env() -> frozenset[str]:
    """LLMQ_GATEWAY_<FIELD> for every field of gateway.settings.GatewaySettings, and of the request limits it
    inherits."""
    from gateway.settings import GatewaySettings

    return frozenset(f"LLMQ_GATEWAY_{name.upper()}" for name in GatewaySettings.model_fields)


# --- schemas for the custom kinds --------------------------------------------------------------------------------


def closed(schema: Any) -> Any:
    """The schema with every object that lists its properties closed to others, as the API server's strict field
    validation (`kubectl apply --validate=strict`, the default) treats unknown fields."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@cache
def keda_validator(kind: str) -> jsonschema.Draft7Validator:
    (crd,) = load(KEDA_CRDS / f"keda.sh_{kind.lower()}s.yaml")
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    schema = closed(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


# The Prometheus Operator's kinds: a minimal schema of the fields our manifests use, with the types, patterns and
# required fields of monitoring.coreos.com/v1 (prometheus-operator's CRDs), closed like the KEDA ones, so that a
# misspelt or misplaced field fails here as strict validation fails it on the API server.
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _STRING_MAP},
}
_LABEL_SELECTOR = {
    "type": "object",
    "properties": {
        "matchLabels": _STRING_MAP,
        "matchExpressions": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["key", "operator"],
                "properties": {
                    "key": {"type": "string"},
                    "operator": {"type": "string"},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
}


def _operator_kind(kind: str, spec: Obj) -> Obj:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
    }


OPERATOR_SCHEMAS: dict[str, Obj] = {
    "ServiceMonitor": _operator_kind(
        "ServiceMonitor",
        {
            "type": "object",
            "required": ["selector", "endpoints"],
            "properties": {
                "jobLabel": {"type": "string"},
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": {
                    "type": "object",
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": _DURATION,
                            "scrapeTimeout": _DURATION,
                            "honorLabels": {"type": "boolean"},
                        },
                    },
                },
            },
        },
    ),
    "PrometheusRule": _operator_kind(
        "PrometheusRule",
        {
            "type": "object",
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": _DURATION,
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["expr"],
                                    "properties": {
                                        "alert": {"type": "string"},
                                        "record": {"type": "string"},
                                        "expr": {"type": ["string", "integer"]},
                                        "for": _DURATION,
                                        "keep_firing_for": _DURATION,
                                        "labels": _STRING_MAP,
                                        "annotations": _STRING_MAP,
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    ),
}


@cache
def operator_validator(kind: str) -> jsonschema.Draft7Validator:
    schema = closed(OPERATOR_SCHEMAS[kind])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def schema_errors(validator: jsonschema.Draft7Validator, obj: Obj) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
