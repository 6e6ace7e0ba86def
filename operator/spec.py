"""Parse a `ModelDeployment` into a typed, validated spec.

Why re-check what the CRD schema already checks: the schema is only enforced by a
real API server with the CRD installed. An older CRD, a CR written before a rule was
added, or an API server emulator lets bad input through, and the operator must then
say exactly what is wrong (field path and rule) instead of crash-looping. Defaults
come from the CRD schema itself (`crd.py`), applied the way the API server applies
them, so they are defined once.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagefleet.operator import coretypes, crd, names, quantity, serverargs
from pagefleet.server.config import default_limits

DEFAULT_IMAGE = "ghcr.io/pagefleet/pagefleet:0.1.0"
DEFAULT_SHM_SIZE = "2Gi"
DEFAULT_TP_SHM_SIZE = "8Gi"       # NCCL's shared-memory transport between the ranks
DEFAULT_CACHE_SIZE = "50Gi"       # the emptyDir for weights when there is no modelCache
CACHE_PATH = "/models/hf-cache"   # HF_HOME: the server image's VOLUME
DEFAULT_TARGETS = {crd.METRIC_WAITING: 5.0, crd.METRIC_KV_CACHE: 0.8}


class SpecError(ValueError):
    """An invalid ModelDeployment: `field` is the JSON path, `rule` what it breaks."""

    def __init__(self, field: str, rule: str) -> None:
        super().__init__(f"{field}: {rule}")
        self.field = field
        self.rule = rule


@dataclass(frozen=True)
class AutoscalingSpec:
    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    metric: str = crd.DEFAULT_METRIC
    target: float = 256.0
    scale_up_stabilization_seconds: int = 0
    scale_down_stabilization_seconds: int = 300
    interval_seconds: int = 15
    scale_to_zero_idle_seconds: int = crd.DEFAULT_IDLE_SECONDS

    @property
    def scales_to_zero(self) -> bool:
        """minReplicas 0 with autoscaling on: the gateway's held requests wake it."""
        return self.enabled and self.min_replicas == 0

    @property
    def samples(self) -> tuple[str, ...]:
        """The exposition sample names whose sum is a pod's metric value."""
        return crd.NAMED_METRICS.get(self.metric, (self.metric,))


@dataclass(frozen=True)
class ResourcesSpec:
    gpus: int = 1
    cpu: str | None = None
    memory: str | None = None
    shm_size: str = DEFAULT_SHM_SIZE
    ephemeral_storage: str = DEFAULT_CACHE_SIZE


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class ModelCacheSpec:
    claim_name: str
    mount_path: str
    read_only: bool = False


@dataclass(frozen=True)
class DisruptionSpec:
    max_unavailable: int = 1
    evict_last_replica: bool = False


IntOrPercent = int | str        # Kubernetes IntOrString: 2 or "25%"


def is_zero(value: IntOrPercent | None) -> bool:
    """0 or "0%" (the only zero spellings crd.py's patterns let through)."""
    return value is not None and value in crd.ZERO_VALUES


@dataclass(frozen=True)
class RolloutSpec:
    """spec.rollout, as given: None is "unset", resolved by resources.rollout_strategy
    (its default depends on the model cache PVC, which only the controller reads)."""

    max_surge: IntOrPercent | None = None
    max_unavailable: IntOrPercent | None = None


@dataclass(frozen=True)
class EndpointPickerSpec:
    name: str
    port: int = crd.DEFAULT_EPP_PORT
    failure_mode: str = "FailClose"


@dataclass(frozen=True)
class GatewaySpec:
    """spec.gateway: read by the gateway itself (weight, tokenizer, queue timeout) and
    by the operator (the InferencePool). Nothing here shapes the pods."""

    weight: int = crd.DEFAULT_GATEWAY_WEIGHT
    tokenizer: str | None = None
    queue_timeout_seconds: float | None = None
    endpoint_picker: EndpointPickerSpec | None = None   # set: emit the InferencePool

    @property
    def inference_pool(self) -> bool:
        return self.endpoint_picker is not None


@dataclass(frozen=True)
class OOMSpec:
    enabled: bool = True
    max_ooms: int = 3
    window_seconds: int = 600
    step: float = 0.05
    floor: float = 0.5


