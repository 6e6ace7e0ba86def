"""Table tests of the pure autoscaler (HPA semantics on the waiting queue)."""

from __future__ import annotations

import pytest

from pagefleet.operator.autoscale import (
    PodSample,
    Recommendation,
    decide,
    metric_replicas,
    seed_history,
    stabilize,
)
from pagefleet.operator.spec import AutoscalingSpec


def ready(*values: float | None) -> list[PodSample]:
    return [PodSample(f"p{i}", True, v) for i, v in enumerate(values)]


def unready(n: int, start: int = 100) -> list[PodSample]:
    return [PodSample(f"u{start + i}", False, None) for i in range(n)]


@pytest.mark.parametrize("samples,current,target,expected,why", [
    (ready(14), 1, 5, 3, "ceil(14 / 5)"),
    (ready(14), 1, 4, 4, "ceil(14 / 4)"),
    (ready(0, 0, 0), 3, 5, 0, "empty queue: zero before clamping"),
    (ready(2, 1, 1), 3, 5, 1, "ceil(4 / 5)"),
    (ready(6, 5, 5), 3, 5, 3, "ratio 16/15 = 1.067 is within the 0.1 tolerance"),
    (ready(5, 4, 4.6), 3, 5, 3, "ratio 13.6/15 = 0.907 is within the tolerance"),
    (ready(6, 6, 5), 3, 5, 4, "ratio 17/15 = 1.133 is outside: ceil(3.4)"),
    (ready(1.5), 1, 1, 2, "fractional targets and values"),
    (ready(14) + unready(1), 2, 5, 3, "scale-up: the unready pod counts as 0 -> ceil(14/5)"),
    (ready(0) + unready(2), 3, 5, 2, "scale-down: unready pods count as at target -> ceil(10/5)"),
    (ready(0, None, None), 3, 5, 2, "failed scrapes count like unready pods"),
    (ready(0), 3, 5, 2, "pods asked for but not created yet count as missing"),
    (ready(4) + unready(3), 4, 5, 4, "filled ratio 19/20 within tolerance: no change"),
    (ready(5) + unready(1), 2, 5, 2, "ratio exactly 1 with missing pods: no change"),
    (unready(3), 3, 5, 3, "no metrics at all: no change (HPA does nothing)"),
    (ready(None, None), 2, 5, 2, "every scrape failed: no change"),
    ([], 0, 5, 0, "nothing to measure"),
])
def test_metric_replicas(samples: list[PodSample], current: int, target: float, expected: int, why: str) -> None:
    assert metric_replicas(samples, current, target) == expected, why


POLICY = AutoscalingSpec(enabled=True, min_replicas=1, max_replicas=4, metric="waiting", target=5,
                         scale_up_stabilization_seconds=0, scale_down_stabilization_seconds=300,
                         interval_seconds=15)


@pytest.mark.parametrize("samples,current,expected,reason", [
    (ready(14), 1, 3, "scaled 1 -> 3: 14 waiting, target 5 per replica"),
    (ready(100), 2, 4, "scaled 2 -> 4: 100 waiting, target 5 per replica (capped at maxReplicas 4)"),
    (ready(0), 1, 1, "holding 1: 0 waiting, target 5 per replica (floored at minReplicas 1)"),
    (ready(0), 7, 4, "scaled 7 -> 4: 0 waiting"),  # maxReplicas lowered under the fleet
    (ready(14) + unready(1), 2, 3, "scaled 2 -> 3: 14 waiting, target 5 per replica; 1 pod(s) not reporting"),
])
def test_decide_clamps_and_explains(samples: list[PodSample], current: int, expected: int, reason: str) -> None:
    d = decide(samples, current, (), POLICY, now=1000.0)
    assert d.replicas == expected
    assert d.reason.startswith(reason)


def test_stabilize_semantics() -> None:
    h = (Recommendation(0, 3), Recommendation(100, 2))
    # Scale-down takes the highest recommendation inside the window.
    assert stabilize(3, 1, h, 200, 0, 300)[0] == 3
    assert stabilize(3, 1, h, 350, 0, 300)[0] == 2
    assert stabilize(3, 1, h, 401, 0, 300)[0] == 1
    # Scale-up takes the lowest recommendation inside its window (0: at once).
    assert stabilize(1, 4, h, 200, 0, 300)[0] == 4
    assert stabilize(1, 4, (Recommendation(195, 1),), 200, 10, 300)[0] == 1
    assert stabilize(1, 4, (Recommendation(185, 1),), 200, 10, 300)[0] == 4
    # History is pruned to the longest window and gains this recommendation.
    _, new = stabilize(3, 1, h, 350, 0, 300)
    assert new == (Recommendation(100, 2), Recommendation(350, 1))


