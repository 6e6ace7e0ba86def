"""Pure status computation: conditions from the Deployment, and field bookkeeping."""

from __future__ import annotations

from typing import Any

import pytest

from pagefleet.operator import status


def dep(replicas: int = 0, ready: int = 0, updated: int = 0, stalled: bool = False) -> dict[str, Any]:
    st: dict[str, Any] = {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated}
    if stalled:
        st["conditions"] = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                             "message": 'ReplicaSet "x" has timed out progressing.'}]
    return {"spec": {"replicas": replicas}, "status": st}


def by_type(conds: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in conds}


@pytest.mark.parametrize("deployment,desired,expected", [
    (None, 1, {"Available": ("False", "DeploymentMissing"), "Progressing": ("True", "Creating"),
               "Degraded": ("False", "AsExpected")}),
    (dep(1, 0, 1), 1, {"Available": ("False", "NoReplicasReady"), "Progressing": ("True", "RolloutInProgress"),
                       "Degraded": ("False", "AsExpected")}),
    (dep(2, 2, 2), 2, {"Available": ("True", "MinimumReplicasAvailable"),
                       "Progressing": ("False", "RolloutComplete"), "Degraded": ("False", "AsExpected")}),
    (dep(2, 2, 2), 3, {"Available": ("True", "MinimumReplicasAvailable"),
                       "Progressing": ("True", "RolloutInProgress"), "Degraded": ("False", "AsExpected")}),
    (dep(3, 2, 1), 2, {"Available": ("True", "MinimumReplicasAvailable"),     # surge pod of a rollout
                       "Progressing": ("True", "RolloutInProgress"), "Degraded": ("False", "AsExpected")}),
    (dep(2, 1, 1, stalled=True), 2, {"Available": ("True", "MinimumReplicasAvailable"),
                                     "Progressing": ("True", "RolloutInProgress"),
                                     "Degraded": ("True", "ProgressDeadlineExceeded")}),
])
def test_deployment_conditions(deployment: dict[str, Any] | None, desired: int,
                               expected: dict[str, tuple[str, str]]) -> None:
    assert by_type(status.deployment_conditions(deployment, desired)) == expected


def test_error_conditions_keep_the_running_truth() -> None:
    conds = by_type(status.error_conditions("InvalidSpec", "spec.model: is required", dep(2, 2, 2), 2))
    assert conds["Degraded"] == ("True", "InvalidSpec")
    assert conds["Available"] == ("True", "MinimumReplicasAvailable")
    conds = by_type(status.error_conditions("InvalidSpec", "m", None, 0))
    assert conds == {"Available": ("False", "InvalidSpec"), "Progressing": ("False", "InvalidSpec"),
                     "Degraded": ("True", "InvalidSpec")}


def test_transition_time_changes_only_on_flips() -> None:
    first = status.merge_conditions(None, [status.condition("Available", False, "R", "")], "t1", 3)
    assert first == [{"type": "Available", "status": "False", "reason": "R", "message": "",
                      "lastTransitionTime": "t1", "observedGeneration": 3}]
    same = status.merge_conditions(first, [status.condition("Available", False, "R2", "x")], "t2", None)
    assert same[0]["lastTransitionTime"] == "t1" and "observedGeneration" not in same[0]
    flipped = status.merge_conditions(same, [status.condition("Available", True, "R", "")], "t3", None)
    assert flipped[0]["lastTransitionTime"] == "t3"


def test_build_status_fields() -> None:
    new = status.build_status(old={"lastScaleTime": "t0", "waitingRequests": 9, "endpoint": "e"},
                              generation=None, deployment=dep(3, 2, 3), desired=3, waiting=14.0,
                              selector="a=b", endpoint=None, last_scale_time=None,
                              conditions=[status.condition("Available", True, "R", "")], now="t1")
    assert new["replicas"] == 3 and new["readyReplicas"] == 2 and new["desiredReplicas"] == 3
    assert new["waitingRequests"] == 14 and isinstance(new["waitingRequests"], int)
    assert (new["selector"], new["endpoint"], new["lastScaleTime"]) == ("a=b", "e", "t0"), "unknowns keep old values"
    assert "observedGeneration" not in new
    with_gen = status.build_status(old=None, generation=4, deployment=None, desired=None, waiting=2.5,
                                   selector=None, endpoint=None, last_scale_time=None, conditions=[], now="t")
    assert with_gen["observedGeneration"] == 4 and with_gen["waitingRequests"] == 2.5
    assert with_gen["replicas"] == 0 and "desiredReplicas" not in with_gen


def test_same_status_ignores_only_timestamps() -> None:
    a = {"replicas": 1, "conditions": [{"type": "A", "status": "True", "lastTransitionTime": "t1"}]}
    b = {"replicas": 1, "conditions": [{"type": "A", "status": "True", "lastTransitionTime": "t2"}]}
    assert status.same_status(a, b)
    assert not status.same_status(a, {**b, "replicas": 2})
    assert not status.same_status(None, b)
