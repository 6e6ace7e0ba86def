"""Pure: OOM remediation (seed report 002: "for models that OOM often, lower
gpu-memory-utilization automatically and restart").

The server exits with `CUDA_OOM_EXIT_CODE` after a CUDA out-of-memory (and a pod over
its memory limit is `OOMKilled`); the kubelet records that as the container's last
termination. When a ModelDeployment's pods end that way `maxOOMs` times within
`windowSeconds`, the effective --gpu-memory-utilization drops by `step`, never below
`floor`, and the pods roll with it (it is part of what the template hash covers).

The state lives in `status.oomRemediation`, tied to the spec's hash: the operator
never writes the spec (GitOps sees no drift), and any change of the spec starts over
from the spec's own value. OOMs counted before a step are dropped with it: the next
step needs `maxOOMs` more at the new level.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pagefleet.operator.spec import OOMSpec
from pagefleet.server.config import CUDA_OOM_EXIT_CODE

CUDA_OOM = "CudaOutOfMemory"
OOM_KILLED = "OOMKilled"


@dataclass(frozen=True)
class OOMExit:
    pod: str
    time: float        # epoch seconds the container ended
    reason: str        # CUDA_OOM or OOM_KILLED


@dataclass(frozen=True)
class OOMState:
    spec_hash: str
    gpu_memory_utilization: float | None = None     # None: the spec's own value
    ooms: tuple[OOMExit, ...] = ()
    last_remediation: float | None = None


@dataclass(frozen=True)
class Step:
    state: OOMState
    lowered: tuple[float, float] | None = None       # (from, to) when this evaluation stepped down
    at_floor: bool = False                           # enough OOMs, but already at the floor
    counted: tuple[OOMExit, ...] = field(default_factory=tuple)


def _terminations(pod: Mapping[str, Any], container: str) -> list[Mapping[str, Any]]:
    out = []
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") != container:
            continue
        for key in ("lastState", "state"):
            term = (cs.get(key) or {}).get("terminated")
            if term:
                out.append(term)
    return out


def oom_exits(pods: Sequence[Mapping[str, Any]], container: str,
              parse_time: Callable[[str], float | None], template_hash: str | None = None,
              hash_annotation: str = "") -> list[OOMExit]:
    """The OOM terminations the pods' container statuses show; with `template_hash`,
    only of pods rendered from it (pods of an older spec or level do not count)."""
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if template_hash is not None and (meta.get("annotations") or {}).get(hash_annotation) != template_hash:
            continue
        name = meta.get("name", "?")
        for term in _terminations(pod, container):
            if term.get("exitCode") == CUDA_OOM_EXIT_CODE:
                reason = CUDA_OOM
            elif term.get("reason") == OOM_KILLED:
                reason = OOM_KILLED
            else:
                continue
            at = parse_time(term.get("finishedAt") or "")
            if at is not None:
                out.append(OOMExit(name, at, reason))
    return out


def step(state: OOMState, exits: Sequence[OOMExit], policy: OOMSpec, base: float, now: float) -> Step:
    """Count new OOM exits in the window; lower the utilization once enough are seen."""
    if not policy.enabled:
        return Step(replace(state, ooms=()))
    since = now - policy.window_seconds
    if state.last_remediation is not None:
        since = max(since, state.last_remediation)
    known = {(e.pod, e.time) for e in state.ooms}
    merged = [e for e in state.ooms if e.time > since]
    merged += [e for e in exits if e.time > since and (e.pod, e.time) not in known]
    merged.sort(key=lambda e: e.time)
    current = state.gpu_memory_utilization if state.gpu_memory_utilization is not None else base
    if len(merged) < policy.max_ooms:
        return Step(replace(state, ooms=tuple(merged)), counted=tuple(merged))
    lowered = round(max(policy.floor, current - policy.step), 4)
    if lowered >= current:
        return Step(replace(state, ooms=tuple(merged)), at_floor=True, counted=tuple(merged))
    new = OOMState(spec_hash=state.spec_hash, gpu_memory_utilization=lowered, ooms=(), last_remediation=now)
    return Step(new, lowered=(current, lowered), counted=tuple(merged))


def from_status(st: Mapping[str, Any] | None, spec_hash: str,
                parse_time: Callable[[str], float | None]) -> OOMState:
    """The state in status.oomRemediation, or a fresh one when the spec changed."""
    data = (st or {}).get("oomRemediation")
    if not isinstance(data, Mapping) or data.get("specHash") != spec_hash:
        return OOMState(spec_hash=spec_hash)
    ooms = []
    for e in data.get("ooms") or []:
        at = parse_time(str(e.get("time", "")))
        if at is not None:
            ooms.append(OOMExit(str(e.get("pod", "?")), at, str(e.get("reason", CUDA_OOM))))
    gmu = data.get("gpuMemoryUtilization")
    last = data.get("lastRemediationTime")
    return OOMState(spec_hash=spec_hash,
                    gpu_memory_utilization=float(gmu) if isinstance(gmu, (int, float)) else None,
                    ooms=tuple(ooms), last_remediation=parse_time(last) if last else None)


def to_status(state: OOMState, to_iso: Callable[[float], str]) -> dict[str, Any]:
    out: dict[str, Any] = {"specHash": state.spec_hash,
                           "ooms": [{"pod": e.pod, "time": to_iso(e.time), "reason": e.reason}
                                    for e in state.ooms]}
    if state.gpu_memory_utilization is not None:
        out["gpuMemoryUtilization"] = state.gpu_memory_utilization
    if state.last_remediation is not None:
        out["lastRemediationTime"] = to_iso(state.last_remediation)
    return out
