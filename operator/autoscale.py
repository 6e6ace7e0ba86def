"""Pure: per-pod metric samples + history -> desired replicas, with HPA semantics.

The rules are Kubernetes' HorizontalPodAutoscaler's (pkg/controller/podautoscaler),
because users already reason in them and already tune KEDA/HPA rules on
`vllm:num_requests_waiting`:

- desired = ceil(sum of the metric over pods / target per replica), but no change
  while the usage ratio is within the tolerance (0.1) of 1;
- pods that are not ready, failed their scrape, or do not exist yet (the Deployment
  asks for more than there are) count as 0 when scaling up and as exactly at target
  when scaling down, so a half-started fleet neither over- nor under-reacts; a
  change of direction caused by that filling means no change;
- the result is clamped to [minReplicas, maxReplicas];
- stabilization: scale up to the lowest recommendation of the last
  scaleUpStabilizationSeconds (0: at once), scale down to the highest
  recommendation of the last scaleDownStabilizationSeconds. This is what stops
  a bursty queue from flapping the fleet;
- HPA's default scale-up policy: within any 15 s, at most +100 % or +4 pods
  (whichever is more) over the size at the period's start, so one burst does not
  ask the cluster for dozens of GPUs at once.

Time is passed in (wall-clock epoch seconds, so the history can be kept in the
status across operator restarts), so tests drive it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagefleet.operator import crd
from pagefleet.operator.spec import AutoscalingSpec

TOLERANCE = 0.1
SCALE_UP_PERIOD_S = 15.0


@dataclass(frozen=True)
class PodSample:
    """One pod's view: `value` is the summed metric, None when it could not be read."""

    pod: str
    ready: bool
    value: float | None
    values: Mapping[str, float] = field(default_factory=dict)   # every metric read from the page
    error: str | None = None                                    # why value is None


@dataclass(frozen=True)
class Recommendation:
    at: float
    replicas: int


@dataclass(frozen=True)
class ScaleUp:
    at: float
    added: int


@dataclass(frozen=True)
class Decision:
    replicas: int                         # what the Deployment should have now
    recommendation: int                   # this evaluation's (clamped) recommendation
    waiting: float                        # metric summed over the pods that reported it
    reported: int                         # pods that reported it
    history: tuple[Recommendation, ...]   # to pass to the next evaluation
    reason: str                           # one line for the Event and the log
    scale_ups: tuple[ScaleUp, ...] = ()   # to pass to the next evaluation


def metric_replicas(samples: Sequence[PodSample], current: int, target: float,
                    tolerance: float = TOLERANCE) -> int:
    """HPA's replica calculation for an AverageValue pods metric (before clamping)."""
    reported = [s.value for s in samples if s.ready and s.value is not None]
    if not reported:
        return current  # no metrics at all: the HPA makes no change either
    missing = sum(1 for s in samples if not (s.ready and s.value is not None))
    missing += max(0, current - len(samples))  # asked for but not (yet) created
    usage = sum(reported)
    ratio = usage / (target * len(reported))
    if missing == 0:
        if abs(1.0 - ratio) <= tolerance:
            return current
        return math.ceil(usage / target)
    if ratio < 1.0:
        usage += target * missing      # scale-down: missing pods are at target
    elif ratio == 1.0:
        return current
    # scale-up: missing pods count as 0, i.e. add nothing
    new_ratio = usage / (target * (len(reported) + missing))
    if abs(1.0 - new_ratio) <= tolerance or (ratio < 1.0 < new_ratio) or (new_ratio < 1.0 < ratio):
        return current
    new = math.ceil(new_ratio * (len(reported) + missing))
    if (new_ratio < 1.0 and new > current) or (new_ratio > 1.0 and new < current):
        return current
    return new


def stabilize(current: int, recommendation: int, history: Sequence[Recommendation], now: float,
              up_window: float, down_window: float) -> tuple[int, tuple[Recommendation, ...]]:
    """HPA's behavior-based stabilization: returns (replicas, new history)."""
    up = min([recommendation] + [r.replicas for r in history if r.at > now - up_window])
    down = max([recommendation] + [r.replicas for r in history if r.at > now - down_window])
    replicas = current
    if replicas < up:
        replicas = up
    if replicas > down:
        replicas = down
    keep = max(up_window, down_window)
    # Only the latest time of each value matters to a min/max over a window, so one
    # entry per value is kept (a short list, cheap to keep in the status).
    new_history = tuple(r for r in history if r.at > now - keep and r.replicas != recommendation) + (
        Recommendation(now, recommendation),)
    return replicas, new_history


def scale_up_limit(current: int, scale_ups: Sequence[ScaleUp], now: float) -> int:
    """HPA's default scale-up policy: max(+100 %, +4 pods) per 15 s period, counted
    from the size the Deployment had at the start of the period."""
    start = current - sum(e.added for e in scale_ups if e.at > now - SCALE_UP_PERIOD_S)
    return max(2 * start, start + 4)


def _fmt(x: float) -> str:
    return f"{x:g}"