@dataclass(frozen=True)
class ModelDeploymentSpec:
    name: str
    namespace: str
    uid: str | None
    generation: int | None
    model: str
    served_model_name: str
    image: str
    engine: dict[str, Any]           # camelCase engine keys that are set, values checked
    extra_args: tuple[str, ...]
    replicas: int
    autoscaling: AutoscalingSpec
    resources: ResourcesSpec
    api_key: SecretKeyRef | None
    model_cache: ModelCacheSpec | None
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    affinity: dict[str, Any] | None = None
    priority_class_name: str | None = None
    env: list[dict[str, Any]] = field(default_factory=list)
    image_from_spec: bool = False    # spec.image was set (else: the operator's default)
    hf_token: SecretKeyRef | None = None
    topology_spread: list[dict[str, Any]] | None = None   # None: the default spread
    runtime_class_name: str | None = None
    image_pull_secrets: list[dict[str, Any]] = field(default_factory=list)
    service_account_name: str | None = None
    automount_service_account_token: bool = False
    pod_labels: dict[str, str] = field(default_factory=dict)
    pod_annotations: dict[str, str] = field(default_factory=dict)
    volumes: list[dict[str, Any]] = field(default_factory=list)
    volume_mounts: list[dict[str, Any]] = field(default_factory=list)
    pod_security_context: dict[str, Any] = field(default_factory=dict)
    security_context: dict[str, Any] = field(default_factory=dict)
    disruption: DisruptionSpec = DisruptionSpec()
    oom: OOMSpec = OOMSpec()
    gateway: GatewaySpec = GatewaySpec()
    rollout: RolloutSpec = RolloutSpec()
    startup_timeout_seconds: int = crd.DEFAULT_STARTUP_TIMEOUT_S
    spec_hash: str = ""              # hash of what the pod template is rendered from
    gpu_memory_utilization_override: float | None = None   # OOM remediation's, rendered last

    @property
    def child_name(self) -> str:
        """Name of the Deployment, Service and PDB (a valid Service name)."""
        return names.child_name(self.name)


def apply_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """Fill `default`s of a structural schema into `value`, like the API server does:
    only inside objects that are present, never creating a missing parent."""
    if not isinstance(value, dict) or schema.get("type") != "object":
        return value
    for key, sub in schema.get("properties", {}).items():
        if key not in value and "default" in sub:
            value[key] = copy.deepcopy(sub["default"])
        if key in value:
            value[key] = apply_defaults(sub, value[key])
    return value


