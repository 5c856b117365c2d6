"""The Kubernetes manifests in deploy/k8s, checked offline: every file parses; the core kinds validate against
Kubernetes' own schemas (kubernetes-validate, strict: unknown fields fail); the KEDA kinds validate against KEDA's
CRD schemas kept in tests/data/keda and the Prometheus Operator's against a minimal schema of the fields we use
(both closed the way the API server's strict field validation closes them); and the worker's references between
the files hold (names, keys, ports, streams, the drain and the grace period, the GPU variant). The gateway's, the
disruption budgets', network policies' and monitoring's are in test_k8s_gateway.py and test_k8s_monitoring.py.

Overlays are rendered offline (tests/deploy/support.py); when `kubectl` is on PATH, a test checks that
`kubectl kustomize` renders the same objects.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from client.protocol import LANES
from client.store import CONSUMER_GROUP, Keys
from tests.deploy.support import (
    BASE,
    BASE_KINDS,
    GPU,
    GPU_MONITORING,
    K8S,
    KEDA_CRDS,
    MONITORING,
    MONITORING_COMPONENT,
    OPERATOR_KINDS,
    ROOT,
    SECRET_EXAMPLE,
    Obj,
    configmap_env,
    container,
    keda_validator,
    key,
    kustomization,
    load,
    manifest_files,
    one,
    rendered,
    schema_errors,
    secret,
    secret_data,
    secrets,
    settings_env,
    worker_part,
)

PROMETHEUS_ALTERNATIVE = K8S / "alternatives" / "scaledobject-prometheus.yaml"
# Trigger type and the Secret keys its TriggerAuthentication reads, per Redis topology.
TOPOLOGY_ALTERNATIVES = {
    K8S / "alternatives" / "scaledobject-redis-cluster.yaml": ("redis-cluster-streams", {"addresses", "password"}),
    K8S / "alternatives" / "scaledobject-redis-sentinel.yaml": (
        "redis-sentinel-streams",
        {"addresses", "password", "sentinelPassword"},
    ),
}
CLUSTER_ALTERNATIVE = K8S / "alternatives" / "scaledobject-redis-cluster.yaml"
PARTITIONED_ALTERNATIVE = K8S / "alternatives" / "scaledobject-redis-cluster-partitions.yaml"  # 3 partitions
KUBERNETES_VERSION = "1.30.0"  # a version kubernetes-validate ships schemas for, and still widely run
CORE_KINDS = (BASE_KINDS - {"ScaledObject", "TriggerAuthentication"}) | {"Secret"}
KEDA_KINDS = {"ScaledObject", "TriggerAuthentication"}
HEALTH_CHECK = ["python", "-m", "worker.health"]
OVERLAYS = [BASE, GPU, MONITORING, GPU_MONITORING]


def every_object() -> list[tuple[str, Obj]]:
    """Every object a user may apply: both variants, the monitoring component's, the Secret examples and the
    alternative ScaledObjects."""
    out = [(f"base:{k}/{n}", obj) for obj in rendered(BASE) for k, n in [key(obj)]]
    out += [(f"gpu:{k}/{n}", obj) for obj in rendered(GPU) for k, n in [key(obj)]]
    out += [
        (f"monitoring:{k}/{n}", obj)
        for obj in rendered(MONITORING)
        if obj["kind"] in OPERATOR_KINDS
        for k, n in [key(obj)]
    ]
    out += [(f"{SECRET_EXAMPLE.name}:{name}", obj) for name, obj in secrets().items()]
    out += [(PROMETHEUS_ALTERNATIVE.name, obj) for obj in load(PROMETHEUS_ALTERNATIVE)]
    out += [(path.name, obj) for path in TOPOLOGY_ALTERNATIVES for obj in load(path)]
    out += [(PARTITIONED_ALTERNATIVE.name, obj) for obj in load(PARTITIONED_ALTERNATIVE)]
    return out


VARIANTS = pytest.mark.parametrize("variant", [BASE, GPU], ids=["cpu", "gpu"])


# --- schemas ----------------------------------------------------------------------------------------------------


def test_every_file_parses_into_named_objects() -> None:
    files = manifest_files()
    assert len(files) >= 10, files
    for path in files:
        docs = load(path)
        assert docs, path
        for doc in docs:
            assert {"apiVersion", "kind"} <= set(doc), path
            if doc["kind"] not in ("Kustomization", "Component"):
                assert doc["metadata"]["name"], path


def test_base_kustomization_lists_every_base_manifest_and_not_the_secret() -> None:
    listed = kustomization(BASE)["resources"]
    on_disk = sorted(p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk
    assert {obj["kind"] for obj in rendered(BASE)} == BASE_KINDS
    # The real Secrets are the user's: `kubectl apply -k` must never overwrite them with placeholders.
    assert all(obj["kind"] != "Secret" for overlay in OVERLAYS for obj in rendered(overlay))
    assert kustomization(GPU)["resources"] == ["../base"]


def test_the_operator_kinds_stay_out_of_the_base_and_the_gpu_variant() -> None:
    """A cluster without the Prometheus Operator's CRDs applies base/ or gpu/; the monitoring overlays add the
    component's objects and change nothing else."""
    for plain, monitored in ((BASE, MONITORING), (GPU, GPU_MONITORING)):
        assert not {obj["kind"] for obj in rendered(plain)} & OPERATOR_KINDS
        extra = [obj for obj in rendered(monitored) if key(obj) not in {key(o) for o in rendered(plain)}]
        assert sorted(key(obj) for obj in extra) == sorted(key(obj) for obj in load_component())
        assert [obj for obj in rendered(monitored) if obj not in extra] == list(rendered(plain))
    assert kustomization(MONITORING_COMPONENT)["kind"] == "Component"


