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
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagefleet.operator import crd

DEFAULT_IMAGE = "ghcr.io/pagefleet/pagefleet:0.1.0"
DEFAULT_SHM_SIZE = "2Gi"
# Flags the operator renders itself; extraArgs may not override them (probes, the
# Service and the Secret depend on them).
RESERVED_FLAGS = ("--host", "--port", "--served-model-name", "--api-key")


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
    target_waiting_requests: float = 5.0
    metric: str = crd.DEFAULT_METRIC
    scale_up_stabilization_seconds: int = 0
    scale_down_stabilization_seconds: int = 300
    interval_seconds: int = 15


@dataclass(frozen=True)
class ResourcesSpec:
    gpus: int = 1
    cpu: str | None = None
    memory: str | None = None
    shm_size: str = DEFAULT_SHM_SIZE


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

    def number(self, key: str, *, above: float | None = None, maximum: float | None = None) -> float | None:
        v = self.data.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise SpecError(self.at(key), f"must be a number (got {v!r})")
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
        return str(v)

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


def _engine(r: _Reader) -> tuple[dict[str, Any], tuple[str, ...]]:
    props = crd.engine_schema()["properties"]
    out: dict[str, Any] = {}
    for key in crd.ENGINE_FIELDS:
        p = props[key]
        if "enum" in p:
            v = r.choice(key, p["enum"])
        elif p["type"] == "integer":
            v = r.integer(key, minimum=p.get("minimum"))
        elif p["type"] == "number":
            v = r.number(key, above=p["minimum"], maximum=p.get("maximum"))
        else:
            v = r.boolean(key)
        if v is not None:
            out[key] = v
    extra = r.data.get("extraArgs") or []
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise SpecError(r.at("extraArgs"), "must be a list of strings")
    for a in extra:
        if a.split("=", 1)[0] in RESERVED_FLAGS:
            raise SpecError(r.at("extraArgs"), f"must not set {a.split('=', 1)[0]}: the operator "
                            "sets it (use servedModelName / apiKeySecretRef)")
    return out, tuple(extra)


def _autoscaling(r: _Reader | None) -> AutoscalingSpec:
    if r is None:
        return AutoscalingSpec()
    d = AutoscalingSpec()
    spec = AutoscalingSpec(
        enabled=bool(r.boolean("enabled")),
        min_replicas=r.integer("minReplicas", minimum=1) or d.min_replicas,
        max_replicas=r.integer("maxReplicas", minimum=1) or d.max_replicas,
        target_waiting_requests=r.number("targetWaitingRequests", above=0) or d.target_waiting_requests,
        metric=r.string("metric", pattern=crd.METRIC_NAME_PATTERN) or d.metric,
        scale_up_stabilization_seconds=_or(r.integer("scaleUpStabilizationSeconds", minimum=0),
                                           d.scale_up_stabilization_seconds),
        scale_down_stabilization_seconds=_or(r.integer("scaleDownStabilizationSeconds", minimum=0),
                                             d.scale_down_stabilization_seconds),
        interval_seconds=r.integer("intervalSeconds", minimum=1) or d.interval_seconds,
    )
    if spec.min_replicas > spec.max_replicas:  # the CRD's CEL rule crd.MIN_MAX_RULE
        raise SpecError(r.at("minReplicas"), f"must be <= maxReplicas (got {spec.min_replicas} > "
                        f"{spec.max_replicas})")
    return spec


def _or(v: int | None, default: int) -> int:
    return default if v is None else v


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
    engine = r.sub("engine")
    engine_values, extra_args = _engine(engine) if engine else ({}, ())
    res = r.sub("resources")
    resources = ResourcesSpec()
    if res is not None:
        resources = ResourcesSpec(gpus=_or(res.integer("gpus", minimum=0), 1), cpu=res.quantity("cpu"),
                                  memory=res.quantity("memory"),
                                  shm_size=res.quantity("shmSize") or DEFAULT_SHM_SIZE)
    key_ref = r.sub("apiKeySecretRef")
    api_key = None
    if key_ref is not None:
        api_key = SecretKeyRef(name=key_ref.string("name", required=True) or "",
                               key=key_ref.string("key") or "api-key")
    cache = r.sub("modelCache")
    model_cache = None
    if cache is not None:
        model_cache = ModelCacheSpec(claim_name=cache.string("claimName", required=True) or "",
                                     mount_path=cache.string("mountPath", pattern="^/") or "/models/hf-cache",
                                     read_only=bool(cache.boolean("readOnly")))
    node_selector = r.data.get("nodeSelector") or {}
    if not isinstance(node_selector, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in node_selector.items()):
        raise SpecError(r.at("nodeSelector"), "must map strings to strings")
    affinity = r.data.get("affinity")
    if affinity is not None and not isinstance(affinity, Mapping):
        raise SpecError(r.at("affinity"), "must be an object")
    env = r.list_of_objects("env")
    for i, e in enumerate(env):
        if not isinstance(e.get("name"), str) or not e["name"]:
            raise SpecError(f"{r.at('env')}[{i}].name", "is required")

    return ModelDeploymentSpec(
        name=str(meta.get("name") or ""),
        namespace=str(meta.get("namespace") or "default"),
        uid=meta.get("uid"),
        generation=meta.get("generation"),
        model=model,
        served_model_name=r.string("servedModelName") or model,
        image=r.string("image") or default_image,
        engine=engine_values,
        extra_args=extra_args,
        replicas=_or(r.integer("replicas", minimum=0), 1),
        autoscaling=_autoscaling(r.sub("autoscaling")),
        resources=resources,
        api_key=api_key,
        model_cache=model_cache,
        node_selector=dict(node_selector),
        tolerations=r.list_of_objects("tolerations"),
        affinity=dict(affinity) if affinity else None,
        priority_class_name=r.string("priorityClassName"),
        env=env,
    )
