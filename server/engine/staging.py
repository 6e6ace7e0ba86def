"""Per-step host->device staging: every small input of a step in one copy per dtype.

A step needs a dozen small arrays on the device (input ids, positions, slot mapping,
row metadata, block-table updates, sampler rows and parameter updates). Copying each
from pageable memory would make every copy wait for the device to catch up (a
pageable host->device copy synchronises the stream), which is what kept mixed
prefill+decode steps out of the async pipeline. Instead the host packs them into a
pinned buffer (one per dtype) and issues one non-blocking copy each; views into the
device buffer are handed to the step's kernels.

The pinned buffers are double-buffered: packing step N+1 never waits for step N's copy
(only for step N-1's, which the device finished long ago). The device buffer is
single: copies and kernels are on one stream, so step N+1's copy runs after step N's
kernels have read theirs.
"""

from __future__ import annotations

import numpy as np
import torch

_DTYPES = {"i64": (torch.int64, np.int64), "f32": (torch.float32, np.float32)}


class _Lane:
    """One dtype: two pinned host buffers and one device buffer that grow on demand."""

    def __init__(self, kind: str, device: torch.device, capacity: int) -> None:
        self.torch_dtype, self.np_dtype = _DTYPES[kind]
        self.device = device
        self.pin = device.type == "cuda"
        self.capacity = 0
        self.used = 0
        self.which = 0
        self._grow(max(capacity, 1024))

    def _grow(self, capacity: int) -> None:
        # Called between steps only (never while a copy of the old buffers is queued
        # without an event having been waited on, see Staging.begin).
        self.capacity = capacity
        self.host = [torch.empty(capacity, dtype=self.torch_dtype, pin_memory=self.pin)
                     for _ in range(2)]
        self.host_np = [h.numpy() for h in self.host]
        self.dev = torch.empty(capacity, dtype=self.torch_dtype, device=self.device) \
            if self.device.type != "cpu" else None

    def reserve(self, n: int) -> np.ndarray:
        start = self.used
        self.used += n
        if self.used > self.capacity:
            raise _Overflow(self, self.used)
        return self.host_np[self.which][start:self.used]

    def view(self, start: int, n: int) -> torch.Tensor:
        if self.dev is None:   # CPU: the host buffer is the device buffer
            return self.host[self.which][start:start + n]
        return self.dev[start:start + n]


class _Overflow(Exception):
    def __init__(self, lane: _Lane, need: int) -> None:
        self.lane, self.need = lane, need


class Staging:
    """Pack named arrays for one step, then `commit()` them to the device.

    Usage per step: `begin()`, `put(...)`/`reserve(...)` for each array (each returns
    a handle), `commit()`, then `get(handle)` for the device tensors. If a lane
    overflows, `put` raises `StagingOverflow`; call `begin()` again after `grow()`.
    """

    def __init__(self, device: torch.device, capacity_i64: int = 1 << 16,
                 capacity_f32: int = 1 << 12) -> None:
        self.device = device
        self.lanes = {"i64": _Lane("i64", device, capacity_i64),
                      "f32": _Lane("f32", device, capacity_f32)}
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._which = 0
        self._spans: list[tuple[str, int, tuple[int, ...]]] = []

    def begin(self) -> None:
        """Start packing a step into the pinned buffer whose last copy is done."""
        self._which ^= 1
        ev = self._events[self._which]
        if ev is not None:
            ev.synchronize()   # the copy issued two steps ago (long finished in practice)
        for lane in self.lanes.values():
            lane.which = self._which
            lane.used = 0
        self._spans = []

    def reserve(self, kind: str, *shape: int) -> tuple[int, np.ndarray]:
        """A writable host array of `shape`; returns (handle, array)."""
        lane = self.lanes[kind]
        n = int(np.prod(shape)) if shape else 1
        start = lane.used
        arr = lane.reserve(n).reshape(shape)
        self._spans.append((kind, start, tuple(shape)))
        return len(self._spans) - 1, arr

    def put(self, kind: str, values, *shape: int) -> int:
        shape = shape or (len(values),)
        handle, arr = self.reserve(kind, *shape)
        if arr.size:
            arr[...] = values if not isinstance(values, list) else np.asarray(values).reshape(shape)
        return handle

    def grow(self, exc: "StagingOverflow") -> None:
        lane = exc.lane
        # Both pinned buffers may hold queued copies: wait for them before replacing.
        for ev in self._events:
            if ev is not None:
                ev.synchronize()
        lane._grow(max(exc.need * 2, lane.capacity * 2))

    def commit(self) -> None:
        for lane in self.lanes.values():
            if lane.dev is not None and lane.used:
                lane.dev[:lane.used].copy_(lane.host[self._which][:lane.used], non_blocking=True)
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._events[self._which] = ev

    def get(self, handle: int) -> torch.Tensor:
        kind, start, shape = self._spans[handle]
        n = int(np.prod(shape)) if shape else 1
        return self.lanes[kind].view(start, n).view(shape)

    # -- tensor parallelism: other ranks execute the same step from a copy ---------------
    def host(self, handle: int) -> np.ndarray:
        """The packed host array of a handle (rank 0 reads step facts from it)."""
        kind, start, shape = self._spans[handle]
        n = int(np.prod(shape)) if shape else 1
        lane = self.lanes[kind]
        return lane.host_np[lane.which][start:start + n].reshape(shape)

    def layout(self) -> list[tuple[str, int, tuple[int, ...]]]:
        """The spans packed so far this step (what `load_layout` recreates)."""
        return list(self._spans)

    def used(self, kind: str) -> int:
        return self.lanes[kind].used

    def region(self, kind: str, n: int) -> torch.Tensor:
        """The first `n` elements of a lane where the step's kernels read them (the
        device buffer; on the CPU the current host buffer)."""
        return self.lanes[kind].view(0, n)

    def load_layout(self, spans: list, used: dict[str, int]) -> None:
        """Adopt another rank's layout for this step (after `begin()`); the data comes
        into `region()` by a broadcast, so `get()` then returns the same arrays."""
        for kind, n in used.items():
            lane = self.lanes[kind]
            if n > lane.capacity:
                lane._grow(max(n, lane.capacity * 2))
            lane.used = n
        self._spans = [(kind, start, tuple(shape)) for kind, start, shape in spans]


StagingOverflow = _Overflow
