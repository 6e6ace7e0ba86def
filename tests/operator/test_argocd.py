"""The Argo CD health check shipped in charts/pagefleet/argocd/health.lua, run with a
real Lua (lupa) on statuses the operator's own code produces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagefleet.operator import status

LUA = Path(__file__).resolve().parents[2] / "charts" / "pagefleet" / "argocd" / "health.lua"


def argocd_health(obj: dict[str, Any]) -> dict[str, str]:
    """Run the script the way Argo CD does: a global `obj`, the script's return value."""
    import lupa

    lua = lupa.LuaRuntime(unpack_returned_tuples=True)

    def to_lua(v: Any) -> Any:
        if isinstance(v, dict):
            return lua.table_from({k: to_lua(x) for k, x in v.items()})
        if isinstance(v, list):
            return lua.table_from([to_lua(x) for x in v])
        return v
    lua.globals().obj = to_lua(obj)
    result = lua.execute(LUA.read_text())
    return {"status": result["status"], "message": result["message"]}


def dep(replicas: int, ready: int, updated: int) -> dict[str, Any]:
    return {"spec": {"replicas": replicas},
            "status": {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated}}


def mdep(generation: int, observed: int | None, conds: list[dict[str, Any]]) -> dict[str, Any]:
    st = status.build_status(old=None, conditions=conds, generation=generation, now="2026-01-01T00:00:00Z",
                             observedGeneration=observed)
    return {"metadata": {"name": "m", "generation": generation}, "status": st}


CASES = [
    ("rolled out", mdep(2, 2, status.conditions(deployment=dep(2, 2, 2), desired=2, failure=None, current=True)),
     "Healthy"),
    ("rolling", mdep(2, 2, status.conditions(deployment=dep(2, 1, 1), desired=2, failure=None, current=True)),
     "Progressing"),
    ("new generation not applied yet", mdep(3, 2, status.conditions(deployment=dep(2, 2, 2), desired=2,
                                                                     failure=None, current=False)), "Progressing"),
    ("child refused", mdep(3, 2, status.conditions(
        deployment=dep(2, 2, 2), desired=2, failure=status.Failure("ApplyFailed", "HTTP 422: bad", True),
        current=False)), "Degraded"),
    ("invalid spec", mdep(1, None, status.conditions(
        deployment=None, desired=0, failure=status.Failure("InvalidSpec", "spec.model: is required", True),
        current=False)), "Degraded"),
    ("transient error", mdep(2, 1, status.conditions(
        deployment=dep(1, 1, 1), desired=1, failure=status.Failure("ApplyFailed", "HTTP 409", False),
        current=False)), "Degraded"),
    ("no status yet", {"metadata": {"name": "m", "generation": 1}}, "Progressing"),
]


@pytest.mark.parametrize("what,obj,health", CASES, ids=[c[0] for c in CASES])
def test_health_of_real_statuses(what: str, obj: dict[str, Any], health: str) -> None:
    got = argocd_health(obj)
    assert got["status"] == health, (what, got)
    assert got["message"]


def test_stalled_message_is_the_api_servers() -> None:
    obj = CASES[3][1]
    assert argocd_health(obj)["message"] == "HTTP 422: bad"
