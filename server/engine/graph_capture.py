"""CUDA graph capture without `torch.cuda.graph`'s per-capture cost.

`torch.cuda.graph` runs `gc.collect()` and `torch.cuda.empty_cache()` on every entry:
~30-80 ms each in a serving process (99 decode graphs took 11.5 s on an H200 for
`--max-num-seqs 1024`). The runner captures hundreds of graphs (decode batches, and
the pieces of mixed steps, piecewise.py), all into one memory pool, so it does the
capture itself: one side stream, warmed up on that stream first (cuBLAS sets up a
workspace per stream on first use, which must not happen inside a capture), then
`capture_begin`/`capture_end` per graph.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import Any, Iterator

import torch


@contextmanager
def capture_stream() -> Iterator[torch.cuda.Stream]:
    """A side stream for warm-up runs and captures, made current; it starts after
    everything queued so far and the caller's stream waits for it at the end."""
    caller = torch.cuda.current_stream()
    stream = torch.cuda.Stream()
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        yield stream
    caller.wait_stream(stream)


def capture(fn: Callable[[], Any], pool) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture `fn()` on the current (side) stream into `pool`: (graph, fn's result,
    whose tensors the graph writes on every replay)."""
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(pool=pool)
    try:
        out = fn()
    finally:
        graph.capture_end()
    return graph, out
