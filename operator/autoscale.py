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

One rule of our own, for the default metric (`concurrency`, target maxNumSeqs): a
replica whose KV cache (or token budget) binds before maxNumSeqs queues requests
while its running + waiting is still below target, so the HPA rule alone would let
a queue of hundreds build before adding a replica. When replicas have queued for
SATURATION_SUSTAIN_S (seed 000's alert: "waiting above 0 for 10 s means saturated:
scale out"), their running count is learned as what a replica really holds (the
capacity) and used as the target, in both directions: a target that snapped back to
maxNumSeqs once the queue drained would shrink the fleet, which would queue again (a
5 -> 2 -> 5 flap every scale-down window). The capacity is measured again whenever
replicas queue for the window, and rises when a replica runs more than it without a
queue (a shorter workload, or one measured low).

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
SATURATION_SUSTAIN_S = 10.0
RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"


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
    saturated_since: float | None = None  # to pass to the next evaluation
    capacity: float | None = None         # learned running per replica; to pass on


def metric_replicas(samples: Sequence[PodSample], current: int, target: float,
                    tolerance: float = TOLERANCE, extra: float = 0.0) -> int:
    """HPA's replica calculation for an AverageValue pods metric (before clamping).
    `extra`: load no pod reports, added to the pods' sum (the requests the gateway
    holds for this pool: with the gateway capping each replica at its maxNumSeqs, the
    pods alone never read above target)."""
    reported = [s.value for s in samples if s.ready and s.value is not None]
    if not reported:
        return current  # no metrics at all: the HPA makes no change either
    missing = sum(1 for s in samples if not (s.ready and s.value is not None))
    missing += max(0, current - len(samples))  # asked for but not (yet) created
    usage = sum(reported) + extra
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


def queueing_capacity(samples: Sequence[PodSample], target: float) -> float | None:
    """The per-replica capacity when ready pods queue; None when none does: the mean
    running count of the queueing pods (capped at `target`), since a pod with a queue
    runs all it can. Only the queueing pods are averaged so that one idle replica
    behind an uneven router does not read as a small capacity."""
    queueing = [s.values[RUNNING] for s in samples
                if s.ready and RUNNING in s.values and s.values.get(WAITING, 0) > 0]
    if not queueing:
        return None
    return min(target, max(1.0, sum(queueing) / len(queueing)))


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


def describe(policy: AutoscalingSpec, total: float, target: float | None = None) -> str:
    """`14 waiting, target 5 per replica` / `concurrency 180, target 96 per replica` /
    `concurrency 300, target 60 per replica (learned; 256 configured)`."""
    if policy.metric == crd.METRIC_WAITING:
        return f"{_fmt(total)} waiting, target {_fmt(policy.target)} per replica"
    learned = target is not None and target < policy.target
    return (f"{policy.metric} {_fmt(total)}, target {_fmt(target if learned else policy.target)} "
            f"per replica" + (f" (learned; {_fmt(policy.target)} configured)" if learned else ""))


def learn_capacity(samples: Sequence[PodSample], policy: AutoscalingSpec, now: float,
                   saturated_since: float | None, capacity: float | None
                   ) -> tuple[float | None, float | None, str]:
    """(since, capacity, note) for the concurrency metric: `since` when the ready pods
    have queued (None: no queue), the learned running per replica (None: none learned,
    the configured target holds), a note for the Event while a queue is not yet old
    enough to act on."""
    measured = queueing_capacity(samples, policy.target)
    if measured is None:
        if capacity is not None:
            busiest = max((s.values[RUNNING] for s in samples if s.ready and RUNNING in s.values),
                          default=0.0)
            if busiest > capacity:       # runs more than learned without a queue
                capacity = min(policy.target, busiest)
        return None, capacity, ""
    since = now if saturated_since is None else saturated_since
    if now - since >= SATURATION_SUSTAIN_S:
        return since, measured, (f" (replicas have queued for {now - since:.0f}s running "
                                 f"{_fmt(round(measured, 1))} each: sized at that capacity)")
    return since, capacity, (f" (replicas queueing for {now - since:.0f}s; sizing at their "
                             f"running count at {SATURATION_SUSTAIN_S:g}s)")


