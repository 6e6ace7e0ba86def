"""Pure: a parsed ModelDeployment spec -> the Deployment, Service and PDB it needs.

No I/O here, so every rule (args, probes, GPU limits, draining, rollout strategy,
labels, owner references) is checked by table tests without a cluster. Server flags
come from `pagefleet.server.config.engine_flag`, the same dataclasses `pagefleet
serve` builds its parser from, so a renamed flag cannot silently break pods.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pagefleet.operator import crd, names, quantity, serverargs
from pagefleet.operator.spec import CACHE_PATH, IntOrPercent, ModelDeploymentSpec, SpecError, is_zero
from pagefleet.server.cli import build_configs
from pagefleet.server.config import ConfigError, engine_flag

PORT = 8000
PORT_NAME = "http"
CONTAINER_NAME = "server"
HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
API_KEY_ENV = "PAGEFLEET_API_KEY"
HF_TOKEN_ENV = "HF_TOKEN"
LABEL_MDEP = "pagefleet.dev/model-deployment"
LABEL_SERVED = "pagefleet.dev/served-model"        # every pod of one model name (InferencePool)
# llm-d's endpoint picker reads these (pd_role filters, context-length-aware scorer):
# a pagefleet server does prefill and decode itself, and holds requests of up to
# max-model-len tokens.
LLMD_ROLE_LABEL = "llm-d.ai/role"
LLMD_ROLE = "prefill-decode"
LLMD_CONTEXT_LABEL = "llm-d.ai/context-length-range"
LAST_APPLIED = "pagefleet.dev/last-applied"
TEMPLATE_HASH = "pagefleet.dev/template-hash"
MANAGER = "pagefleet-operator"
SERVER_UID = 10001                     # the server image's user (Dockerfile)

# Model loads (download + weights to GPU + CUDA graph capture) take minutes; the
# startup probe gives them spec.startupTimeoutSeconds (default 30 minutes) before
# liveness may restart the pod: failureThreshold = that budget / this period.
STARTUP_PERIOD_S = 10
STARTUP_TIMEOUT_S = 5
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
GRACE_MARGIN_S = 5
# A rollout may legitimately wait for the whole startup budget, plus this for
# scheduling and the image pull (progressDeadlineSeconds = budget + margin).
PROGRESS_MARGIN_S = 600
GPU_RESOURCE = "nvidia.com/gpu"
TMP_SIZE = "4Gi"                       # /tmp: Triton, CUDA and torch compile caches (HOME=/tmp)
SINGLE_NODE_MODES = {"ReadWriteOnce", "ReadWriteOncePod"}


def selector_labels(name: str) -> dict[str, str]:
    """Labels that pick a ModelDeployment's pods (immutable once created). `name` is
    the child name (names.child_name), always a valid label value."""
    return {LABEL_MDEP: name, "app.kubernetes.io/component": "server"}


def selector_string(name: str) -> str:
    """status.selector, the form the scale subresource (and HPA/KEDA) expect."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def labels(spec: ModelDeploymentSpec) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "pagefleet",
        "app.kubernetes.io/instance": spec.child_name,
        "app.kubernetes.io/managed-by": MANAGER,
        **selector_labels(spec.child_name),
    }


def served_label(served_model_name: str) -> str:
    """The served model name as a label value (names.child_name: valid, and distinct
    for look-alikes such as `Qwen/Qwen2.5-7B` and `qwen-qwen2-5-7b`)."""
    return names.child_name(served_model_name)


def max_model_len(spec: ModelDeploymentSpec) -> int | None:
    """The context length the servers run with, when the spec says it (the engine
    field or --max-model-len in extraArgs); None: the model's own, unknown here."""
    value = serverargs.parse(spec.extra_args).get("max_model_len", spec.engine.get("maxModelLen"))
    return int(value) if value else None


def pod_labels(spec: ModelDeploymentSpec) -> dict[str, str]:
    """The pods' own labels: the operator's, the model name, and llm-d's role and
    context-length range (`0-<max-model-len>`: the picker prefers the tightest range
    that holds a request, which is the gateway's smallest-fitting-pool rule)."""
    out = {**labels(spec), LABEL_SERVED: served_label(spec.served_model_name), LLMD_ROLE_LABEL: LLMD_ROLE}
    length = max_model_len(spec)
    if length:
        out[LLMD_CONTEXT_LABEL] = f"0-{length}"
    return out


def endpoint(spec: ModelDeploymentSpec) -> str:
    """OpenAI base URL inside the cluster."""
    return f"http://{spec.child_name}.{spec.namespace}.svc:{PORT}/v1"