class _Reader:
    """Typed access to a dict with errors that carry the JSON path."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, Mapping):
            raise SpecError(path, f"must be an object (got {type(data).__name__})")
        self.data = data
        self.path = path

    def at(self, key: str) -> str:
        return f"{self.path}.{key}"

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def string(self, key: str, *, required: bool = False, pattern: str | None = None) -> str | None:
        v = self.data.get(key)
        if v is None:
            if required:
                raise SpecError(self.at(key), "is required")
            return None
        if not isinstance(v, str):
            raise SpecError(self.at(key), f"must be a string (got {v!r})")
        if not v:
            raise SpecError(self.at(key), "must not be empty")
        if pattern and not re.match(pattern, v):
            raise SpecError(self.at(key), f"must match {pattern} (got {v!r})")
        return v

    def integer(self, key: str, *, minimum: int | None = None, maximum: int | None = None) -> int | None:
        v = self.data.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise SpecError(self.at(key), f"must be an integer (got {v!r})")
        if minimum is not None and v < minimum:
            raise SpecError(self.at(key), f"must be >= {minimum} (got {v})")
        if maximum is not None and v > maximum:
            raise SpecError(self.at(key), f"must be <= {maximum} (got {v})")
        return v

    def number(self, key: str, *, above: float | None = None, maximum: float | None = None,
               at_least: float | None = None) -> float | None:
        v = self.data.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise SpecError(self.at(key), f"must be a number (got {v!r})")
        if at_least is not None and v < at_least:
            raise SpecError(self.at(key), f"must be >= {at_least:g} (got {v:g})")
        if above is not None and maximum is not None and not (above < v <= maximum):
            raise SpecError(self.at(key), f"must be > {above:g} and <= {maximum:g} (got {v:g})")
        if above is not None and not v > above:
            raise SpecError(self.at(key), f"must be > {above:g} (got {v:g})")
        return float(v)

    def boolean(self, key: str) -> bool | None:
        v = self.data.get(key)
        if v is None:
            return None
        if not isinstance(v, bool):
            raise SpecError(self.at(key), f"must be true or false (got {v!r})")
        return v

    def choice(self, key: str, choices: list[Any]) -> Any:
        v = self.data.get(key)
        if v is None:
            return None
        if v not in choices or isinstance(v, bool):
            raise SpecError(self.at(key), f"must be one of {', '.join(map(str, choices))} (got {v!r})")
        return v

    def quantity(self, key: str) -> str | None:
        v = self.data.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, str)) or not re.match(crd.QUANTITY_PATTERN, str(v)):
            raise SpecError(self.at(key), f"must be a Kubernetes quantity such as 8 or 16Gi (got {v!r})")
        try:
            # Canonical, as the API server stores it (1.5Gi -> 1536Mi): rendered as typed,
            # the live object would never match what the operator applied.
            return quantity.canonical(v)
        except quantity.QuantityError as e:
            raise SpecError(self.at(key), str(e)) from None

    def int_or_percent(self, key: str, percent_pattern: str) -> IntOrPercent | None:
        """A Kubernetes IntOrString: an integer >= 0 or a percentage string `N%`."""
        v = self.data.get(key)
        if v is None:
            return None
        if isinstance(v, int) and not isinstance(v, bool):
            if v < 0:
                raise SpecError(self.at(key), f"must be >= 0 (got {v})")
            return v
        if isinstance(v, str) and re.fullmatch(percent_pattern, v):  # "5%\n" too is no percentage
            return v
        raise SpecError(self.at(key), f"must be an integer >= 0 or a percentage matching "
                        f"{percent_pattern} (got {v!r})")

    def sub(self, key: str) -> _Reader | None:
        v = self.data.get(key)
        return None if v is None else _Reader(v, self.at(key))

    def list_of_objects(self, key: str) -> list[dict[str, Any]]:
        v = self.data.get(key)
        if v is None:
            return []
        if not isinstance(v, list) or not all(isinstance(x, Mapping) for x in v):
            raise SpecError(self.at(key), "must be a list of objects")
        return [dict(x) for x in v]


    def core(self, key: str, type_name: str, *, many: bool = False) -> Any:
        """A core/v1 object (or list of them) checked against its structural schema."""
        v = self.data.get(key)
        if v is None:
            return None
        sch = coretypes.list_of(type_name, "") if many else coretypes.schema(type_name)
        try:
            coretypes.check(v, sch, self.at(key))
        except coretypes.SchemaError as e:
            raise SpecError(e.path, e.rule) from None
        return copy.deepcopy(v)

    def string_map(self, key: str) -> dict[str, str]:
        v = self.data.get(key) or {}
        if not isinstance(v, Mapping) or not all(isinstance(k, str) and isinstance(x, str)
                                                 for k, x in v.items()):
            raise SpecError(self.at(key), "must map strings to strings")
        return dict(v)


def _engine(r: _Reader, gpus: int) -> tuple[dict[str, Any], tuple[str, ...]]:
    props = crd.engine_schema()["properties"]
    out: dict[str, Any] = {}
    for key in crd.ENGINE_FIELDS:
        p = props[key]
        if "enum" in p:
            v = r.choice(key, p["enum"])
        elif p["type"] == "integer":
            v = r.integer(key, minimum=p.get("minimum"))
        elif p["type"] == "number" and p.get("exclusiveMinimum"):
            v = r.number(key, above=p["minimum"], maximum=p.get("maximum"))
        elif p["type"] == "number":
            v = r.number(key, at_least=p["minimum"])
        else:
            v = r.boolean(key)
        if v is not None:
            out[key] = v
    extra = r.data.get("extraArgs") or []
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise SpecError(r.at("extraArgs"), "must be a list of strings")
    try:
        given = serverargs.check_extra(extra)
    except serverargs.ArgsError as e:
        raise SpecError(r.at("extraArgs"), str(e)) from None
    tp = given.get("tensor_parallel_size")
    if tp is not None and gpus >= 1 and tp != gpus:
        raise SpecError(r.at("extraArgs"), f"--tensor-parallel-size {tp} must equal resources.gpus "
                        f"({gpus}): each rank takes one GPU")
    return out, tuple(extra)


def _autoscaling(r: _Reader | None, max_num_seqs: int) -> AutoscalingSpec:
    d = AutoscalingSpec()
    if r is None:
        return dataclasses.replace(d, target=float(max_num_seqs))
    legacy = r.number("targetWaitingRequests", above=0)
    metric = r.string("metric", pattern=crd.METRIC_NAME_PATTERN) or d.metric
    target = r.number("target", above=0)
    if legacy is not None:
        # The field of the first release: the target of `metric`, which then defaulted
        # to the waiting queue.
        if target is not None:
            raise SpecError(r.at("targetWaitingRequests"), "is the deprecated name of target; "
                            "set only target")
        target = legacy
        if metric == crd.DEFAULT_METRIC:
            metric = crd.METRIC_WAITING
    if target is None:
        if metric == crd.METRIC_CONCURRENCY:
            target = float(max_num_seqs)
        elif metric in DEFAULT_TARGETS:
            target = DEFAULT_TARGETS[metric]
        else:
            raise SpecError(r.at("target"), f"is required for the gauge {metric!r}")
    spec = AutoscalingSpec(
        enabled=bool(r.boolean("enabled")),
        min_replicas=_or(r.integer("minReplicas", minimum=0), d.min_replicas),
        max_replicas=r.integer("maxReplicas", minimum=1) or d.max_replicas,
        metric=metric,
        target=float(target),
        scale_up_stabilization_seconds=_or(r.integer("scaleUpStabilizationSeconds", minimum=0),
                                           d.scale_up_stabilization_seconds),
        scale_down_stabilization_seconds=_or(r.integer("scaleDownStabilizationSeconds", minimum=0),
                                             d.scale_down_stabilization_seconds),
        interval_seconds=r.integer("intervalSeconds", minimum=1) or d.interval_seconds,
        scale_to_zero_idle_seconds=r.integer("scaleToZeroIdleSeconds", minimum=1)
        or d.scale_to_zero_idle_seconds,
    )
    if spec.min_replicas > spec.max_replicas:  # the CRD's CEL rule crd.MIN_MAX_RULE
        raise SpecError(r.at("minReplicas"), f"must be <= maxReplicas (got {spec.min_replicas} > "
                        f"{spec.max_replicas})")
    return spec


def _or(v: Any, default: Any) -> Any:
    return default if v is None else v


def _gateway(r: _Reader | None) -> GatewaySpec:
    if r is None:
        return GatewaySpec()
    d = GatewaySpec()
    timeout = r.number("queueTimeoutSeconds", above=0)
    if timeout is not None and timeout > 86400:
        raise SpecError(r.at("queueTimeoutSeconds"), f"must be <= 86400 (got {timeout:g})")
    picker = None
    pool = r.sub("inferencePool")
    if pool is not None and _or(pool.boolean("enabled"), True):
        epp = pool.sub("endpointPicker")
        if epp is None:
            raise SpecError(pool.at("endpointPicker"), "is required (the endpoint picker Service "
                            "the InferencePool names)")
        mode = epp.choice("failureMode", crd.EPP_FAILURE_MODES) or "FailClose"
        picker = EndpointPickerSpec(name=epp.string("name", required=True) or "",
                                    port=_or(epp.integer("port", minimum=1, maximum=65535),
                                             crd.DEFAULT_EPP_PORT),
                                    failure_mode=mode)
    return GatewaySpec(weight=_or(r.integer("weight", minimum=0, maximum=1000000), d.weight),
                       tokenizer=r.string("tokenizer"), queue_timeout_seconds=timeout,
                       endpoint_picker=picker)


def _secret_ref(r: _Reader | None, default_key: str) -> SecretKeyRef | None:
    if r is None:
        return None
    return SecretKeyRef(name=r.string("name", required=True) or "", key=r.string("key") or default_key)


def _oom(r: _Reader | None) -> OOMSpec:
    d = OOMSpec()
    if r is None:
        return d
    spec = OOMSpec(enabled=_or(r.boolean("enabled"), d.enabled),
                   max_ooms=_or(r.integer("maxOOMs", minimum=1), d.max_ooms),
                   window_seconds=_or(r.integer("windowSeconds", minimum=1), d.window_seconds),
                   step=_or(r.number("step", above=0, maximum=0.5), d.step),
                   floor=_or(r.number("floor", above=0, maximum=1), d.floor))
    return spec


def _rollout(r: _Reader | None) -> RolloutSpec:
    if r is None:
        return RolloutSpec()
    spec = RolloutSpec(max_surge=r.int_or_percent("maxSurge", crd.SURGE_PERCENT_PATTERN),
                       max_unavailable=r.int_or_percent("maxUnavailable", crd.UNAVAILABLE_PERCENT_PATTERN))
    if is_zero(spec.max_surge) and is_zero(spec.max_unavailable):  # the CRD's crd.ROLLOUT_RULE
        raise SpecError(r.path, "maxSurge and maxUnavailable must not both be 0: no pod could "
                        "ever be replaced")
    return spec


# Pod parts the operator owns: user volumes, mounts and labels may not collide with them.
RESERVED_VOLUMES = ("dshm", "model-cache", "tmp")


def _check_volumes(r: _Reader, volumes: list[dict[str, Any]], mounts: list[dict[str, Any]],
                   reserved_paths: tuple[str, ...]) -> None:
    names_ = [v["name"] for v in volumes]
    for i, n in enumerate(names_):
        if n in RESERVED_VOLUMES:
            raise SpecError(f"{r.at('volumes')}[{i}].name", f"{n!r} is the operator's volume")
        if names_.count(n) > 1:
            raise SpecError(f"{r.at('volumes')}[{i}].name", f"{n!r} appears twice")
    for i, m in enumerate(mounts):
        if m["name"] not in names_:
            raise SpecError(f"{r.at('volumeMounts')}[{i}].name", f"no volume named {m['name']!r} in spec.volumes")
        if m["mountPath"].rstrip("/") in reserved_paths:
            raise SpecError(f"{r.at('volumeMounts')}[{i}].mountPath",
                            f"{m['mountPath']} is where the operator mounts its own volume")


# Spec fields that do not shape the pod template (a change of them rolls no pod).
# `rollout` lives in the Deployment's spec.strategy: a change of it is applied to the
# Deployment (resources.deployment renders it afresh) while the template, and so the
# pods, stay as they are.
NOT_IN_TEMPLATE = ("replicas", "autoscaling", "disruption", "oomRemediation", "gateway", "rollout")


def spec_hash(spec_raw: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> str:
    """Hash of what the pod template is rendered from: the spec without the fields
    that do not shape it (replicas, autoscaling, disruption, OOM policy, gateway,
    rollout strategy), plus operator-side inputs such as the OOM-lowered
    gpuMemoryUtilization. Equal hash: the template stays as it is."""
    data = {k: v for k, v in spec_raw.items() if k not in NOT_IN_TEMPLATE}
    blob = json.dumps({"spec": data, "extra": dict(extra or {})}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def parse_spec(body: Mapping[str, Any], *, default_image: str = DEFAULT_IMAGE) -> ModelDeploymentSpec:
    """CR body -> ModelDeploymentSpec, or SpecError naming the field and the rule."""
    meta = body.get("metadata") or {}
    spec_raw = body.get("spec")
    if spec_raw is None:
        raise SpecError("spec", "is required")
    if not isinstance(spec_raw, Mapping):
        raise SpecError("spec", "must be an object")
    spec_dict = apply_defaults(crd.spec_schema(), copy.deepcopy(dict(spec_raw)))
    r = _Reader(spec_dict, "spec")

    model = r.string("model", required=True)
    assert model is not None
    res = r.sub("resources")
    resources = ResourcesSpec()
    if res is not None:
        gpus = _or(res.integer("gpus", minimum=0, maximum=crd.MAX_GPUS), 1)
        resources = ResourcesSpec(gpus=gpus, cpu=res.quantity("cpu"), memory=res.quantity("memory"),
                                  shm_size=res.quantity("shmSize") or (
                                      DEFAULT_TP_SHM_SIZE if gpus > 1 else DEFAULT_SHM_SIZE),
                                  ephemeral_storage=res.quantity("ephemeralStorage") or DEFAULT_CACHE_SIZE)
    engine = r.sub("engine")
    engine_values, extra_args = _engine(engine, resources.gpus) if engine else ({}, ())
    # The concurrency target defaults to what one replica batches at once.
    # Unset, the server picks by GPU memory, which the operator cannot see: take the
    # smaller choice (GPUs under 70 GiB, CPUs), so the fleet scales out early, not late.
    max_num_seqs = serverargs.parse(extra_args).get(
        "max_num_seqs", engine_values.get("maxNumSeqs", serverargs.default("max_num_seqs")))
    if max_num_seqs is None:
        max_num_seqs = default_limits("server", None)[0]
    max_num_seqs = int(max_num_seqs)
    cache = r.sub("modelCache")
    model_cache = None
    if cache is not None:
        model_cache = ModelCacheSpec(claim_name=cache.string("claimName", required=True) or "",
                                     mount_path=cache.string("mountPath", pattern="^/") or "/models/hf-cache",
                                     read_only=bool(cache.boolean("readOnly")))
    node_selector = r.string_map("nodeSelector")
    affinity = r.core("affinity", "Affinity")
    env = r.core("env", "EnvVar", many=True) or []
    volumes = r.core("volumes", "Volume", many=True) or []
    mounts = r.core("volumeMounts", "VolumeMount", many=True) or []
    cache_path = model_cache.mount_path if model_cache else CACHE_PATH
    _check_volumes(r, volumes, mounts, ("/dev/shm", "/tmp", cache_path.rstrip("/")))
    pod_meta = r.sub("podMetadata")
    disruption = r.sub("disruption")

    return ModelDeploymentSpec(
        name=str(meta.get("name") or ""),
        namespace=str(meta.get("namespace") or "default"),
        uid=meta.get("uid"),
        generation=meta.get("generation"),
        model=model,
        served_model_name=r.string("servedModelName") or model,
        image=r.string("image") or default_image,
        image_from_spec=r.has("image"),
        engine=engine_values,
        extra_args=extra_args,
        replicas=_or(r.integer("replicas", minimum=0), 1),
        autoscaling=_autoscaling(r.sub("autoscaling"), max_num_seqs),
        resources=resources,
        api_key=_secret_ref(r.sub("apiKeySecretRef"), "api-key"),
        hf_token=_secret_ref(r.sub("hfTokenSecretRef"), "token"),
        model_cache=model_cache,
        node_selector=node_selector,
        tolerations=r.core("tolerations", "Toleration", many=True) or [],
        affinity=affinity or None,
        topology_spread=r.core("topologySpreadConstraints", "TopologySpreadConstraint", many=True),
        priority_class_name=r.string("priorityClassName"),
        runtime_class_name=r.string("runtimeClassName"),
        image_pull_secrets=r.core("imagePullSecrets", "LocalObjectReference", many=True) or [],
        service_account_name=r.string("serviceAccountName", pattern=crd.DNS_SUBDOMAIN_PATTERN),
        automount_service_account_token=bool(r.boolean("automountServiceAccountToken")),
        pod_labels=pod_meta.string_map("labels") if pod_meta else {},
        pod_annotations=pod_meta.string_map("annotations") if pod_meta else {},
        volumes=volumes,
        volume_mounts=mounts,
        pod_security_context=r.core("podSecurityContext", "PodSecurityContext") or {},
        security_context=r.core("securityContext", "SecurityContext") or {},
        env=env,
        disruption=DisruptionSpec(
            max_unavailable=_or(disruption.integer("maxUnavailable", minimum=1), 1),
            evict_last_replica=bool(disruption.boolean("evictLastReplica"))) if disruption else DisruptionSpec(),
        oom=_oom(r.sub("oomRemediation")),
        gateway=_gateway(r.sub("gateway")),
        rollout=_rollout(r.sub("rollout")),
        startup_timeout_seconds=_or(r.integer("startupTimeoutSeconds", minimum=crd.MIN_STARTUP_TIMEOUT_S,
                                              maximum=crd.MAX_STARTUP_TIMEOUT_S),
                                    crd.DEFAULT_STARTUP_TIMEOUT_S),
        spec_hash=spec_hash(spec_raw),
    )
