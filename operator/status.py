"""Pure: what a ModelDeployment's `.status` should say.

Conditions follow the Kubernetes convention (type/status/reason/message/
lastTransitionTime, the time kept while the status does not change), so `kubectl
wait --for=condition=Available mdep/x` works:

- Available: at least one replica is ready, i.e. the endpoint serves.
- Progressing: a rollout or scale is under way (True) or done (False).
- Degraded: the spec is invalid, the API server refused a child, or the rollout
  exceeded its deadline.
- Ready / Reconciling / Stalled: the "abnormal-true" trio that Flux's kstatus (and
  `kubectl wait --for=condition=Ready`) reads. Ready means the current generation is
  applied and fully rolled out; Reconciling that it is being applied or rolled out;
  Stalled that it cannot make progress without a change (invalid spec, a child the
  API server refuses, progress deadline exceeded).
- MetricsAvailable: the ready pods answer /metrics (the autoscaler's input).
- OOMRemediation: True while the operator runs the pods with a lowered
  gpuMemoryUtilization after repeated OOMs.
- CacheShared: only with a modelCache: False when its PVC can be mounted on one node
  only (every replica must then run there; rollouts never surge: maxSurge 0).
- Active: only with minReplicas 0: True while the model serves, False once it is
  scaled to zero, Unknown when the gateway's counts cannot be read.
- InferencePool: only with gateway.inferencePool: whether its InferencePool exists.

`status.observedGeneration` is the last generation whose children were all applied;
each condition carries the generation it describes.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

UNSET = object()  # build_status: a field to drop (its value is unknown now)


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def to_iso(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def from_iso(text: str) -> float | None:
    try:
        return datetime.datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def condition(type_: str, ok: bool | None, reason: str, message: str) -> dict[str, Any]:
    state = "Unknown" if ok is None else ("True" if ok else "False")
    return {"type": type_, "status": state, "reason": reason, "message": message}


@dataclass(frozen=True)
class Failure:
    """Why the current generation is not (fully) applied."""

    reason: str        # InvalidSpec, ApplyFailed
    message: str
    stalled: bool      # needs a change to recover (vs. retried: conflicts, throttling, 5xx)


def merge_conditions(old: Sequence[Mapping[str, Any]] | None, new: Sequence[Mapping[str, Any]],
                     now: str, generation: int | None) -> list[dict[str, Any]]:
    """New conditions, keeping lastTransitionTime where the status did not flip."""
    previous = {c.get("type"): c for c in old or []}
    out = []
    for c in new:
        prev = previous.get(c["type"])
        keep = prev is not None and prev.get("status") == c["status"] and prev.get("lastTransitionTime")
        item = dict(c, lastTransitionTime=prev["lastTransitionTime"] if keep else now)  # type: ignore[index]
        if generation is not None:
            item["observedGeneration"] = generation
        out.append(item)
    return out


def deployment_conditions(deployment: Mapping[str, Any] | None, desired: int) -> list[dict[str, Any]]:
    """Available / Progressing / Degraded from the Deployment the operator owns."""
    if deployment is None:
        return [condition("Available", False, "DeploymentMissing", "the Deployment does not exist yet"),
                condition("Progressing", True, "Creating", "creating the Deployment"),
                condition("Degraded", False, "AsExpected", "")]
    st = deployment.get("status") or {}
    ready = int(st.get("readyReplicas") or 0)
    updated = int(st.get("updatedReplicas") or 0)
    total = int(st.get("replicas") or 0)
    dep_conditions = {c.get("type"): c for c in st.get("conditions") or []}
    stalled = dep_conditions.get("Progressing", {}).get("reason") == "ProgressDeadlineExceeded"
    available = condition("Available", ready > 0,
                          "MinimumReplicasAvailable" if ready > 0 else "NoReplicasReady",
                          f"{ready}/{desired} replicas ready")
    done = ready >= desired and updated >= desired and total == desired
    progressing = condition("Progressing", not done, "RolloutInProgress" if not done else "RolloutComplete",
                            f"{updated} updated, {ready} ready, {total} total of {desired} desired")
    if stalled:
        degraded = condition("Degraded", True, "ProgressDeadlineExceeded",
                             dep_conditions["Progressing"].get("message", "rollout stalled"))
    else:
        degraded = condition("Degraded", False, "AsExpected", "")
    return [available, progressing, degraded]


def conditions(*, deployment: Mapping[str, Any] | None, desired: int, failure: Failure | None,
               current: bool) -> list[dict[str, Any]]:
    """The seven core conditions. `current`: the CR's generation has been applied."""
    base = {c["type"]: c for c in deployment_conditions(deployment, desired)}
    if failure is not None:
        base["Degraded"] = condition("Degraded", True, failure.reason, failure.message)
        if deployment is None:
            base["Available"] = condition("Available", False, failure.reason, failure.message)
            base["Progressing"] = condition("Progressing", False, failure.reason, failure.message)
    deadline = base["Degraded"]["reason"] == "ProgressDeadlineExceeded"
    stalled_why = (failure.reason, failure.message) if failure and failure.stalled else (
        ("ProgressDeadlineExceeded", base["Degraded"]["message"]) if deadline else None)
    rolling = base["Progressing"]["status"] == "True"
    if stalled_why:
        stalled = condition("Stalled", True, *stalled_why)
    else:
        stalled = condition("Stalled", False, "AsExpected", "")
    if failure is not None and not failure.stalled:
        reconciling = condition("Reconciling", True, "Retrying", failure.message)
    elif not current and failure is None:
        reconciling = condition("Reconciling", True, "Applying", "applying the new generation")
    elif rolling and not stalled_why:
        reconciling = condition("Reconciling", True, base["Progressing"]["reason"], base["Progressing"]["message"])
    else:
        reconciling = condition("Reconciling", False, "AsExpected", "")
    if stalled_why:
        ready = condition("Ready", False, stalled_why[0], stalled_why[1])
    elif reconciling["status"] == "True":
        ready = condition("Ready", False, reconciling["reason"], reconciling["message"])
    elif base["Available"]["status"] != "True" and desired > 0:
        ready = condition("Ready", False, base["Available"]["reason"], base["Available"]["message"])
    else:
        ready = condition("Ready", True, "Ready", base["Available"]["message"])
    return [base["Available"], base["Progressing"], base["Degraded"], ready, reconciling, stalled]


