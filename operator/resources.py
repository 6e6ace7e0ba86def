"""Pure: a parsed ModelDeployment spec -> the Deployment, Service and PDB it needs.

No I/O here, so every rule (args, probes, GPU limits, draining, rollout strategy,
labels, owner references) is checked by table tests without a cluster. Server flags
come from `pagefleet.server.config.engine_flag`, the same dataclasses `pagefleet
serve` builds its parser from, so a renamed flag cannot silently break pods.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from pagefleet.operator import crd
from pagefleet.operator.spec import ModelDeploymentSpec
from pagefleet.server.config import ServerConfig, engine_flag

PORT = 8000
PORT_NAME = "http"
CONTAINER_NAME = "server"
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
API_KEY_ENV = "PAGEFLEET_API_KEY"
LABEL_MDEP = "pagefleet.dev/model-deployment"
LAST_APPLIED = "pagefleet.dev/last-applied"
MANAGER = "pagefleet-operator"

# Model loads (download + weights to GPU + CUDA graph capture) take minutes; the
# startup probe gives them 30 minutes before liveness may restart the pod.
STARTUP_PERIOD_S = 10
STARTUP_FAILURES = 180
# Liveness is lenient: /health can be slow under heavy load, and a restart throws
# away every in-flight request (seed report 000). The queue metric, not liveness,
# is the capacity signal.
LIVENESS_PERIOD_S = 15
LIVENESS_TIMEOUT_S = 10
LIVENESS_FAILURES = 4
READINESS_PERIOD_S = 5
READINESS_TIMEOUT_S = 5
READINESS_FAILURES = 3
# On delete/rollout: preStop keeps the pod in the endpoints long enough for
# kube-proxy / gateways to stop routing to it; then SIGTERM lets the server finish
# in-flight requests for its --shutdown-timeout.
PRESTOP_SLEEP_S = 10
_SHUTDOWN_TIMEOUT_S = next(f.default for f in dataclasses.fields(ServerConfig)
                           if f.name == "shutdown_timeout")
TERMINATION_GRACE_S = PRESTOP_SLEEP_S + int(_SHUTDOWN_TIMEOUT_S) + 5
# A rollout may legitimately wait for the whole startup budget.
PROGRESS_DEADLINE_S = STARTUP_PERIOD_S * STARTUP_FAILURES + 600
GPU_RESOURCE = "nvidia.com/gpu"


def selector_labels(name: str) -> dict[str, str]:
    """Labels that pick this ModelDeployment's pods (immutable once created)."""
    return {LABEL_MDEP: name, "app.kubernetes.io/component": "server"}


def selector_string(name: str) -> str:
    """status.selector, the form the scale subresource (and HPA/KEDA) expect."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def labels(spec: ModelDeploymentSpec) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "pagefleet",
        "app.kubernetes.io/instance": spec.name,
        "app.kubernetes.io/managed-by": MANAGER,
        **selector_labels(spec.name),
    }


def endpoint(spec: ModelDeploymentSpec) -> str:
    """OpenAI base URL inside the cluster."""
    return f"http://{spec.name}.{spec.namespace}.svc:{PORT}/v1"


def owner_references(spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    """Children are garbage-collected with the CR on a real cluster. Without a uid
    (only possible outside a real API server) no valid reference can be made."""
    if not spec.uid:
        return []
    return [{"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": spec.name,
             "uid": spec.uid, "controller": True, "blockOwnerDeletion": True}]


def _metadata(spec: ModelDeploymentSpec) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": spec.name, "namespace": spec.namespace, "labels": labels(spec)}
    refs = owner_references(spec)
    if refs:
        meta["ownerReferences"] = refs
    return meta


def _flag_value(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def server_args(spec: ModelDeploymentSpec) -> list[str]:
    """`pagefleet serve` args (the image's ENTRYPOINT is `pagefleet serve`)."""
    args = [spec.model,
            engine_flag("served_model_name"), spec.served_model_name,
            engine_flag("host"), "0.0.0.0",
            engine_flag("port"), str(PORT)]
    for key, field_name in crd.ENGINE_FIELDS.items():
        if key not in spec.engine:
            continue
        flag, value = engine_flag(field_name), spec.engine[key]
        if isinstance(value, bool):  # argparse.BooleanOptionalAction: --x / --no-x
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [flag, _flag_value(value)]
    return args + list(spec.extra_args)


def _probe(period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": HEALTH_PATH, "port": PORT_NAME}, "periodSeconds": period,
            "timeoutSeconds": timeout, "failureThreshold": failures, "successThreshold": 1}


def _resources(spec: ModelDeploymentSpec) -> dict[str, Any]:
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    r = spec.resources
    if r.cpu:
        requests["cpu"] = r.cpu
    if r.memory:
        requests["memory"] = limits["memory"] = r.memory
    if r.gpus > 0:  # extended resources: request == limit, set through limits
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(r.gpus)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _env(spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = []
    if spec.model_cache:
        env.append({"name": "HF_HOME", "value": spec.model_cache.mount_path})
    if spec.api_key:
        env.append({"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": spec.api_key.name, "key": spec.api_key.key}}})
    managed = {e["name"] for e in env}
    return env + [copy.deepcopy(e) for e in spec.env if e["name"] not in managed]