def owner_references(spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    """Children are garbage-collected with the CR on a real cluster. Without a uid
    (only possible outside a real API server) no valid reference can be made."""
    if not spec.uid:
        return []
    return [{"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": spec.name,
             "uid": spec.uid, "controller": True, "blockOwnerDeletion": True}]


def _metadata(spec: ModelDeploymentSpec) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": spec.child_name, "namespace": spec.namespace, "labels": labels(spec)}
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
    # One replica over several GPUs: shard the model (issue 14), unless extraArgs says
    # so itself (spec.py has checked that it says the same).
    if spec.resources.gpus > 1 and "tensor_parallel_size" not in serverargs.parse(spec.extra_args):
        args += [engine_flag("tensor_parallel_size"), str(spec.resources.gpus)]
    # The server's own readiness deadline follows the pod's startup budget (only when
    # set: unchanged args keep existing fleets' template hash, so nothing rolls).
    if spec.startup_timeout_seconds != crd.DEFAULT_STARTUP_TIMEOUT_S \
            and "startup_timeout" not in serverargs.parse(spec.extra_args):
        args += [engine_flag("startup_timeout"), str(spec.startup_timeout_seconds)]
    args += list(spec.extra_args)
    if spec.gpu_memory_utilization_override is not None:  # last, so it wins over extraArgs
        args += [engine_flag("gpu_memory_utilization"), _flag_value(spec.gpu_memory_utilization_override)]
    return args


def check_server_args(spec: ModelDeploymentSpec) -> None:
    """SpecError when `pagefleet serve` would refuse the rendered args at startup.

    Why: extraArgs pass the server's parser (serverargs.check_extra) but not its range
    and consistency checks (`--gpu-memory-utilization 2`, `--queue-timeout 0`,
    `--pipeline-parallel-size 2`); deployed, every pod would exit 2 and crash-loop
    instead of the spec being reported InvalidSpec. This runs the server's own
    argv -> validated EngineConfig/ServerConfig step (`cli.build_configs`), which loads
    no model and touches no GPU."""
    try:
        build_configs(server_args(spec))
    except (ConfigError, SystemExit) as e:
        # SystemExit: an argparse refusal (check_extra has normally caught it already).
        where = "spec.engine.extraArgs" if spec.extra_args else "spec.engine"
        raise SpecError(where, f"pagefleet serve would refuse it: {e}") from None


def termination_grace_seconds(spec: ModelDeploymentSpec) -> int:
    """preStop, then the server's effective --shutdown-timeout (a CR field or
    extraArgs), then a margin for the process to exit."""
    shutdown = float(serverargs.effective(server_args(spec), "shutdown_timeout"))
    return PRESTOP_SLEEP_S + math.ceil(shutdown) + GRACE_MARGIN_S


def _probe(period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": HEALTH_PATH, "port": PORT_NAME}, "periodSeconds": period,
            "timeoutSeconds": timeout, "failureThreshold": failures, "successThreshold": 1}


def startup_failures(spec: ModelDeploymentSpec) -> int:
    """The startup probe's failureThreshold: spec.startupTimeoutSeconds in probe
    periods, rounded up, so the pod gets at least the budget it asked for."""
    return math.ceil(spec.startup_timeout_seconds / STARTUP_PERIOD_S)


def progress_deadline_seconds(spec: ModelDeploymentSpec) -> int:
    """The Deployment's progressDeadlineSeconds: the startup probe's whole budget plus
    a margin. Why derived: a rollout waits for a new pod to load its model; a deadline
    below the startup budget would report a slow but healthy load as Stalled
    (ProgressDeadlineExceeded)."""
    return STARTUP_PERIOD_S * startup_failures(spec) + PROGRESS_MARGIN_S


def _resources(spec: ModelDeploymentSpec) -> dict[str, Any]:
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    r = spec.resources
    if r.cpu:
        requests["cpu"] = r.cpu
    if r.memory:
        requests["memory"] = limits["memory"] = r.memory
    if spec.model_cache is None:  # the weights land in an emptyDir on the node's disk
        requests["ephemeral-storage"] = r.ephemeral_storage
    if r.gpus > 0:  # extended resources: request == limit, set through limits
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(r.gpus)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def cache_path(spec: ModelDeploymentSpec) -> str:
    return spec.model_cache.mount_path if spec.model_cache else CACHE_PATH


def _env(spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    # HOME: the root filesystem is read-only, and Triton/CUDA keep caches under ~.
    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": cache_path(spec)},
                                 {"name": "HOME", "value": "/tmp"}]
    if spec.api_key:
        env.append({"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {
            "name": spec.api_key.name, "key": spec.api_key.key}}})
    if spec.hf_token:
        env.append({"name": HF_TOKEN_ENV, "valueFrom": {"secretKeyRef": {
            "name": spec.hf_token.name, "key": spec.hf_token.key}}})
    managed = {e["name"] for e in env}
    return env + [copy.deepcopy(e) for e in spec.env if e["name"] not in managed]