def build_status(*, old: Mapping[str, Any] | None, conditions: Sequence[Mapping[str, Any]],
                 generation: int | None, now: str, deployment: Mapping[str, Any] | None = None,
                 drop: Sequence[str] = (), **fields: Any) -> dict[str, Any]:
    """The whole status. `fields` set status keys (UNSET drops one); keys not given
    keep their old value. replicas/readyReplicas come from the Deployment when known.
    Conditions of other types than `conditions` are kept (their writer owns them),
    except the types in `drop` (no longer meaningful)."""
    out: dict[str, Any] = {k: v for k, v in (old or {}).items() if k != "conditions"}
    if deployment is not None:
        st = deployment.get("status") or {}
        out["replicas"] = int(st.get("replicas") or 0)
        out["readyReplicas"] = int(st.get("readyReplicas") or 0)
    for key, value in fields.items():
        if value is UNSET:
            out.pop(key, None)
        elif value is not None:
            out[key] = _number(value) if key in ("waitingRequests", "runningRequests", "metricValue") else value
    new_types = {c["type"] for c in conditions}
    kept = [c for c in (old or {}).get("conditions") or [] if c.get("type") not in new_types
            and c.get("type") not in drop]
    merged = merge_conditions((old or {}).get("conditions"), conditions, now, generation)
    out["conditions"] = _ordered(merged + kept)
    return out


_ORDER = ("Available", "Progressing", "Degraded", "Ready", "Reconciling", "Stalled",
          "MetricsAvailable", "OOMRemediation", "CacheShared", "Active", "InferencePool")


def _ordered(conds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(conds, key=lambda c: _ORDER.index(c["type"]) if c["type"] in _ORDER else len(_ORDER))


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else round(float(value), 3)


def same_status(a: Mapping[str, Any] | None, b: Mapping[str, Any]) -> bool:
    """Equal apart from condition timestamps: skip the write (and the watch event)."""
    def strip(s: Mapping[str, Any] | None) -> dict[str, Any]:
        s = dict(s or {})
        s["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                           for c in s.get("conditions") or []]
        return s
    return strip(a) == strip(b)


def status_patch(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch from old to new status: keys dropped at any depth become
    null (a merge patch merges objects, so a key left out would stay)."""
    patch: dict[str, Any] = {}
    for key, value in new.items():
        prev = (old or {}).get(key)
        patch[key] = status_patch(prev, value) if isinstance(value, Mapping) and isinstance(prev, Mapping) else value
    for key in old or {}:
        if key not in new:
            patch[key] = None
    return patch


def get_condition(st: Mapping[str, Any] | None, type_: str) -> Mapping[str, Any] | None:
    return next((c for c in (st or {}).get("conditions") or [] if c.get("type") == type_), None)


def active_condition(*, gateway: str | None, replicas: int, signal: Any, errors: Sequence[str],
                     reason: str, namespace: str) -> dict[str, Any]:
    """Active (minReplicas 0 only), KEDA's word for "not scaled to zero". `gateway`:
    the Services the operator scrapes (None: none configured); `signal`: the gateway's
    counts for this pool (gateway.PoolSignal, None when not read); `reason`: the
    scale-to-zero rule's last line."""
    if gateway is None:
        return condition("Active", None, "NoGateway",
                         "minReplicas is 0 but the operator reads no gateway (--gateway-service): "
                         "nothing will scale this model up from zero")
    if signal is None:
        if errors:
            return condition("Active", None, "GatewayMetricsUnavailable",
                             f"cannot read the gateway ({gateway}): {errors[0]}")
        return condition("Active", None, "NotInGateway",
                         f"no replica of the gateway ({gateway}) watches namespace {namespace}")
    if replicas == 0:
        return condition("Active", False, "ScaledToZero",
                         "scaled to zero; the gateway holds the next request and the operator "
                         "scales 0 -> 1 for it")
    if signal.waiting > 0:
        return condition("Active", True, "RequestsWaiting", reason)
    return condition("Active", True, "Serving", reason)


def metrics_condition(samples: Sequence[Any], metric: str, port: int) -> dict[str, Any]:
    """MetricsAvailable from one scrape round (autoscale.PodSample-like items)."""
    ready = [s for s in samples if s.ready]
    reported = [s for s in ready if s.value is not None]
    if not ready:
        return condition("MetricsAvailable", None, "NoReadyPods", "no ready pod to scrape")
    if not reported:
        errors = sorted({s.error for s in ready if s.error})
        return condition("MetricsAvailable", False, "ScrapeFailed",
                         f"none of {len(ready)} ready pods reported {metric} on port {port} "
                         f"(is the operator allowed to reach them? see the chart's networkPolicy); "
                         f"holding the size; last error: {errors[0] if errors else 'unknown'}")
    missing = len(ready) - len(reported)
    note = f"; {missing} did not" if missing else ""
    return condition("MetricsAvailable", True, "MetricsReported",
                     f"{len(reported)}/{len(ready)} ready pods reported {metric}{note}")
