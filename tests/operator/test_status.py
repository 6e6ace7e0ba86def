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


def test_failures_are_degraded_and_stalled_and_keep_the_running_truth() -> None:
    refused = status.Failure("ApplyFailed", "POST services: HTTP 422: invalid name", stalled=True)
    conds = by_type(status.conditions(deployment=dep(2, 2, 2), desired=2, failure=refused, current=False))
    assert conds["Degraded"] == ("True", "ApplyFailed")
    assert conds["Stalled"] == ("True", "ApplyFailed")
    assert conds["Ready"] == ("False", "ApplyFailed")
    assert conds["Available"] == ("True", "MinimumReplicasAvailable"), "the old pods still serve"
    conds = by_type(status.conditions(deployment=None, desired=0,
                                      failure=status.Failure("InvalidSpec", "m", True), current=False))
    assert conds["Available"] == ("False", "InvalidSpec") and conds["Stalled"] == ("True", "InvalidSpec")
    # A transient failure (conflict, throttling) is Reconciling, not Stalled.
    retry = status.Failure("ApplyFailed", "HTTP 409", stalled=False)
    conds = by_type(status.conditions(deployment=dep(1, 1, 1), desired=1, failure=retry, current=False))
    assert conds["Reconciling"] == ("True", "Retrying") and conds["Stalled"][0] == "False"


@pytest.mark.parametrize("deployment,desired,current,ready,reconciling,stalled", [
    (dep(2, 2, 2), 2, True, ("True", "Ready"), ("False", "AsExpected"), ("False", "AsExpected")),
    (dep(2, 2, 2), 2, False, ("False", "Applying"), ("True", "Applying"), ("False", "AsExpected")),
    (dep(2, 1, 2), 2, True, ("False", "RolloutInProgress"), ("True", "RolloutInProgress"),
     ("False", "AsExpected")),
    (dep(2, 1, 1, stalled=True), 2, True, ("False", "ProgressDeadlineExceeded"), ("False", "AsExpected"),
     ("True", "ProgressDeadlineExceeded")),
    (dep(0, 0, 0), 0, True, ("True", "Ready"), ("False", "AsExpected"), ("False", "AsExpected")),
])
def test_kstatus_conditions(deployment: dict[str, Any], desired: int, current: bool, ready: tuple[str, str],
                            reconciling: tuple[str, str], stalled: tuple[str, str]) -> None:
    """Ready/Reconciling/Stalled as Flux's kstatus reads them."""
    conds = by_type(status.conditions(deployment=deployment, desired=desired, failure=None, current=current))
    assert (conds["Ready"], conds["Reconciling"], conds["Stalled"]) == (ready, reconciling, stalled)


def test_transition_time_changes_only_on_flips() -> None:
    first = status.merge_conditions(None, [status.condition("Available", False, "R", "")], "t1", 3)
    assert first == [{"type": "Available", "status": "False", "reason": "R", "message": "",
                      "lastTransitionTime": "t1", "observedGeneration": 3}]
    same = status.merge_conditions(first, [status.condition("Available", False, "R2", "x")], "t2", None)
    assert same[0]["lastTransitionTime"] == "t1" and "observedGeneration" not in same[0]
    flipped = status.merge_conditions(same, [status.condition("Available", True, "R", "")], "t3", None)
    assert flipped[0]["lastTransitionTime"] == "t3"


def test_build_status_fields() -> None:
    old = {"lastScaleTime": "t0", "waitingRequests": 9, "endpoint": "e", "observedGeneration": 3,
           "conditions": [status.condition("MetricsAvailable", True, "MetricsReported", "")]}
    new = status.build_status(old=old, generation=4, deployment=dep(3, 2, 3), now="t1",
                              conditions=[status.condition("Available", True, "R", "")],
                              desiredReplicas=3, waitingRequests=14.0, runningRequests=status.UNSET)
    assert new["replicas"] == 3 and new["readyReplicas"] == 2 and new["desiredReplicas"] == 3
    assert new["waitingRequests"] == 14 and isinstance(new["waitingRequests"], int)
    assert (new["endpoint"], new["lastScaleTime"]) == ("e", "t0"), "fields not given keep their value"
    assert new["observedGeneration"] == 3, "only the caller that applied generation 4 may say so"
    assert [c["type"] for c in new["conditions"]] == ["Available", "MetricsAvailable"], "others' conditions kept"
    gone = status.build_status(old=new, generation=None, now="t2", conditions=[], waitingRequests=status.UNSET)
    assert "waitingRequests" not in gone, "an unknown value is dropped, not left stale"
    assert status.status_patch(new, gone)["waitingRequests"] is None


def test_same_status_ignores_only_timestamps() -> None:
    a = {"replicas": 1, "conditions": [{"type": "A", "status": "True", "lastTransitionTime": "t1"}]}
    b = {"replicas": 1, "conditions": [{"type": "A", "status": "True", "lastTransitionTime": "t2"}]}
    assert status.same_status(a, b)
    assert not status.same_status(a, {**b, "replicas": 2})
    assert not status.same_status(None, b)


def test_status_patch_nulls_nested_keys_that_went_away() -> None:
    old = {"oomRemediation": {"specHash": "a", "gpuMemoryUtilization": 0.85}, "waitingRequests": 3}
    new = {"oomRemediation": {"specHash": "b"}}
    assert status.status_patch(old, new) == {"oomRemediation": {"specHash": "b", "gpuMemoryUtilization": None},
                                             "waitingRequests": None}


def test_a_condition_that_no_longer_applies_is_dropped() -> None:
    old = {"conditions": [status.condition("CacheShared", False, "SingleNodeAccessMode", "")]}
    new = status.build_status(old=old, generation=None, now="t", conditions=[], drop=("CacheShared",))
    assert new["conditions"] == []
