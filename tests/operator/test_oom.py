"""OOM remediation, pure: which terminations count, when the utilization steps down,
the floor, the reset on a spec change."""

from __future__ import annotations

from typing import Any

from pagefleet.operator import oom, status
from pagefleet.operator.spec import OOMSpec
from pagefleet.server.config import CUDA_OOM_EXIT_CODE

POLICY = OOMSpec(enabled=True, max_ooms=3, window_seconds=600, step=0.05, floor=0.8)
T0 = 2_000_000_000.0


def pod(name: str, exit_code: int | None = None, reason: str = "Error", at: float = T0,
        container: str = "server") -> dict[str, Any]:
    cs: dict[str, Any] = {"name": container, "restartCount": 1, "state": {"running": {}}}
    if exit_code is not None:
        cs["lastState"] = {"terminated": {"exitCode": exit_code, "reason": reason, "finishedAt": status.to_iso(at)}}
    return {"metadata": {"name": name}, "status": {"containerStatuses": [cs]}}


def exits(*pods: dict[str, Any]) -> list[oom.OOMExit]:
    return oom.oom_exits(list(pods), "server", status.from_iso)


def test_what_counts_as_an_oom() -> None:
    found = exits(pod("a", CUDA_OOM_EXIT_CODE), pod("b", 137, "OOMKilled"), pod("c", 1), pod("d"),
                  pod("e", CUDA_OOM_EXIT_CODE, container="sidecar"))
    assert [(e.pod, e.reason) for e in found] == [("a", oom.CUDA_OOM), ("b", oom.OOM_KILLED)]


def test_steps_down_after_max_ooms_in_the_window_to_the_floor() -> None:
    state = oom.OOMState(spec_hash="h")
    # Two OOMs: counted, nothing changes.
    r = oom.step(state, exits(pod("a", CUDA_OOM_EXIT_CODE, at=T0), pod("b", CUDA_OOM_EXIT_CODE, at=T0 + 5)),
                 POLICY, 0.9, T0 + 10)
    assert r.lowered is None and len(r.state.ooms) == 2
    # The same terminations seen again are not counted twice.
    r = oom.step(r.state, exits(pod("a", CUDA_OOM_EXIT_CODE, at=T0)), POLICY, 0.9, T0 + 20)
    assert len(r.state.ooms) == 2
    # A third one: 0.9 -> 0.85, the count starts over at the new level.
    r = oom.step(r.state, exits(pod("a", CUDA_OOM_EXIT_CODE, at=T0 + 30)), POLICY, 0.9, T0 + 40)
    assert r.lowered == (0.9, 0.85) and r.state.gpu_memory_utilization == 0.85 and r.state.ooms == ()
    # OOMs from before the step (old pods) do not count again.
    r = oom.step(r.state, exits(pod("b", CUDA_OOM_EXIT_CODE, at=T0 + 35)), POLICY, 0.9, T0 + 50)
    assert r.state.ooms == ()
    more = [pod(f"p{i}", CUDA_OOM_EXIT_CODE, at=T0 + 60 + i) for i in range(3)]
    r = oom.step(r.state, exits(*more), POLICY, 0.9, T0 + 70)
    assert r.lowered == (0.85, 0.8)
    later = [pod(f"q{i}", CUDA_OOM_EXIT_CODE, at=T0 + 100 + i) for i in range(3)]
    r = oom.step(r.state, exits(*later), POLICY, 0.9, T0 + 110)
    assert r.lowered is None and r.at_floor and r.state.gpu_memory_utilization == 0.8


def test_old_ooms_leave_the_window() -> None:
    state = oom.OOMState(spec_hash="h")
    r = oom.step(state, exits(pod("a", CUDA_OOM_EXIT_CODE, at=T0), pod("b", CUDA_OOM_EXIT_CODE, at=T0 + 1)),
                 POLICY, 0.9, T0 + 2)
    r = oom.step(r.state, exits(pod("c", CUDA_OOM_EXIT_CODE, at=T0 + 700)), POLICY, 0.9, T0 + 701)
    assert r.lowered is None and [e.pod for e in r.state.ooms] == ["c"]


def test_status_round_trip_and_reset_on_spec_change() -> None:
    state = oom.OOMState(spec_hash="h1", gpu_memory_utilization=0.85,
                         ooms=(oom.OOMExit("a", T0, oom.CUDA_OOM),), last_remediation=T0 - 10)
    st = {"oomRemediation": oom.to_status(state, status.to_iso)}
    assert oom.from_status(st, "h1", status.from_iso) == state
    assert oom.from_status(st, "h2", status.from_iso) == oom.OOMState(spec_hash="h2"), "a spec change resets it"


def test_disabled_counts_nothing() -> None:
    off = OOMSpec(enabled=False)
    r = oom.step(oom.OOMState("h"), exits(*[pod(f"p{i}", CUDA_OOM_EXIT_CODE) for i in range(5)]), off, 0.9, T0 + 1)
    assert r.lowered is None and r.state.ooms == ()
