"""The gateway's manifests in deploy/k8s/base, and what the worker and the gateway share there: the disruption
budgets, the topology spread and the network policies. Schemas are checked in test_k8s_manifests.py; here the
references between the objects, and the settings the gateway would read from them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from gateway.settings import GatewaySettings
from tests.deploy.support import (
    BASE,
    COMPOSE_FILE,
    GATEWAY,
    GPU,
    ROOT,
    WORKER,
    Obj,
    configmap_env,
    container,
    gateway_part,
    gateway_settings_env,
    named,
    pod_labels,
    rendered,
    secret,
    secret_data,
    secrets,
    selects,
    worker_part,
)

VARIANTS = pytest.mark.parametrize("variant", [BASE, GPU], ids=["cpu", "gpu"])
NAMESPACE = "llmq"
REDIS_POD = {"app.kubernetes.io/name": "redis"}  # the Redis pods' label the first policy expects


def deployments(objects: tuple[Obj, ...]) -> list[Obj]:
    return [obj for obj in objects if obj["kind"] == "Deployment"]


def gateway_env(objects: tuple[Obj, ...]) -> dict[str, str]:
    """The gateway's environment as the kubelet would set it, with the example Secrets' values."""
    env = dict(configmap_env(objects, GATEWAY))
    for item in container(objects, GATEWAY)["env"]:
        ref = item["valueFrom"]["secretKeyRef"]
        env[item["name"]] = secret_data(secrets()[ref["name"]])[ref["key"]]
    return env


# --- the gateway ------------------------------------------------------------------------------------------------


def test_gateway_settings_come_from_the_configmap_and_the_secrets() -> None:
    objects = rendered(BASE)
    gateway = container(objects, GATEWAY)
    assert gateway["envFrom"] == [{"configMapRef": {"name": GATEWAY["ConfigMap"]}}]
    env = {item["name"]: item["valueFrom"]["secretKeyRef"] for item in gateway["env"]}
    # The same Redis URL as the workers', from the same Secret key; nothing secret in the ConfigMap.
    worker_url = {item["name"]: item for item in container(objects)["env"]}["LLMQ_REDIS_URL"]["valueFrom"]
    assert env["LLMQ_GATEWAY_REDIS_URL"] == worker_url["secretKeyRef"]
    assert env["LLMQ_GATEWAY_API_KEYS"] == {"name": "llmq-gateway", "key": "api-keys", "optional": True}
    assert not {"LLMQ_GATEWAY_REDIS_URL", "LLMQ_GATEWAY_API_KEYS"} & set(configmap_env(objects, GATEWAY))
    names = set(configmap_env(objects, GATEWAY)) | set(env)
    assert names <= gateway_settings_env(), names - gateway_settings_env()


def test_the_gateway_reads_its_settings_and_serves_the_workers_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    objects = rendered(BASE)
    for name, value in gateway_env(objects).items():
        monkeypatch.setenv(name, value)
    settings = GatewaySettings(_env_file=None)  # type: ignore[call-arg]
    workers = configmap_env(objects)
    assert workers["LLMQ_QUEUE"] in settings.queue_names
    assert settings.prefix == workers["LLMQ_PREFIX"]
    assert settings.redis_url.get_secret_value() == secret_data(secret())["redis-url"]
    assert settings.keys == [b"CHANGE-ME"]
    (port,) = container(objects, GATEWAY)["ports"]
    assert port == {"name": "http", "containerPort": settings.port, "protocol": "TCP"}


def test_service_links_are_off_in_every_deployment() -> None:
    """A Service named `llmq-gateway` makes the kubelet set LLMQ_GATEWAY_PORT=tcp://<ip>:8000 in every pod that
    has service links, which the gateway reads as its port and refuses."""
    with pytest.raises(ValidationError):
        GatewaySettings(_env_file=None, port="tcp://10.0.0.7:8000")  # type: ignore[call-arg, arg-type]
    assert gateway_part(rendered(BASE), "Service")["metadata"]["name"] == "llmq-gateway"
    for variant in (BASE, GPU):
        for deployment in deployments(rendered(variant)):
            assert deployment["spec"]["template"]["spec"]["enableServiceLinks"] is False, deployment["metadata"]


def test_the_service_reaches_the_gateway_port_and_says_where_metrics_are() -> None:
    objects = rendered(BASE)
    service, deployment = gateway_part(objects, "Service"), gateway_part(objects, "Deployment")
    port = int(configmap_env(objects, GATEWAY)["LLMQ_GATEWAY_PORT"])
    (service_port,) = service["spec"]["ports"]
    assert service_port["name"] == "http" and service_port["targetPort"] == "http" and service_port["port"] == port
    assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(deployment))
    assert not selects({"matchLabels": service["spec"]["selector"]}, pod_labels(worker_part(objects, "Deployment")))
    annotations = service["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }
    assert selects(deployment["spec"]["selector"], pod_labels(deployment))


def test_probes_use_the_gateway_endpoints() -> None:
    """Readiness follows Redis (/health answers 503 without it); liveness and startup only need the process
    (/metrics), so a Redis outage never restarts a gateway."""
    gateway = container(rendered(BASE), GATEWAY)
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "http"}
    assert gateway["startupProbe"]["httpGet"] == {"path": "/metrics", "port": "http"}
    routes = (ROOT / "gateway" / "app.py").read_text()
    assert 'Route("/health", health' in routes and 'Route("/metrics", metrics' in routes


def test_the_grace_period_covers_the_prestop_pause_and_uvicorns_shutdown() -> None:
    deployment = gateway_part(rendered(BASE), "Deployment")
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    hook = container(rendered(BASE), GATEWAY)["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:2] == ["/bin/sh", "-c"]
    pause = int(re.fullmatch(r"sleep (\d+)", hook[2]).group(1))  # type: ignore[union-attr]
    shutdown = int(re.search(r"timeout_graceful_shutdown=(\d+)", (ROOT / "gateway/__main__.py").read_text()).group(1))  # type: ignore[union-attr]
    assert grace >= pause + shutdown + 5
    compose = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["gateway"]["stop_grace_period"]
    assert int(compose.removesuffix("s")) > shutdown  # compose has no preStop pause


def test_the_gateway_runs_read_only_as_the_image_user() -> None:
    deployment = gateway_part(rendered(BASE), "Deployment")
    pod, gateway = deployment["spec"]["template"]["spec"], container(rendered(BASE), GATEWAY)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert gateway["securityContext"]["readOnlyRootFilesystem"] is True
    assert gateway["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {m["mountPath"] for m in gateway["volumeMounts"]} == {"/tmp"}
    assert gateway["image"] == "llmq-gateway:latest"  # no registry: the user points it at theirs


def test_the_hpa_owns_the_gateway_replica_count_on_cpu() -> None:
    objects = rendered(BASE)
    hpa, deployment = gateway_part(objects, "HorizontalPodAutoscaler"), gateway_part(objects, "Deployment")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", GATEWAY["Deployment"])
    assert "replicas" not in deployment["spec"]  # an apply would reset the HPA's count
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
    assert 0 < metric["resource"]["target"]["averageUtilization"] <= 100
    # Utilization is relative to the request: without one the HPA has nothing to divide by.
    assert container(objects, GATEWAY)["resources"]["requests"]["cpu"]


# --- both parts -------------------------------------------------------------------------------------------------


@VARIANTS
def test_each_part_has_a_disruption_budget_that_leaves_it_serving(variant: Path) -> None:
    objects = rendered(variant)
    budgets = [obj for obj in objects if obj["kind"] == "PodDisruptionBudget"]
    for part in (WORKER, GATEWAY):
        deployment = named(objects, "Deployment", part["Deployment"])
        (budget,) = [b for b in budgets if selects(b["spec"]["selector"], pod_labels(deployment))]
        assert budget["spec"]["maxUnavailable"] == 1 and "minAvailable" not in budget["spec"]
        assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # a pod not ready never blocks a drain
    assert len(budgets) == 2
    # The gateway's HPA keeps more replicas than a drain may take at once.
    assert gateway_part(objects, "HorizontalPodAutoscaler")["spec"]["minReplicas"] > 1


@VARIANTS
def test_both_parts_spread_over_zones_and_nodes(variant: Path) -> None:
    objects = rendered(variant)
    for deployment in deployments(objects):
        labels = pod_labels(deployment)
        others = [pod_labels(d) for d in deployments(objects) if d is not deployment]
        constraints = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
        keys = [c["topologyKey"] for c in constraints]
        assert keys == ["topology.kubernetes.io/zone", "kubernetes.io/hostname"], deployment["metadata"]["name"]
        for constraint in constraints:
            assert selects(constraint["labelSelector"], labels)
            assert not any(selects(constraint["labelSelector"], other) for other in others)
            assert constraint["maxSkew"] == 1
            # A worker on a crowded node beats none; and each rollout spreads its own new pods.
            assert constraint["whenUnsatisfiable"] == "ScheduleAnyway"
            assert constraint["matchLabelKeys"] == ["pod-template-hash"]


# --- network policies --------------------------------------------------------------------------------------------


def _peer_admits(peer: Obj, labels: dict[str, str], namespace: str) -> bool:
    if "ipBlock" in peer:
        return False
    namespace_labels = {"kubernetes.io/metadata.name": namespace}
    if "namespaceSelector" in peer:
        in_namespace = selects(peer["namespaceSelector"], namespace_labels)
    else:
        in_namespace = namespace == NAMESPACE  # a podSelector alone: the policy's own namespace
    return in_namespace and selects(peer.get("podSelector", {}), labels)


def _port_matches(rule_port: Obj, port: int, names: dict[str, int]) -> bool:
    wanted = rule_port["port"]
    return rule_port.get("protocol", "TCP") == "TCP" and (wanted == port or names.get(wanted) == port)


def admits(policy: Obj, labels: dict[str, str], namespace: str, port: int, names: dict[str, int] | None = None) -> bool:
    """Whether `policy` (ingress) lets a pod with `labels` in `namespace` connect to `port` of its pods, whose
    container ports are called `names`."""
    for rule in policy["spec"].get("ingress", []):
        peers_ok = "from" not in rule or any(_peer_admits(peer, labels, namespace) for peer in rule["from"])
        ports_ok = "ports" not in rule or any(_port_matches(p, port, names or {}) for p in rule["ports"])
        if peers_ok and ports_ok:
            return True
    return False


def policies() -> dict[str, Obj]:
    return {obj["metadata"]["name"]: obj for obj in rendered(BASE) if obj["kind"] == "NetworkPolicy"}


def port_names(objects: tuple[Obj, ...], part: dict[str, str]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container(objects, part)["ports"]}


def test_each_pod_kind_has_one_ingress_policy() -> None:
    objects = rendered(BASE)
    for labels in [pod_labels(d) for d in deployments(objects)] + [REDIS_POD]:
        chosen = [p for p in policies().values() if selects(p["spec"]["podSelector"], labels)]
        assert len(chosen) == 1, labels
        assert chosen[0]["spec"]["policyTypes"] == ["Ingress"]  # outbound stays open (model downloads)


def test_only_workers_gateways_keda_and_redis_itself_reach_redis() -> None:
    objects = rendered(BASE)
    policy = policies()["llmq-redis"]
    redis_port = int(str(secret_data(secret())["redis-address"]).rsplit(":", 1)[1])
    for deployment in deployments(objects):
        assert admits(policy, pod_labels(deployment), NAMESPACE, redis_port), deployment["metadata"]["name"]
    assert admits(policy, {"app": "keda-operator"}, "keda", redis_port)  # KEDA's redis-streams scaler
    assert admits(policy, REDIS_POD, NAMESPACE, 16379)  # replication, Sentinel, the Cluster bus
    assert admits(policy, pod_labels(worker_part(objects, "Deployment")), NAMESPACE, 26379)  # redis+sentinel://
    for labels, namespace in (({"app": "other"}, NAMESPACE), ({"app.kubernetes.io/name": "llmq-worker"}, "default")):
        assert not admits(policy, labels, namespace, redis_port), (labels, namespace)
    assert not admits(policy, pod_labels(worker_part(objects, "Deployment")), NAMESPACE, 16379)


def test_only_prometheus_reaches_a_worker_and_only_on_the_metrics_port() -> None:
    objects = rendered(BASE)
    policy, names = policies()["llmq-worker"], port_names(objects, WORKER)
    metrics_port = int(configmap_env(objects)["LLMQ_METRICS_PORT"])
    assert admits(policy, {"app.kubernetes.io/name": "prometheus"}, "monitoring", metrics_port, names)
    assert not admits(policy, {"app.kubernetes.io/name": "prometheus"}, "monitoring", 8080, names)
    assert not admits(policy, pod_labels(gateway_part(objects, "Deployment")), NAMESPACE, metrics_port, names)


def test_the_gateway_port_is_open_and_nothing_else() -> None:
    objects = rendered(BASE)
    policy, names = policies()["llmq-gateway"], port_names(objects, GATEWAY)
    port = int(configmap_env(objects, GATEWAY)["LLMQ_GATEWAY_PORT"])
    assert admits(policy, {"app": "ingress-nginx"}, "ingress-nginx", port, names)
    assert admits(policy, {"app.kubernetes.io/name": "prometheus"}, "monitoring", port, names)  # /metrics
    assert not admits(policy, {"app": "ingress-nginx"}, "ingress-nginx", 9400, names)


def test_policy_port_names_are_container_port_names() -> None:
    objects = rendered(BASE)
    for name, part in (("llmq-worker", WORKER), ("llmq-gateway", GATEWAY)):
        names = port_names(objects, part)
        for rule in policies()[name]["spec"]["ingress"]:
            for port in rule.get("ports", []):
                assert isinstance(port["port"], int) or port["port"] in names, (name, port)