def load_component() -> list[Obj]:
    return [
        obj for path in kustomization(MONITORING_COMPONENT)["resources"] for obj in load(MONITORING_COMPONENT / path)
    ]


def test_core_kinds_validate_strictly_against_kubernetes() -> None:
    checked = set()
    for name, obj in every_object():
        if obj["kind"] in KEDA_KINDS | OPERATOR_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{name}: {error}")
        checked.add(obj["kind"])
    assert checked == CORE_KINDS


def test_kubernetes_validation_rejects_an_unknown_field() -> None:
    """The validator is not vacuous: a misspelt field in the Deployment fails."""
    deployment = copy.deepcopy(worker_part(rendered(BASE), "Deployment"))
    deployment["spec"]["template"]["spec"]["terminationGracePeriod"] = 45
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def keda_errors(obj: Obj) -> list[str]:
    assert obj["apiVersion"] == "keda.sh/v1alpha1"
    return schema_errors(keda_validator(obj["kind"]), obj)


def test_crd_files_say_where_they_come_from() -> None:
    for kind in KEDA_KINDS:
        header = (KEDA_CRDS / f"keda.sh_{kind.lower()}s.yaml").read_text().split("\n---", 1)[0]
        assert "github.com/kedacore/keda" in header and "commit" in header, kind


def test_keda_kinds_validate_against_keda_crds() -> None:
    checked = set()
    for name, obj in every_object():
        if obj["kind"] in KEDA_KINDS:
            assert keda_errors(obj) == [], name
            checked.add(obj["kind"])
    assert checked == KEDA_KINDS


@pytest.mark.parametrize(
    "spoil",
    [
        lambda so: so["spec"].update(pollingIntervall=15),  # misspelt field
        lambda so: so["spec"]["triggers"][0]["metadata"].update(lagCount=24),  # metadata values are strings
        lambda so: so["spec"]["advanced"]["scalingModifiers"].update(metricType="Utilization"),
        lambda so: so["spec"]["scaleTargetRef"].pop("name"),
    ],
    ids=["unknown-field", "int-metadata", "bad-enum", "missing-required"],
)
def test_keda_validation_rejects_broken_scaled_objects(spoil: Any) -> None:
    scaled = copy.deepcopy(one(rendered(BASE), "ScaledObject"))
    spoil(scaled)
    assert keda_errors(scaled)


# --- references between the manifests ---------------------------------------------------------------------------