def _tolerations(spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    """GPU nodes are commonly tainted nvidia.com/gpu; tolerate it unless the user
    already says something about that taint."""
    tolerations = [copy.deepcopy(t) for t in spec.tolerations]
    if spec.resources.gpus > 0 and not any(t.get("key") == GPU_RESOURCE for t in tolerations):
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    return tolerations


def _topology_spread(spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    """Default: replicas on different nodes where possible (a node failure takes one
    replica, not the fleet); soft, so a single big GPU node still takes them all."""
    if spec.topology_spread is not None:
        return copy.deepcopy(spec.topology_spread)
    return [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
             "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": selector_labels(spec.child_name)}}]


def pod_security_context(spec: ModelDeploymentSpec) -> dict[str, Any]:
    """Pod Security `restricted` by default; CR keys override one by one."""
    return {"runAsNonRoot": True, "runAsUser": SERVER_UID, "runAsGroup": SERVER_UID,
            "fsGroup": SERVER_UID, "seccompProfile": {"type": "RuntimeDefault"},
            **copy.deepcopy(spec.pod_security_context)}


def container_security_context(spec: ModelDeploymentSpec) -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
            **copy.deepcopy(spec.security_context)}


def _volumes(spec: ModelDeploymentSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "tmp", "mountPath": "/tmp"}]
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shm_size}},
        {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE}}]
    if spec.model_cache:
        # readOnly only when true: the API server drops `readOnly: false` (omitempty).
        ro = {"readOnly": True} if spec.model_cache.read_only else {}
        mounts.append({"name": "model-cache", "mountPath": spec.model_cache.mount_path, **ro})
        volumes.append({"name": "model-cache", "persistentVolumeClaim": {
            "claimName": spec.model_cache.claim_name, **ro}})
    else:
        mounts.append({"name": "model-cache", "mountPath": CACHE_PATH})
        volumes.append({"name": "model-cache", "emptyDir": {"sizeLimit": spec.resources.ephemeral_storage}})
    return volumes + copy.deepcopy(spec.volumes), mounts + copy.deepcopy(spec.volume_mounts)


def pod_template(spec: ModelDeploymentSpec) -> dict[str, Any]:
    volumes, mounts = _volumes(spec)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "args": server_args(spec),
        "ports": [{"name": PORT_NAME, "containerPort": PORT, "protocol": "TCP"}],
        "env": _env(spec),
        "resources": _resources(spec),
        "volumeMounts": mounts,
        "startupProbe": _probe(STARTUP_PERIOD_S, STARTUP_TIMEOUT_S, startup_failures(spec)),
        "readinessProbe": _probe(READINESS_PERIOD_S, READINESS_TIMEOUT_S, READINESS_FAILURES),
        "livenessProbe": _probe(LIVENESS_PERIOD_S, LIVENESS_TIMEOUT_S, LIVENESS_FAILURES),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_S)]}}},
        "securityContext": container_security_context(spec),
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "enableServiceLinks": False,
        "automountServiceAccountToken": spec.automount_service_account_token,
        "securityContext": pod_security_context(spec),
    }
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = copy.deepcopy(spec.image_pull_secrets)
    tolerations = _tolerations(spec)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    spread = _topology_spread(spec)
    if spread:
        pod_spec["topologySpreadConstraints"] = spread
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.affinity:
        pod_spec["affinity"] = copy.deepcopy(spec.affinity)
    if spec.priority_class_name:
        pod_spec["priorityClassName"] = spec.priority_class_name
    if spec.runtime_class_name:
        pod_spec["runtimeClassName"] = spec.runtime_class_name
    # The template hash on the pods too: OOM remediation counts only the exits of pods
    # rendered from the current spec and level.
    annotations = {**spec.pod_annotations, "prometheus.io/scrape": "true",
                   "prometheus.io/port": str(PORT), "prometheus.io/path": METRICS_PATH,
                   TEMPLATE_HASH: spec.spec_hash}
    return stored_template({
        "metadata": {"labels": {**spec.pod_labels, **pod_labels(spec)}, "annotations": annotations},
        "spec": pod_spec,
    })