class Fleet:
    """Drives decide() over time like the operator's loop: the Deployment follows
    each decision, every pod is ready and reports an equal share of the queue."""

    def __init__(self, policy: AutoscalingSpec, replicas: int = 1, t0: float = 0.0) -> None:
        self.policy = policy
        self.replicas = replicas
        self.history = seed_history(replicas, t0)
        self.scale_ups: tuple = ()
        self.changes: list[tuple[float, int, int]] = []

    def step(self, t: float, waiting: float) -> int:
        share = waiting / self.replicas if self.replicas else 0.0
        d = decide(ready(*[share] * self.replicas), self.replicas, self.history, self.policy, t,
                   self.scale_ups)
        self.history, self.scale_ups = d.history, d.scale_ups
        self.reason = d.reason
        if d.replicas != self.replicas:
            self.changes.append((t, self.replicas, d.replicas))
            self.replicas = d.replicas
        return self.replicas


def test_scale_up_is_immediate() -> None:
    fleet = Fleet(POLICY)
    assert fleet.step(15, 14) == 3
    assert fleet.changes == [(15, 1, 3)]


def test_scale_up_waits_for_its_window_when_set() -> None:
    slow_up = AutoscalingSpec(**{**POLICY.__dict__, "scale_up_stabilization_seconds": 30})
    fleet = Fleet(slow_up)
    # Up only once every recommendation in the last 30 s (0, 30] says so.
    assert [fleet.step(t, 14) for t in (10, 20, 30)] == [1, 1, 3]
    # A queue that keeps dipping inside the window never scales up.
    fleet = Fleet(slow_up)
    assert [fleet.step(t, w) for t, w in ((10, 14), (20, 14), (25, 0), (40, 14), (50, 14))] == [1] * 5


def test_scale_down_waits_out_its_window() -> None:
    fleet = Fleet(POLICY)
    fleet.step(0, 14)  # 3 replicas, recommendation 3 at t=0
    held = [fleet.step(t, 0) for t in range(15, 300, 15)]
    assert held == [3] * len(held), "no scale-down inside the 300 s window"
    assert fleet.step(300, 0) == 1, "t=0's recommendation left the window (0, 300]"
    assert fleet.changes == [(0, 1, 3), (300, 3, 1)]


def test_scale_down_steps_through_the_window_maximum() -> None:
    fleet = Fleet(POLICY)
    fleet.step(0, 20)   # 4
    fleet.step(100, 9)  # recommends 2
    fleet.step(200, 0)  # recommends 1
    assert fleet.replicas == 4
    assert fleet.step(305, 0) == 2  # t=0's 4 left the window; t=100's 2 is the maximum
    assert fleet.step(405, 0) == 1


def test_flapping_queue_does_not_flap_the_fleet() -> None:
    fleet = Fleet(POLICY)
    for i, t in enumerate(range(0, 1200, 15)):
        fleet.step(t, 14 if i % 2 == 0 else 0)
    assert fleet.changes == [(0, 1, 3)], "one scale-up, then held through the bursts"


def test_jitter_inside_tolerance_does_not_flap() -> None:
    fleet = Fleet(POLICY, replicas=3)
    for i, t in enumerate(range(0, 900, 15)):
        fleet.step(t, (14, 16, 15, 14.5, 15.9)[i % 5])
    assert fleet.changes == []


def test_restart_seeds_history_so_scale_down_still_waits() -> None:
    # A fresh operator finds 3 replicas and an empty queue: it must not drop at once.
    fleet = Fleet(POLICY, replicas=3, t0=0)
    assert fleet.step(15, 0) == 3
    assert fleet.step(301, 0) == 1


def test_scale_up_is_rate_limited_like_the_hpa() -> None:
    """At most max(+100%, +4 pods) per 15 s, counted from the period's start size."""
    big = AutoscalingSpec(**{**POLICY.__dict__, "max_replicas": 40, "min_replicas": 1})
    fleet = Fleet(big)
    target = big.target
    flood = 40 * target * 2                      # wants far more than 40 replicas
    assert fleet.step(0, flood) == 5             # 1 -> 1 + 4
    assert "per 15s" in fleet.reason
    assert fleet.step(10, flood) == 5            # same period: no more
    assert fleet.step(16, flood) == 10           # new period from 5: +100%
    assert fleet.step(32, flood) == 20
    assert fleet.step(48, flood) == 40           # capped by maxReplicas
    assert fleet.step(64, flood) == 40
    # A small step up inside the limit is not marked as limited.
    small = Fleet(big)
    assert small.step(0, 3 * target) == 3 and "per 15s" not in small.reason


