"""Fault injection for the isolation tests: make one request fail at one stage.

Off unless `PAGEFLEET_FAULTS` is set (or a test calls `configure`), and then the
cost on the step path is one bool test per stage. The spec is a comma-separated list
of `stage:marker` pairs; a request whose id contains `marker` raises
`InjectedFault` when it reaches `stage` (`add`, `prepare`, `finish`: isolated, the
request alone fails). `fatal:marker` raises outside any request's isolation when such
a request is launched: an error no request can be blamed for, which stops the engine.
`stall:marker` holds the engine for PAGEFLEET_FAULT_STALL_SECONDS (a long step).
"""

from __future__ import annotations

import os


class InjectedFault(RuntimeError):
    pass


_rules: dict[str, tuple[str, ...]] = {}
active = False


def configure(spec: str | None) -> None:
    global active
    _rules.clear()
    for part in (spec or "").split(","):
        stage, _, marker = part.strip().partition(":")
        if stage and marker:
            _rules[stage] = _rules.get(stage, ()) + (marker,)
    active = bool(_rules)


def check(stage: str, request_id: str) -> None:
    if not active:
        return
    for marker in _rules.get(stage, ()):
        if marker in request_id:
            raise InjectedFault(f"injected fault at {stage}")


def check_stall(request_ids) -> None:
    """Hold the engine for `stall_seconds` when a `stall` request is launched (tests of
    what the API process shows while the engine is busy in a long step)."""
    if not active:
        return
    for marker in _rules.get("stall", ()):
        if any(marker in rid for rid in request_ids):
            import time

            time.sleep(float(os.environ.get("PAGEFLEET_FAULT_STALL_SECONDS", "3")))
            return


def check_fatal(request_ids) -> None:
    """An engine-wide fault when any of these requests carries a `fatal` marker."""
    if not active:
        return
    for marker in _rules.get("fatal", ()):
        if any(marker in rid for rid in request_ids):
            raise InjectedFault("injected engine fault")


configure(os.environ.get("PAGEFLEET_FAULTS"))