# Volume sources whose `readOnly` is a plain Go `bool` with omitempty (csi and azureDisk
# have a *bool, which keeps false).
_PLAIN_READONLY_SOURCES = ("persistentVolumeClaim", "nfs", "awsElasticBlockStore", "gcePersistentDisk",
                           "iscsi", "rbd", "fc", "cephfs", "cinder", "flexVolume", "quobyte",
                           "portworxVolume", "scaleIO", "storageos", "azureFile")


def _stored_quantity(value: Any) -> Any:
    """The canonical form; a value that is no quantity is left for the API server to refuse."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return value
    try:
        return quantity.canonical(value)
    except quantity.QuantityError:
        return value


def _canonical_quantities(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _stored_quantity(v) for k, v in values.items()}


def _stored_container(container: dict[str, Any]) -> None:
    res = container.get("resources") or {}
    for part in ("requests", "limits"):
        if isinstance(res.get(part), Mapping):
            res[part] = _canonical_quantities(res[part])
    for m in container.get("volumeMounts") or []:
        if m.get("readOnly") is False:
            del m["readOnly"]
    for e in container.get("env") or []:
        if e.get("value") == "":
            del e["value"]
        ref = (e.get("valueFrom") or {}).get("resourceFieldRef") or {}
        if ref.get("divisor") is not None:
            ref["divisor"] = _stored_quantity(ref["divisor"])


def stored_template(template: Mapping[str, Any]) -> dict[str, Any]:
    """A pod template as the API server stores it: `false` of a plain-bool omitempty
    field and an empty env value dropped, quantities canonical (k8s Quantity). Why:
    the operator compares what it applied with what it reads back, so it must render
    (and compare) the stored form, or every comparison sees drift that never goes away
    (for user-given volumes and env as much as for its own fields)."""
    out = copy.deepcopy(dict(template))
    pod = out.get("spec") or {}
    for c in (pod.get("containers") or []) + (pod.get("initContainers") or []):
        _stored_container(c)
    for v in pod.get("volumes") or []:
        for source in _PLAIN_READONLY_SOURCES:
            if (v.get(source) or {}).get("readOnly") is False:
                del v[source]["readOnly"]
        empty_dir = v.get("emptyDir") or {}
        if empty_dir.get("sizeLimit") is not None:
            empty_dir["sizeLimit"] = _stored_quantity(empty_dir["sizeLimit"])
    return out


def stored_form(obj: Mapping[str, Any]) -> dict[str, Any]:
    """An object (or its managed part) with its pod template in stored form."""
    out = copy.deepcopy(dict(obj))
    template = (out.get("spec") or {}).get("template")
    if isinstance(template, Mapping):
        out["spec"]["template"] = stored_template(template)
    return out


def single_node_cache(spec: ModelDeploymentSpec, cache_access_modes: Sequence[str] | None) -> bool:
    """Is the model cache a PVC that only one node can mount (ReadWriteOnce,
    ReadWriteOncePod)? False without a modelCache or when the modes are unknown."""
    return (spec.model_cache is not None and cache_access_modes is not None
            and set(cache_access_modes) <= SINGLE_NODE_MODES)


def rollout_strategy(spec: ModelDeploymentSpec, cache_access_modes: Sequence[str] | None) -> dict[str, Any]:
    """The Deployment's RollingUpdate strategy.

    Default: never drop below the serving capacity during a rollout (a new pod must be
    ready, model loaded, before an old one goes): maxSurge 1, maxUnavailable 0. Except
    when the model cache may only be mountable on one node (ReadWriteOnce, or access
    modes unknown): a surge pod elsewhere could never start, so maxSurge 0,
    maxUnavailable 1 (replace one at a time).

    spec.rollout overrides either field (a full GPU pool cannot hold a surge pod, so
    its users set maxSurge 0 and maxUnavailable >= 1). An unset maxSurge is the default
    above, or 1 where maxUnavailable is set to 0 (the only value that can roll with
    it); an unset maxUnavailable is 0, or 1 where maxSurge is 0. With a cache PVC known
    to be single-node, a rollout that would surge (maxSurge other than 0, or
    maxUnavailable 0) can never finish: SpecError (InvalidSpec) instead of a
    Deployment that stalls. With unknown modes the user's explicit values are taken as
    given: a PVC that cannot be read (yet, or for a moment) is no proof either way."""
    r = spec.rollout
    may_be_single = spec.model_cache is not None and (cache_access_modes is None
                                                      or set(cache_access_modes) <= SINGLE_NODE_MODES)
    if single_node_cache(spec, cache_access_modes):
        assert spec.model_cache is not None
        why = (f"the modelCache PVC {spec.model_cache.claim_name} is "
               f"{', '.join(cache_access_modes or ())}: a surge pod on another node could never mount "
               "it, so rollouts here cannot surge")
        if r.max_surge is not None and not is_zero(r.max_surge):
            raise SpecError("spec.rollout.maxSurge", f"must be 0 ({why}; raise maxUnavailable "
                            "instead, or use a ReadWriteMany or ReadOnlyMany claim)")
        if is_zero(r.max_unavailable):
            raise SpecError("spec.rollout.maxUnavailable", f"must be at least 1 ({why}, so an old pod "
                            "must go before its replacement starts)")
    if r.max_surge is not None:
        surge: IntOrPercent = r.max_surge
    elif is_zero(r.max_unavailable):
        surge = 1
    else:
        surge = 0 if may_be_single else 1
    unavailable: IntOrPercent = (r.max_unavailable if r.max_unavailable is not None
                                 else 1 if is_zero(surge) else 0)
    return {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": unavailable, "maxSurge": surge}}


def deployment(spec: ModelDeploymentSpec, replicas: int,
               cache_access_modes: Sequence[str] | None = ("ReadWriteMany",)) -> dict[str, Any]:
    """The server Deployment. `replicas` is decided by the caller: spec.replicas, or
    the autoscaler's current value when autoscaling is on. `cache_access_modes` are the
    model cache PVC's (None: unknown)."""
    meta = _metadata(spec)
    meta["annotations"] = {TEMPLATE_HASH: spec.spec_hash}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector_labels(spec.child_name)},
            "strategy": rollout_strategy(spec, cache_access_modes),
            "progressDeadlineSeconds": progress_deadline_seconds(spec),
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
            "selector": selector_labels(spec.child_name),
            "ports": [{"name": PORT_NAME, "port": PORT, "targetPort": PORT_NAME, "protocol": "TCP"}],
        },
    }