def describe(policy: AutoscalingSpec, total: float) -> str:
    """`14 waiting, target 5 per replica` / `concurrency 180, target 96 per replica`."""
    if policy.metric == crd.METRIC_WAITING:
        return f"{_fmt(total)} waiting, target {_fmt(policy.target)} per replica"
    return f"{policy.metric} {_fmt(total)}, target {_fmt(policy.target)} per replica"


def decide(samples: Sequence[PodSample], current: int, history: Sequence[Recommendation],
           policy: AutoscalingSpec, now: float, scale_ups: Sequence[ScaleUp] = ()) -> Decision:
    """One autoscaler evaluation."""
    raw = metric_replicas(samples, current, policy.target)
    recommendation = max(policy.min_replicas, min(policy.max_replicas, raw))
    stabilized, new_history = stabilize(current, recommendation, history, now,
                                        policy.scale_up_stabilization_seconds,
                                        policy.scale_down_stabilization_seconds)
    replicas = max(policy.min_replicas, min(policy.max_replicas, stabilized))
    rate_limited = False
    if replicas > current:
        limit = max(scale_up_limit(current, scale_ups, now), current)
        rate_limited = replicas > limit
        replicas = min(replicas, limit)
    recent = tuple(e for e in scale_ups if e.at > now - SCALE_UP_PERIOD_S)
    if replicas > current:
        recent += (ScaleUp(now, replicas - current),)
    reported = [s.value for s in samples if s.ready and s.value is not None]
    total = float(sum(reported))
    why = describe(policy, total)
    if raw > policy.max_replicas and replicas == policy.max_replicas:
        why += f" (capped at maxReplicas {policy.max_replicas})"
    elif raw < policy.min_replicas and replicas == policy.min_replicas:
        why += f" (floored at minReplicas {policy.min_replicas})"
    if rate_limited:
        why += f" (at most +100% or +4 pods per {SCALE_UP_PERIOD_S:g}s)"
    if replicas < current and stabilized != recommendation:
        why += f" (highest recommendation in the last {policy.scale_down_stabilization_seconds}s)"
    unreported = len(samples) - len(reported) + max(0, current - len(samples))
    if unreported:
        why += f"; {unreported} pod(s) not reporting"
    if not reported and samples:
        why += " (no metrics: holding the size)"
    reason = f"scaled {current} -> {replicas}: {why}" if replicas != current else f"holding {current}: {why}"
    return Decision(replicas=replicas, recommendation=recommendation, waiting=total,
                    reported=len(reported), history=new_history, reason=reason,
                    scale_ups=recent)


def seed_history(current: int, now: float) -> tuple[Recommendation, ...]:
    """History for a fresh operator (start, restart, failover): as if the current
    size had just been recommended, so a restart never skips a scale-down window."""
    return (Recommendation(now, current),)


def history_to_status(history: Sequence[Recommendation], scale_ups: Sequence[ScaleUp],
                      to_iso: Any) -> dict[str, Any]:
    """status.autoscaler: the windows' content, so a restarted (or failed-over)
    operator decides exactly as the one before it would have."""
    return {"recommendations": [{"time": to_iso(r.at), "replicas": r.replicas} for r in history],
            "scaleUps": [{"time": to_iso(e.at), "added": e.added} for e in scale_ups]}


def history_from_status(st: Mapping[str, Any] | None, from_iso: Any
                        ) -> tuple[tuple[Recommendation, ...], tuple[ScaleUp, ...]] | None:
    """Inverse of history_to_status; None when the status holds none (or garbage)."""
    data = (st or {}).get("autoscaler")
    if not isinstance(data, Mapping) or not data.get("recommendations"):
        return None
    try:
        recs = tuple(Recommendation(from_iso(r["time"]), int(r["replicas"])) for r in data["recommendations"])
        ups = tuple(ScaleUp(from_iso(e["time"]), int(e["added"])) for e in data.get("scaleUps") or [])
    except (KeyError, TypeError, ValueError):
        return None
    if any(r.at is None for r in recs) or any(e.at is None for e in ups):
        return None
    return recs, ups


def persisted(old: Mapping[str, Any] | None, history: Sequence[Recommendation], scale_ups: Sequence[ScaleUp],
              now: float, refresh_s: float, to_iso: Any, from_iso: Any) -> dict[str, Any]:
    """What to keep in status.autoscaler: the new history when its values changed or a
    scale happened, else the old one until the current recommendation's time in it is
    `refresh_s` old. Each evaluation would otherwise write the status just to move one
    timestamp; a time kept up to `refresh_s` late can end a window at most that early."""
    new = history_to_status(history, scale_ups, to_iso)
    if not isinstance(old, Mapping) or not history:
        return new
    values = lambda h: sorted(int(r["replicas"]) for r in h.get("recommendations") or [])  # noqa: E731
    if values(old) != values(new) or (old.get("scaleUps") or []) != new["scaleUps"]:
        return new
    latest = history[-1]
    for r in old.get("recommendations") or []:
        if int(r["replicas"]) == latest.replicas:
            at = from_iso(r["time"])
            return new if at is None or now - at >= refresh_s else dict(old)
    return new