@VARIANTS
def test_one_scaled_object_targets_the_worker_deployment(variant: Path) -> None:
    objects = rendered(variant)
    deployment, scaled = worker_part(objects, "Deployment"), one(objects, "ScaledObject")
    target = scaled["spec"]["scaleTargetRef"]
    assert (target.get("apiVersion", "apps/v1"), target.get("kind", "Deployment")) == ("apps/v1", "Deployment")
    assert target["name"] == deployment["metadata"]["name"]
    assert scaled["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    # The autoscaler owns the replica count; a value in the manifest would reset it on every apply.
    assert "replicas" not in deployment["spec"]
    assert 1 <= scaled["spec"]["minReplicaCount"] < scaled["spec"]["maxReplicaCount"]
    assert scaled["spec"]["pollingInterval"] > 0 and scaled["spec"]["cooldownPeriod"] > 0


def lane_streams(env: dict[str, str]) -> dict[str, str]:
    return dict(Keys(env["LLMQ_QUEUE"], env["LLMQ_PREFIX"]).lanes)


def held_streams(env: dict[str, str]) -> dict[str, str]:
    keys = Keys(env["LLMQ_QUEUE"], env["LLMQ_PREFIX"])
    return {lane: keys.held(lane) for lane in keys.lanes}


@VARIANTS
def test_every_lane_stream_has_a_lag_and_a_pending_trigger_and_its_held_stream_a_length_one(variant: Path) -> None:
    objects = rendered(variant)
    triggers = one(objects, "ScaledObject")["spec"]["triggers"]
    auth = one(objects, "TriggerAuthentication")["metadata"]["name"]
    env = configmap_env(objects)
    streams, held = lane_streams(env), held_streams(env)
    assert streams["default"] == "{llmq:default}:requests" and held["batch"] == "{llmq:default}:held:batch"
    seen = set()
    for trigger in triggers:
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams"
        assert trigger["authenticationRef"]["name"] == auth
        if "streamLength" in meta:  # XLEN: a held stream has no consumer group
            assert "consumerGroup" not in meta and int(meta["streamLength"]) > 0
            seen.add((meta["stream"], "length"))
            continue
        assert meta["consumerGroup"] == CONSUMER_GROUP
        # KEDA reads the lag (XINFO GROUPS) when lagCount is non-zero, XPENDING when only pendingEntriesCount is set.
        mode = "lag" if int(meta.get("lagCount", "0")) > 0 else "pending"
        assert mode == "lag" or int(meta["pendingEntriesCount"]) > 0
        seen.add((meta["stream"], mode))
    expected = {(stream, mode) for stream in streams.values() for mode in ("lag", "pending")}
    expected |= {(stream, "length") for stream in held.values()}
    assert seen == expected and len(triggers) == len(expected)


def formula_terms(formula: str) -> list[str]:
    """The trigger names a formula adds up; anything but a plain sum of names fails."""
    terms: list[str] = []

    def walk(node: ast.expr) -> None:
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            walk(node.left)
            walk(node.right)
        elif isinstance(node, ast.Name):
            terms.append(node.id)
        else:
            raise AssertionError(f"not a sum of trigger names: {ast.dump(node)}")

    walk(ast.parse(formula, mode="eval").body)
    return terms


@VARIANTS
def test_the_formula_adds_every_trigger_against_a_per_worker_target(variant: Path) -> None:
    objects = rendered(variant)
    scaled = one(objects, "ScaledObject")
    modifiers = scaled["spec"]["advanced"]["scalingModifiers"]
    names = [trigger["name"] for trigger in scaled["spec"]["triggers"]]
    assert sorted(formula_terms(modifiers["formula"])) == sorted(names) and len(set(names)) == len(names)
    assert modifiers.get("metricType", "AverageValue") == "AverageValue"  # desired = ceil(sum / target)
    # A worker never holds more than LLMQ_MAX_RUNNING requests: a larger target would never scale up.
    max_running = int(configmap_env(objects)["LLMQ_MAX_RUNNING"])
    assert 0 < float(modifiers["target"]) <= max_running


def test_the_gpu_target_follows_the_gpu_batch() -> None:
    cpu, gpu = (one(rendered(v), "ScaledObject")["spec"]["advanced"]["scalingModifiers"] for v in (BASE, GPU))
    assert float(gpu["target"]) > float(cpu["target"])
    assert gpu["formula"] == cpu["formula"]


def test_trigger_authentication_reads_keys_that_the_secret_has() -> None:
    auth = one(rendered(BASE), "TriggerAuthentication")
    refs = auth["spec"]["secretTargetRef"]
    assert {ref["parameter"] for ref in refs} >= {"password", "address"}
    data = secret_data(secret())
    for ref in refs:
        assert ref["name"] == secret()["metadata"]["name"]
        assert ref["key"] in data, ref
    assert secret()["metadata"]["namespace"] == auth["metadata"]["namespace"]


def test_keda_and_the_workers_reach_the_same_redis() -> None:
    data = secret_data(secret())
    url = urlsplit(data["redis-url"])
    by_parameter = {
        ref["parameter"]: data[ref["key"]]
        for ref in one(rendered(BASE), "TriggerAuthentication")["spec"]["secretTargetRef"]
    }
    assert by_parameter["address"] == f"{url.hostname}:{url.port}"
    assert by_parameter["password"] == url.password
    assert "." in str(url.hostname)  # KEDA runs in another namespace: a bare Service name would not resolve
    for trigger in one(rendered(BASE), "ScaledObject")["spec"]["triggers"]:
        assert trigger["metadata"]["databaseIndex"] == url.path.strip("/")
        assert trigger["metadata"]["enableTLS"] == ("true" if url.scheme == "rediss" else "false")
        assert not {"address", "host", "password"} & set(trigger["metadata"])  # from the Secret only


def test_secret_example_holds_placeholders_only() -> None:
    doc = secret()
    text = SECRET_EXAMPLE.read_text()
    assert "EXAMPLE" in text.split("apiVersion")[0]
    assert set(secrets()) == {"llmq-redis", "llmq-gateway"}
    assert all(obj["type"] == "Opaque" for obj in secrets().values())
    data = secret_data(doc)
    assert urlsplit(data["redis-url"]).password == data["redis-password"] == "CHANGE-ME"
    assert secret_data(secrets()["llmq-gateway"]) == {"api-keys": "CHANGE-ME"}


@VARIANTS
def test_workers_get_settings_from_the_configmap_and_the_url_from_the_secret(variant: Path) -> None:
    objects = rendered(variant)
    worker = container(objects)
    assert worker["envFrom"] == [{"configMapRef": {"name": worker_part(objects, "ConfigMap")["metadata"]["name"]}}]
    env = {item["name"]: item for item in worker["env"]}
    ref = env["LLMQ_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret()["metadata"]["name"] and ref["key"] in secret_data(secret())
    assert "LLMQ_REDIS_URL" not in configmap_env(objects)
    names = set(configmap_env(objects)) | {n for n in env if n.startswith("LLMQ_")}
    assert names <= settings_env(), names - settings_env()
    # Service links would add `<SERVICE>_PORT=tcp://...` variables, some of which could be LLMQ_* settings.
    assert worker_part(objects, "Deployment")["spec"]["template"]["spec"]["enableServiceLinks"] is False


@VARIANTS
def test_grace_period_outlasts_the_drain(variant: Path) -> None:
    objects = rendered(variant)
    grace = worker_part(objects, "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    drain = float(configmap_env(objects)["LLMQ_DRAIN_TIMEOUT_S"])
    assert grace > drain
    assert grace - drain >= 10, "room to hand back, flush and close after the drain"


def test_grace_period_matches_compose() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    stop = compose["services"]["worker"]["stop_grace_period"]
    grace = worker_part(rendered(BASE), "Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert stop == f"{grace}s"


@VARIANTS
def test_probes_run_the_health_check(variant: Path) -> None:
    worker = container(rendered(variant))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["exec"]["command"] == HEALTH_CHECK, probe
        # One check imports torch (seconds of CPU): a short timeout would fail a healthy worker.
        assert worker[probe]["timeoutSeconds"] >= 5, probe
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 180  # the Dockerfile's start period


@VARIANTS
def test_volumes_cover_every_path_the_worker_writes(variant: Path) -> None:
    objects = rendered(variant)
    worker, env = container(objects), configmap_env(objects)
    assert worker["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in worker_part(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in worker["volumeMounts"]}
    for path in (env["LLMQ_MODEL_CACHE_DIR"], str(Path(env["LLMQ_HEALTH_FILE"]).parent), "/home/llmq"):
        assert path in mounts, path
        assert "emptyDir" in volumes[mounts[path]] or "persistentVolumeClaim" in volumes[mounts[path]]


@VARIANTS
def test_metrics_port_is_the_same_everywhere(variant: Path) -> None:
    objects = rendered(variant)
    port = int(configmap_env(objects)["LLMQ_METRICS_PORT"])
    assert port > 0  # 0 would turn the endpoint off
    (container_port,) = [p for p in container(objects)["ports"] if p["name"] == "metrics"]
    assert container_port["containerPort"] == port
    service = worker_part(objects, "Service")
    (service_port,) = service["spec"]["ports"]
    assert service_port["port"] == port and service_port["targetPort"] in (port, container_port["name"])
    assert service["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    assert service["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    labels = worker_part(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert worker_part(objects, "Deployment")["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_images_name_no_registry() -> None:
    for variant, tag in ((BASE, "cpu"), (GPU, "cuda")):
        image = container(rendered(variant))["image"]
        assert "/" not in image and image == f"llmq-worker:{tag}"


# --- the GPU variant --------------------------------------------------------------------------------------------


def test_gpu_variant_requests_a_gpu_and_the_compose_cuda_sizes() -> None:
    worker = container(rendered(GPU))
    assert str(worker["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert "nvidia.com/gpu" not in container(rendered(BASE))["resources"].get("limits", {})
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for service, variant in (("worker-cuda", GPU), ("worker", BASE)):
        compose_env = compose["services"][service]["environment"]
        env = configmap_env(rendered(variant))
        shared = (set(compose_env) & set(env)) - {"LLMQ_REDIS_URL"}
        assert {"LLMQ_KV_CACHE_TOKENS", "LLMQ_MAX_RUNNING"} <= shared
        assert {name: str(compose_env[name]) for name in shared} == {name: env[name] for name in shared}, service
    assert configmap_env(rendered(GPU))["LLMQ_DEVICE"] == "cuda"
    assert configmap_env(rendered(BASE))["LLMQ_DEVICE"] == "cpu"
    tolerations = worker_part(rendered(GPU), "Deployment")["spec"]["template"]["spec"]["tolerations"]
    assert any(t["key"] == "nvidia.com/gpu" for t in tolerations)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("variant", OVERLAYS, ids=lambda path: path.name)
def test_kustomize_renders_what_the_tests_check(variant: Path) -> None:
    """Our small strategic merge agrees with kustomize itself, so the checks above hold for what users apply."""
    out = subprocess.run(["kubectl", "kustomize", str(variant)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    theirs = {key(obj): obj for obj in yaml.safe_load_all(out.stdout) if obj}
    ours = {key(obj): obj for obj in rendered(variant)}
    assert theirs == ours


# --- the Prometheus alternative ---------------------------------------------------------------------------------


def test_prometheus_alternative_replaces_the_default_scaled_object() -> None:
    (alternative,) = load(PROMETHEUS_ALTERNATIVE)
    default = one(rendered(BASE), "ScaledObject")
    # Same name and namespace: applying it replaces the default instead of adding a second ScaledObject on the
    # Deployment, which KEDA refuses.
    assert key(alternative) == key(default)
    assert alternative["metadata"]["namespace"] == default["metadata"]["namespace"]
    assert alternative["spec"]["scaleTargetRef"] == default["spec"]["scaleTargetRef"]
    assert PROMETHEUS_ALTERNATIVE.name not in str(kustomization(BASE)) + str(kustomization(GPU))
    (trigger,) = alternative["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    assert "llmq:backlog_seconds" in trigger["metadata"]["query"]
    assert float(trigger["metadata"]["threshold"]) > 0
    assert alternative["spec"]["minReplicaCount"] >= 1  # no gauge without a worker: no scale from zero


@pytest.mark.parametrize("path", list(TOPOLOGY_ALTERNATIVES), ids=lambda path: path.stem)
def test_cluster_and_sentinel_alternatives_read_the_default_counts_through_their_own_trigger(path: Path) -> None:
    trigger_type, parameters = TOPOLOGY_ALTERNATIVES[path]
    alternative, authentication = load(path)
    default = one(rendered(BASE), "ScaledObject")
    assert key(alternative) == key(default)  # replaces the default (KEDA refuses two on one Deployment)
    assert path.name not in str(kustomization(BASE)) + str(kustomization(GPU))
    assert {k: v for k, v in alternative["spec"].items() if k != "triggers"} == {
        k: v for k, v in default["spec"].items() if k != "triggers"
    }
    pairs = zip(alternative["spec"]["triggers"], default["spec"]["triggers"], strict=True)
    for trigger, twin in pairs:
        assert trigger["type"] == trigger_type and trigger["name"] == twin["name"]
        assert trigger["authenticationRef"]["name"] == authentication["metadata"]["name"]
        for field in ("stream", "consumerGroup", "lagCount", "pendingEntriesCount", "streamLength", "enableTLS"):
            assert trigger["metadata"].get(field) == twin["metadata"].get(field), field
    assert {ref["parameter"] for ref in authentication["spec"]["secretTargetRef"]} == parameters


# --- the preStop hook, run against a stand-in for the worker ----------------------------------------------------

# Behaves as the worker does: the first SIGTERM starts a drain of DRAIN_S seconds, a second one ends it at once.
WORKER_STAND_IN = """
import signal, sys, time
DRAIN_S = float(sys.argv[1])
terms = []
signal.signal(signal.SIGTERM, lambda *_: terms.append(time.monotonic()))
print("ready", flush=True)
while not terms:
    time.sleep(0.01)
while time.monotonic() < terms[0] + DRAIN_S and len(terms) < 2:
    time.sleep(0.01)
print("hurried" if len(terms) > 1 else "drained", len(terms), flush=True)
"""


def run_termination(hook: list[str], grace_s: float, drain_s: float = 1.0) -> str:
    """What the kubelet does on pod deletion, with the stand-in as PID 1: run the preStop hook, then send SIGTERM
    if the container still runs, then SIGKILL at the end of the grace period. Returns the stand-in's last line."""
    worker = subprocess.Popen([sys.executable, "-c", WORKER_STAND_IN, str(drain_s)], stdout=subprocess.PIPE, text=True)
    assert worker.stdout is not None and worker.stdout.readline().strip() == "ready"
    reaper = threading.Thread(target=worker.wait)  # reap at once, as a container's end would: `kill -0` then fails
    reaper.start()
    script = hook[-1]
    replaced = script.replace("kill -TERM 1", f"kill -TERM {worker.pid}").replace("kill -0 1", f"kill -0 {worker.pid}")
    started = time.monotonic()
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run([*hook[:-1], replaced], timeout=grace_s, check=False)
    if worker.poll() is None:
        worker.terminate()  # the kubelet's own stop signal
    reaper.join(timeout=max(0.1, grace_s - (time.monotonic() - started)))
    if worker.poll() is None:
        worker.kill()
        reaper.join()
        return "killed"
    return worker.stdout.read().strip().splitlines()[-1]


@VARIANTS
def test_prestop_starts_the_drain_and_holds_the_kubelet_until_the_worker_exits(variant: Path) -> None:
    objects = rendered(variant)
    hook = container(objects)["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:2] == ["/bin/sh", "-c"] and "kill -TERM 1" in hook[2] and "kill -0 1" in hook[2]
    assert run_termination(hook, grace_s=10, drain_s=0.5) == "drained 1"


def test_a_hook_that_returns_before_the_drain_ends_would_cut_it_short() -> None:
    """The stand-in above can fail: a hook that signals and sleeps less than the drain lets the kubelet's SIGTERM
    arrive as the second one, which ends the drain."""
    assert run_termination(["/bin/sh", "-c", "kill -TERM 1; sleep 0.2"], grace_s=10) == "hurried 2"


def test_the_partitioned_alternative_counts_every_partition_as_the_cluster_one_counts_the_queue() -> None:
    """LLMQ_QUEUE_PARTITIONS=3 on a Cluster: the nine counts of the cluster alternative for each partition's
    streams, one formula adding all 27, and otherwise the same ScaledObject and TriggerAuthentication."""
    partitioned, authentication = load(PARTITIONED_ALTERNATIVE)
    single, single_authentication = load(CLUSTER_ALTERNATIVE)
    assert key(partitioned) == key(single) and authentication == single_authentication
    without = ("triggers", "advanced")
    assert {k: v for k, v in partitioned["spec"].items() if k not in without} == {
        k: v for k, v in single["spec"].items() if k not in without
    }
    triggers = partitioned["spec"]["triggers"]
    names = [trigger["name"] for trigger in triggers]
    assert sorted(formula_terms(partitioned["spec"]["advanced"]["scalingModifiers"]["formula"])) == sorted(names)
    assert len(set(names)) == len(names) == 27

    def streams(keys: Keys) -> dict[str, str]:
        """Each stream a trigger reads -> what it is, the same in every partition."""
        return {**{s: f"lane {lane}" for lane, s in keys.lanes.items()}, **{keys.held(x): f"held {x}" for x in LANES}}

    home = streams(Keys("default"))
    for keys in Keys("default").partitioned(3):
        mine = [trigger for trigger in triggers if trigger["metadata"]["stream"] in streams(keys)]
        assert len(mine) == len(single["spec"]["triggers"])
        for trigger, twin in zip(mine, single["spec"]["triggers"], strict=True):
            what = home[twin["metadata"]["stream"]]
            own = next(stream for stream, same in streams(keys).items() if same == what)
            assert trigger["metadata"] == {**twin["metadata"], "stream": own}
            assert trigger["type"] == twin["type"] and trigger["authenticationRef"] == twin["authenticationRef"]