def _tolerations(spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    """GPU nodes are commonly tainted nvidia.com/gpu; tolerate it unless the user
    already says something about that taint."""
    tolerations = [copy.deepcopy(t) for t in spec.tolerations]
    if spec.resources.gpus > 0 and not any(t.get("key") == GPU_RESOURCE for t in tolerations):
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    return tolerations


def pod_template(spec: ModelDeploymentSpec) -> dict[str, Any]:
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shm_size}}]
    if spec.model_cache:
        mounts.append({"name": "model-cache", "mountPath": spec.model_cache.mount_path,
                       "readOnly": spec.model_cache.read_only})
        volumes.append({"name": "model-cache", "persistentVolumeClaim": {
            "claimName": spec.model_cache.claim_name, "readOnly": spec.model_cache.read_only}})
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "args": server_args(spec),
        "ports": [{"name": PORT_NAME, "containerPort": PORT, "protocol": "TCP"}],
        "env": _env(spec),
        "resources": _resources(spec),
        "volumeMounts": mounts,
        "startupProbe": _probe(STARTUP_PERIOD_S, 5, STARTUP_FAILURES),
        "readinessProbe": _probe(READINESS_PERIOD_S, READINESS_TIMEOUT_S, READINESS_FAILURES),
        "livenessProbe": _probe(LIVENESS_PERIOD_S, LIVENESS_TIMEOUT_S, LIVENESS_FAILURES),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_S)]}}},
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "enableServiceLinks": False,
    }
    tolerations = _tolerations(spec)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.affinity:
        pod_spec["affinity"] = copy.deepcopy(spec.affinity)
    if spec.priority_class_name:
        pod_spec["priorityClassName"] = spec.priority_class_name
    return {
        "metadata": {
            "labels": labels(spec),
            "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(PORT),
                            "prometheus.io/path": METRICS_PATH},
        },
        "spec": pod_spec,
    }


def deployment(spec: ModelDeploymentSpec, replicas: int) -> dict[str, Any]:
    """The server Deployment. `replicas` is decided by the caller: spec.replicas, or
    the autoscaler's current value when autoscaling is on."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(spec),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(spec.name)},
            # Never drop below the serving capacity during a rollout: a new pod must be
            # ready (model loaded) before an old one goes.
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "progressDeadlineSeconds": PROGRESS_DEADLINE_S,
            "revisionHistoryLimit": 5,
            "template": pod_template(spec),
        },
    }


def service(spec: ModelDeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(spec),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(spec.name),
            "ports": [{"name": PORT_NAME, "port": PORT, "targetPort": PORT_NAME, "protocol": "TCP"}],
        },
    }


def pod_disruption_budget(spec: ModelDeploymentSpec) -> dict[str, Any]:
    """Node drains take one replica at a time: reloading a model is slow."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(spec),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(spec.name)}},
    }


def initial_replicas(spec: ModelDeploymentSpec, live_replicas: int | None) -> int:
    """Replicas to write on create/update. With autoscaling on, keep what the
    autoscaler set (clamped to the new bounds) instead of resetting it."""
    a = spec.autoscaling
    if not a.enabled:
        return spec.replicas
    if live_replicas is None:
        return a.min_replicas
    return max(a.min_replicas, min(a.max_replicas, live_replicas))


def _managed(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The part of an object the operator owns, recorded as last-applied."""
    meta = obj.get("metadata", {})
    return {"metadata": {"labels": meta.get("labels", {}),
                         "ownerReferences": meta.get("ownerReferences")},
            "spec": obj.get("spec", {})}


def with_last_applied(obj: Mapping[str, Any]) -> dict[str, Any]:
    """Annotate an object with what the operator applied, so a later apply can remove
    fields that the spec no longer asks for (like kubectl apply)."""
    out = copy.deepcopy(dict(obj))
    out["metadata"].setdefault("annotations", {})[LAST_APPLIED] = json.dumps(
        _managed(obj), sort_keys=True, separators=(",", ":"))
    return out


def last_applied(live: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not live:
        return None
    raw = (live.get("metadata", {}).get("annotations") or {}).get(LAST_APPLIED)
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


def merge_patch(previous: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch (RFC 7386) that sets everything in `desired` and removes the
    keys that `previous` (what we applied last time) had and `desired` no longer has.
    Keys set by others (defaults, status, clusterIP) are left alone. Lists replace."""
    patch: dict[str, Any] = {}
    for key, value in desired.items():
        prev = previous.get(key) if previous else None
        if isinstance(value, Mapping) and isinstance(prev, Mapping):
            patch[key] = merge_patch(prev, value)
        else:
            patch[key] = copy.deepcopy(value)
    for key in previous or {}:
        if key not in desired:
            patch[key] = None
    return patch


def apply_patch(live: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that turns `live` into `desired` (annotated with last-applied)."""
    target = with_last_applied(desired)
    prev = last_applied(live)
    patch = merge_patch(prev, {"metadata": {k: v for k, v in target["metadata"].items()
                                            if k not in ("name", "namespace")},
                               "spec": target["spec"]})
    return patch