def pod_disruption_budget(spec: ModelDeploymentSpec, replicas: int) -> dict[str, Any]:
    """Node drains take replicas one at a time (reloading a model is slow). At one
    replica a drain would take the model offline: minAvailable 1 blocks that, unless
    spec.disruption.evictLastReplica opts in."""
    if replicas <= 1 and not spec.disruption.evict_last_replica:
        budget: dict[str, Any] = {"minAvailable": 1}
    else:
        budget = {"maxUnavailable": spec.disruption.max_unavailable}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(spec),
        "spec": {**budget, "selector": {"matchLabels": selector_labels(spec.child_name)}},
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


def is_subset(want: Any, have: Any) -> bool:
    """Every field of `want` is in `have` with the same value; lists must match item by
    item. Fields `have` has beyond `want` (API server defaults, others' labels) are fine."""
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(
            (v is None and have.get(k) is None) or (k in have and is_subset(v, have[k]))
            for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(want) == len(have) and all(
            is_subset(w, h) for w, h in zip(want, have, strict=True))
    return want == have


def in_sync(live: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """Does the live object still hold everything the operator wants in it? False after
    a hand edit (a changed arg, a removed env var, a scaled Deployment). Compared in
    the form the API server stores (`stored_form`), so its normalisation is no edit."""
    want = stored_form(_managed(desired))
    if want["metadata"]["ownerReferences"] is None:
        del want["metadata"]["ownerReferences"]
    want["metadata"]["annotations"] = {k: v for k, v in (desired["metadata"].get("annotations") or {}).items()
                                       if k != LAST_APPLIED}
    return is_subset(want, live)


def frozen_template(live: Mapping[str, Any] | None, template_hash: str) -> dict[str, Any] | None:
    """The pod template the operator last applied, if it was rendered from the same
    spec (same hash): an operator upgrade then re-applies it as it was, so running
    fleets roll only when their ModelDeployment changes."""
    if not live or (live.get("metadata", {}).get("annotations") or {}).get(TEMPLATE_HASH) != template_hash:
        return None
    applied = last_applied(live) or {}
    template = (applied.get("spec") or {}).get("template")
    # Stored form: a template applied by an operator version that rendered `readOnly:
    # false` or typed quantities would otherwise be re-applied, and drift, forever.
    return stored_template(template) if template else None


def controller_uid(live: Mapping[str, Any]) -> str | None:
    """uid of the object's controlling owner, if any."""
    for ref in (live.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None
