"""Pure: what a ModelDeployment's `.status` should say.

Conditions follow the Kubernetes convention (type/status/reason/message/
lastTransitionTime, the time kept while the status does not change), so `kubectl
wait --for=condition=Available mdep/x` works:

- Available: at least one replica is ready, i.e. the endpoint serves.
- Progressing: a rollout or scale is under way (True) or done (False).
- Degraded: the spec is invalid, the operator cannot apply it, or the rollout
  exceeded its deadline.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(type_: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}


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


def error_conditions(reason: str, message: str, deployment: Mapping[str, Any] | None,
                     desired: int) -> list[dict[str, Any]]:
    """Degraded=True with the error; Available/Progressing still tell the truth about
    whatever is running from the last good spec."""
    conds = deployment_conditions(deployment, desired) if deployment is not None else [
        condition("Available", False, reason, message),
        condition("Progressing", False, reason, message)]
    return [c for c in conds if c["type"] != "Degraded"] + [condition("Degraded", True, reason, message)]


def build_status(*, old: Mapping[str, Any] | None, generation: int | None,
                 deployment: Mapping[str, Any] | None, desired: int | None,
                 waiting: float | None, selector: str | None, endpoint: str | None,
                 last_scale_time: str | None, conditions: Sequence[Mapping[str, Any]],
                 now: str) -> dict[str, Any]:
    """The whole status. Fields whose value is unknown keep their old value."""
    old = old or {}
    st = (deployment or {}).get("status") or {}
    out: dict[str, Any] = {}
    if generation is not None:
        out["observedGeneration"] = generation
    out["replicas"] = int(st.get("replicas") or 0)
    out["readyReplicas"] = int(st.get("readyReplicas") or 0)
    for key, value in (("desiredReplicas", desired), ("selector", selector), ("endpoint", endpoint),
                       ("lastScaleTime", last_scale_time)):
        if value is not None:
            out[key] = value
        elif key in old:
            out[key] = old[key]
    if waiting is not None:
        out["waitingRequests"] = int(waiting) if float(waiting).is_integer() else round(waiting, 3)
    elif "waitingRequests" in old:
        out["waitingRequests"] = old["waitingRequests"]
    out["conditions"] = merge_conditions(old.get("conditions"), conditions, now, generation)
    return out


def same_status(a: Mapping[str, Any] | None, b: Mapping[str, Any]) -> bool:
    """Equal apart from condition timestamps: skip the write (and the watch event)."""
    def strip(s: Mapping[str, Any] | None) -> dict[str, Any]:
        s = dict(s or {})
        s["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                           for c in s.get("conditions") or []]
        return s
    return strip(a) == strip(b)
