"""Say so when Triton compiles a kernel while the engine serves.

A compile inside a step holds every running stream for its duration (0.3-0.7 s for
an attention kernel on an H200). The warm-up (`engine/warmup.py`) is meant to leave
none for serving; this watch is how a deployment, or the next benchmark run, sees
whether it did: after `mark_ready()` each compile is logged as a warning with its
kernel and time, and counted (`compiles_while_serving()`).

It uses Triton's own compile hooks (`triton.knobs.runtime.jit_cache_hook`, called
before a compile, and `jit_post_compile_hook`, after), so cached launches cost
nothing. Hooks someone else installed are kept and called too.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("pagefleet.engine")

_state: dict[str, Any] = {"installed": False, "ready": False, "count": 0, "seconds": 0.0,
                          "start": None, "prev_before": None, "prev_after": None}


def _before(**kw: Any) -> bool:
    _state["start"] = time.perf_counter()
    prev = _state["prev_before"]
    return bool(prev(**kw)) if prev is not None else False   # truthy would skip the compile


def _after(**kw: Any) -> None:
    start, _state["start"] = _state["start"], None
    took = time.perf_counter() - start if start is not None else 0.0
    if _state["ready"]:
        _state["count"] += 1
        _state["seconds"] += took
        fn = kw.get("fn")
        name = getattr(fn, "name", None) or str(kw.get("repr", "?")).split("[", 1)[0]
        log.warning("Triton compiled %s while serving (%.2f s, running requests waited): a "
                    "kernel variant the warm-up did not reach", name, took)
    prev = _state["prev_after"]
    if prev is not None:
        prev(**kw)


def install() -> bool:
    """Hook into Triton's compiles (once per process); False where Triton is absent."""
    if _state["installed"]:
        return True
    try:
        from triton import knobs
    except ImportError:   # pragma: no cover - triton-less CPU installs
        return False
    rt = knobs.runtime
    _state["prev_before"], _state["prev_after"] = rt.jit_cache_hook, rt.jit_post_compile_hook
    rt.jit_cache_hook, rt.jit_post_compile_hook = _before, _after
    _state["installed"] = True
    return True


def mark_starting() -> None:
    """An engine is starting in this process (graph capture, warm-up): its compiles are
    the point of the warm-up, not stalls, even when an engine before it was ready."""
    _state["ready"] = False


def mark_ready() -> None:
    """From here on a compile is one that a user's step paid for."""
    _state["ready"] = True


def compiles_while_serving() -> tuple[int, float]:
    """(compiles after `mark_ready`, their seconds)."""
    return _state["count"], _state["seconds"]