def concurrency_sample(name: str, running: float, waiting: float) -> PodSample:
    return PodSample(name, True, running + waiting,
                     {"vllm:num_requests_running": running, "vllm:num_requests_waiting": waiting})


def test_a_busy_fleet_with_an_empty_queue_is_not_shrunk() -> None:
    """Issue 12, finding 6: 4 replicas each running 90 with nothing waiting. The
    waiting-only metric sees 0 and halves the fleet down to 1 after the window; the
    default metric (concurrency) holds it."""
    from pagefleet.operator.spec import parse_spec

    spec = parse_spec({"metadata": {"name": "m"}, "spec": {"model": "m", "engine": {"maxNumSeqs": 96},
                                                           "autoscaling": {"enabled": True}}}).autoscaling
    assert (spec.metric, spec.target) == ("concurrency", 96.0)
    waiting_only = AutoscalingSpec(**{**spec.__dict__, "metric": "waiting", "target": 5})
    busy = [concurrency_sample(f"p{i}", 90, 0) for i in range(4)]
    for policy, expected in ((spec, 4), (waiting_only, 1)):
        history = seed_history(4, 0)
        replicas = 4
        for t in range(15, 600, 15):
            samples = [PodSample(s.pod, True, s.values["vllm:num_requests_waiting"], s.values)
                       if policy.metric == "waiting" else s for s in busy[:replicas]]
            d = decide(samples, replicas, history, policy, float(t))
            history, replicas = d.history, d.replicas
        assert replicas == expected, policy.metric
    # Concurrency still scales out when the replicas' batches overflow.
    overflowing = [concurrency_sample(f"p{i}", 96, 40) for i in range(4)]
    assert decide(overflowing, 4, seed_history(4, 0), spec, 15.0).replicas == 4  # capped at maxReplicas 4
    roomy = AutoscalingSpec(**{**spec.__dict__, "max_replicas": 10})
    assert decide(overflowing, 4, seed_history(4, 0), roomy, 15.0).replicas == 6   # ceil(544 / 96)


def test_history_survives_a_restart_through_the_status() -> None:
    """The new operator reads the windows from status.autoscaler: a scale-down the old
    one had nearly waited out happens on time, not a full window later."""
    from pagefleet.operator import status as st
    from pagefleet.operator.autoscale import history_from_status, history_to_status

    fleet = Fleet(POLICY, t0=1_000_000.0)
    fleet.step(1_000_000.0, 14)                     # 3 replicas
    for t in range(1_000_015, 1_000_300, 15):
        fleet.step(float(t), 0)
    assert fleet.replicas == 3
    saved = {"autoscaler": history_to_status(fleet.history, fleet.scale_ups, st.to_iso)}
    restored, ups = history_from_status(saved, st.from_iso)
    assert restored == fleet.history
    t = 1_000_301.0                                 # the recommendation of 3 left the window
    assert decide(ready(0, 0, 0), 3, restored, POLICY, t, ups).replicas == 1
    # What a restart without the history would do (seed_history): hold 3 for 300 s more.
    assert decide(ready(0, 0, 0), 3, seed_history(3, t - 15), POLICY, t).replicas == 3
    assert history_from_status({}, st.from_iso) is None
    assert history_from_status({"autoscaler": {"recommendations": [{"time": "garbage", "replicas": 1}]}},
                               st.from_iso) is None


def test_the_stored_history_is_refreshed_not_rewritten_every_round() -> None:
    from pagefleet.operator import status as st
    from pagefleet.operator.autoscale import history_to_status, persisted

    h1 = (Recommendation(100.0, 3), Recommendation(110.0, 1))
    old = history_to_status(h1, (), st.to_iso)
    same_values = (Recommendation(100.0, 3), Recommendation(125.0, 1))
    assert persisted(old, same_values, (), 125.0, 30.0, st.to_iso, st.from_iso) == old, "only a time moved"
    assert persisted(old, same_values, (), 141.0, 30.0, st.to_iso, st.from_iso) != old, "refreshed after 30 s"
    changed = (Recommendation(100.0, 3), Recommendation(125.0, 2))
    assert persisted(old, changed, (), 125.0, 30.0, st.to_iso, st.from_iso)["recommendations"][-1]["replicas"] == 2