def decide(samples: Sequence[PodSample], current: int, history: Sequence[Recommendation],
           policy: AutoscalingSpec, now: float, scale_ups: Sequence[ScaleUp] = (),
           extra: float = 0.0, saturated_since: float | None = None,
           capacity: float | None = None) -> Decision:
    """One autoscaler evaluation. With minReplicas 0 this rule never goes below 1:
    only `scale_to_zero` (idle for the window) takes a model to zero.
    `saturated_since`, `capacity`: the previous evaluation's (`learn_capacity`)."""
    floor = max(1, policy.min_replicas)
    since, saturated_note, target = None, "", policy.target
    if policy.metric == crd.METRIC_CONCURRENCY:
        since, capacity, saturated_note = learn_capacity(samples, policy, now, saturated_since,
                                                         capacity)
        if capacity is not None:
            target = min(target, capacity)
    else:
        capacity = None
    raw = metric_replicas(samples, current, target, extra=extra)
    recommendation = max(floor, min(policy.max_replicas, raw))
    stabilized, new_history = stabilize(current, recommendation, history, now,
                                        policy.scale_up_stabilization_seconds,
                                        policy.scale_down_stabilization_seconds)
    replicas = max(floor, min(policy.max_replicas, stabilized))
    rate_limited = False
    if replicas > current:
        limit = max(scale_up_limit(current, scale_ups, now), current)
        rate_limited = replicas > limit
        replicas = min(replicas, limit)
    recent = tuple(e for e in scale_ups if e.at > now - SCALE_UP_PERIOD_S)
    if replicas > current:
        recent += (ScaleUp(now, replicas - current),)
    reported = [s.value for s in samples if s.ready and s.value is not None]
    total = float(sum(reported)) + (extra if reported else 0.0)
    why = describe(policy, total, target)
    if extra and reported:
        why += f" (incl. {_fmt(extra)} held in the gateway)"
    why += saturated_note
    if raw > policy.max_replicas and replicas == policy.max_replicas:
        why += f" (capped at maxReplicas {policy.max_replicas})"
    elif raw < floor and replicas == floor:
        why += f" (floored at minReplicas {policy.min_replicas})" if floor == policy.min_replicas else \
            " (at 1: scale to zero waits for the idle window)"
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
                    scale_ups=recent, saturated_since=since, capacity=capacity)


@dataclass(frozen=True)
class ZeroDecision:
    """The scale-to-zero rule's word. `replicas` None: not its call (the HPA rule above
    decides, never below 1)."""

    replicas: int | None
    reason: str


def scale_to_zero(current: int, policy: AutoscalingSpec, signal: Any, complete: bool,
                  server_load: float | None, idle_start: float, now: float) -> ZeroDecision:
    """minReplicas 0, KubeAI/KEDA style, on the gateway's signal (`gateway.PoolSignal`:
    requests it holds and has in flight for this pool, the model's last request):

    - at 0: to 1 as soon as any gateway replica holds a request for the pool (the HPA
      rule takes over from there on the pods' metrics); else stay at 0;
    - above 0: to 0 when every gateway replica answered (`complete`), none holds or has
      in flight a request for the pool, the ready pods run and queue nothing
      (`server_load` 0; None: a ready pod did not report, so it is not known), and the
      last request is at least scaleToZeroIdleSeconds old. The window also counts from
      `idle_start`: the last evaluation that saw the pool busy, a 0 -> 1, or when this
      operator started watching (so a restart never ends it early)."""
    idle_s = policy.scale_to_zero_idle_seconds
    if current == 0:
        if signal is not None and signal.waiting > 0:
            return ZeroDecision(1, f"scaled 0 -> 1: {_fmt(signal.waiting)} request(s) waiting in the gateway")
        if signal is None:
            return ZeroDecision(0, "holding 0: no word from the gateway on this pool")
        return ZeroDecision(0, "holding 0: no request waiting in the gateway")
    if signal is None or not complete:
        return ZeroDecision(None, "not scaling to zero: the gateway's counts are incomplete")
    if signal.waiting > 0 or signal.inflight > 0:
        return ZeroDecision(None, f"serving: {_fmt(signal.waiting)} waiting, {_fmt(signal.inflight)} in flight "
                                  "in the gateway")
    if server_load is None or server_load > 0:
        return ZeroDecision(None, "serving: the servers report requests running or waiting"
                            if server_load else "not scaling to zero: a ready pod did not report its load")
    since = max(signal.last_request or 0.0, idle_start)
    idle = now - since
    if idle >= idle_s:
        last = (f"last request {now - signal.last_request:.0f}s ago" if signal.last_request
                else "no request yet")
        return ZeroDecision(0, f"scaled {current} -> 0: idle for {idle:.0f}s (nothing waiting or in flight in "
                               f"the gateway or running on the servers; {last}; scaleToZeroIdleSeconds {idle_s})")
    return ZeroDecision(None, f"idle for {idle:.0f}s of {idle_s}s before scaling to zero")


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