def test_a_queueing_fleet_below_max_num_seqs_scales_out_after_the_sustain_window() -> None:
    """The review's finding: with the default target (maxNumSeqs 256) a replica whose
    KV cache holds only 60 sequences queued ~200 before concurrency crossed the
    target. Queueing for SATURATION_SUSTAIN_S sizes the fleet at the running count."""
    from pagefleet.operator.autoscale import SATURATION_SUSTAIN_S

    policy = AutoscalingSpec(enabled=True, max_replicas=10, target=256.0)
    kv_bound = [concurrency_sample("p0", 60, 120)]
    first = decide(kv_bound, 1, seed_history(1, 0), policy, 15.0)
    assert first.replicas == 1, first.reason           # not on one sample: a blip must not scale
    assert first.saturated_since == 15.0 and "queueing" in first.reason
    later = decide(kv_bound, 1, first.history, policy, 15.0 + SATURATION_SUSTAIN_S,
                   saturated_since=first.saturated_since)
    assert later.replicas == 3, later.reason           # ceil(180 / 60)
    assert "running 60 each" in later.reason
    # The queue drains: the window starts over.
    drained = decide([concurrency_sample("p0", 60, 0)], 3, later.history, policy, 40.0,
                     saturated_since=later.saturated_since)
    assert drained.saturated_since is None


def test_saturation_capacity_is_read_from_the_queueing_pods_only() -> None:
    """One idle replica behind an uneven router is not a small capacity: the queueing
    pod's 60 running is. 60 + 5 + 10 = 75 at 60 each needs 2, which the fleet has."""
    policy = AutoscalingSpec(enabled=True, max_replicas=10, target=256.0)
    uneven = [concurrency_sample("p0", 60, 5), concurrency_sample("p1", 10, 0)]
    d = decide(uneven, 2, seed_history(2, 0), policy, 30.0, saturated_since=0.0)
    assert d.replicas == 2, d.reason
    # Held requests in the gateway count toward the load at that capacity.
    d = decide(uneven, 2, seed_history(2, 0), policy, 30.0, saturated_since=0.0, extra=60)
    assert d.replicas == 3, d.reason                   # ceil(135 / 60)


def test_saturation_rule_is_only_for_the_concurrency_metric() -> None:
    waiting = AutoscalingSpec(enabled=True, max_replicas=10, metric="waiting", target=500.0)
    s = concurrency_sample("p0", 60, 120)
    sample = PodSample(s.pod, True, 120.0, s.values)
    d = decide([sample], 1, seed_history(1, 0), waiting, 30.0, saturated_since=0.0)
    assert d.replicas == 1 and d.saturated_since is None, d.reason


def _steady_load(load: float, holds: float, replicas: int) -> list[PodSample]:
    """`load` concurrent requests spread evenly over `replicas` that each run `holds`."""
    each = load / replicas
    return [concurrency_sample(f"p{i}", min(holds, each), max(0.0, each - holds))
            for i in range(replicas)]


def test_a_learned_capacity_does_not_flap_the_fleet():
    """The diff review's flap: 300 requests on replicas that hold 60 each. Sized to 5
    by the queueing rule, the fleet then read 300 / 256 -> 2 once the queue drained and
    shrank after the scale-down window, queued again and grew back: 5 -> 2 -> 5 every
    ~375 s. The learned capacity is the target both ways, so it stays at 5."""
    policy = AutoscalingSpec(enabled=True, max_replicas=10, target=256.0)
    replicas, history, since, capacity = 1, seed_history(1, 0), None, None
    sizes = []
    for t in range(15, 2000, 15):
        d = decide(_steady_load(300, 60, replicas), replicas, history, policy, float(t),
                   saturated_since=since, capacity=capacity)
        replicas, history, since, capacity = d.replicas, d.history, d.saturated_since, d.capacity
        sizes.append(replicas)
    assert sizes[-1] == 5 and capacity == 60.0
    first = sizes.index(5)
    assert set(sizes[first:]) == {5}, sizes
    assert "target 60 per replica (learned; 256 configured)" in d.reason


def test_a_learned_capacity_rises_when_a_replica_runs_more_without_a_queue():
    """Measured low (a workload of long requests, then short ones): a replica that runs
    more than the learned capacity with nothing queued shows it holds more, so the
    fleet is not kept oversized at the old figure."""
    policy = AutoscalingSpec(enabled=True, max_replicas=10, target=256.0)
    d = decide(_steady_load(200, 40, 2), 2, seed_history(2, 0), policy, 30.0,
               saturated_since=0.0)
    assert d.capacity == 40.0 and d.replicas == 5                  # ceil(200 / 40)
    # Shorter requests now: the same pods run 70 each with no queue.
    d2 = decide(_steady_load(140, 200, 2), 2, d.history, policy, 45.0,
                saturated_since=d.saturated_since, capacity=d.capacity)
    assert d2.saturated_since is None and d2.capacity == 70.0
    assert d2.recommendation == 2                                    # 140 / 70
