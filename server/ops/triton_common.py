"""What the Triton kernel modules share: the interpreter switch, the device's
multiprocessor count (launch sizing), and the dot product every GEMM-like kernel uses."""

from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

# Triton's CPU interpreter (TRITON_INTERPRET=1, the CI path) computes bf16 `tl.dot`
# wrongly: there the dot operands are upcast to float32 first (after the same rounding
# the GPU path does), which leaves the tested function unchanged.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# a * b + c as one FMA: Triton's default through 3.9, which warns that 3.10 will stop
# fusing unless asked. Every kernel here was timed and parity-checked against HF with
# fusion on (e.g. the attention kernels' scale rides in the exponent's FMA), so a Triton
# upgrade must not change the arithmetic silently. An explicit setting still wins.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (looked up once per device)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


@triton.jit
def dot(a, b, F32: tl.constexpr):
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")   # float32 models: no tf32 rounding
    else:
        return tl.dot(a, b)


# -- programmatic dependent launch (PDL) ------------------------------------------------------
# A decode step at batch 1 is ~300 small kernels, and each one's launch waits for the one
# before it to retire: a few microseconds per boundary that no kernel does any work in.
# With PDL (Hopper and later) a kernel is launched while its predecessor's last blocks
# are still running; it then waits in `pdl_wait` (griddepcontrol.wait) until that
# predecessor has finished and its writes are visible. Every kernel launched with
# `launch_opts()` calls `pdl_wait(PDL)` before it reads anything a kernel of the forward
# writes, so it computes exactly what a plainly launched kernel does; what it reads
# before the wait is only what no such kernel writes (weights; a module's EARLY_READS:
# step inputs, constant tables, cached keys; tests/server/test_pdl.py checks both).
# PAGEFLEET_PDL: "early" (default): each kernel also lets its own successor launch right
# after its wait (griddepcontrol.launch_dependents) instead of as its blocks exit, so the
# successor's blocks are resident and waiting when it finishes (the CUTLASS pattern; H200,
# 2026-12-02: B=1 decode step 4.51 ms bf16 / 2.89 ms fp8, against 4.56 / 3.02 with "1"
# and 4.59 / 3.07 with "0"), and the roles in EAGER_OPS release it before their wait;
# "eager": every kernel releases it before its wait (slower, below); "1": the wait only,
# successors launch as blocks exit; "0": off. The interpreter and GPUs before Hopper
# never use it.
PDL_OFF, PDL_WAIT, PDL_EARLY, PDL_EAGER = 0, 1, 2, 3
_PDL: int | None = None


def pdl() -> int:
    """The PDL mode of this process (PDL_OFF / PDL_WAIT / PDL_EARLY): decided once, at the
    first launch (not at import: the API process imports this module and must not touch
    CUDA)."""
    global _PDL
    if _PDL is None:
        env = os.environ.get("PAGEFLEET_PDL", "early").strip().lower()
        mode = {"0": PDL_OFF, "1": PDL_WAIT, "early": PDL_EARLY, "eager": PDL_EAGER}.get(env)
        if mode is None:
            raise ValueError(f"PAGEFLEET_PDL={env!r}: expected 0, 1, early or eager")
        if mode and INTERPRET:
            mode = PDL_OFF
        why = f"PAGEFLEET_PDL={env}"
        if mode:
            try:
                from triton.language.extra.cuda import gdc_wait  # noqa: F401
                if not torch.cuda.is_available():
                    mode, why = PDL_OFF, "no CUDA device"
                elif torch.cuda.get_device_capability()[0] < 9:
                    mode, why = PDL_OFF, "a GPU before Hopper"
                elif (driver := _driver_version()) < 12030:
                    mode, why = PDL_OFF, f"CUDA driver {driver} < 12030"
            except ImportError:
                mode, why = PDL_OFF, f"Triton {triton.__version__} has no grid dependency control"
        if not INTERPRET and torch.cuda.is_available():
            logging.getLogger("pagefleet.engine").info(
                "Kernel launches: programmatic dependent launch %s (%s)",
                {PDL_OFF: "off", PDL_WAIT: "on", PDL_EARLY: "on, early release",
                 PDL_EAGER: "on, release before the wait"}[mode], why)
        _PDL = mode
    return _PDL


def _driver_version() -> int:
    """The CUDA driver's version (12030 for 12.3), 0 if it cannot be read. PDL launches
    captured into CUDA graphs need a 12.3 driver; an older one keeps plain launches."""
    import ctypes
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int(0)
        return v.value if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 else 0
    except (OSError, AttributeError):
        return 0


# Kernel roles ("rmsnorm", "rotary", "attention", "merge", "gemv", "silu"; a role
# "@tag" while `OP_TAG` is tag) whose kernels, in the early mode, release their successor
# before their own wait (PDL_EAGER): the kernel after them is resident, and doing what
# does not depend on them (the decode attention's step inputs and cached keys, the
# merge's context lengths, a GEMV's first weights), a kernel sooner. Eager release only
# ever lets a successor *start*: its own wait still returns only when this kernel (and
# so, transitively, every kernel before it) has finished. Default: the rotary + KV
# write, the decode attention and its merge. H200, AWQ Qwen2.5-7B decode forward at
# B=1, 1K context (engine_gemv_ab.py, 2026-12-04, seventeenth session): 1.564 against
# 1.616 ms with none (the attention's own time 100 against 135 us a step); eager
# everywhere (PAGEFLEET_PDL=eager) 1.68 against 1.65, the norm before gate_up 1.667:
# a GEMV's weight stream launched early competes with the one before it.
# A role ":1" (e.g. "rmsnorm:1") is released early only by its launches over one row: the
# B=1 decode step's. Since one-row GEMV sums are deferred to their readers (ops/deferred.py)
# and the deferred norm runs 16 warps, the norms and the Gluon GEMVs at one row released
# early too: H100, AWQ Qwen2.5-7B decode forward at B=1 (engine_gemv_ab.py, twenty-eighth
# session, 2026-12-05), 1.674 ms (rounds 1.669-1.675) against 1.713 without either, 1.703
# with the norms alone and 1.714 with the GEMVs alone; gate_up 786 -> 675 us a step (its
# weight stream starts under the norm before it). Same tokens, same output as without
# (engine_gemv_ab's output_off_reference equal). Other batch sizes keep their launches:
# the all-eager mode had B=8 slower (above), and they were not re-measured.
# PAGEFLEET_PDL_EAGER: a comma list instead ("" for none).
ROLES = ("rmsnorm", "rotary", "attention", "merge", "gemv", "silu")


def _eager_ops(env: str) -> set[str]:
    ops = {o.strip() for o in env.split(",") if o.strip()}
    bad = sorted(o for o in ops if o.split("@")[0].removesuffix(":1") not in ROLES)
    if bad:
        raise ValueError(f"PAGEFLEET_PDL_EAGER={env!r}: unknown kernel roles {bad}; "
                         f"expected a comma list of {', '.join(ROLES)} (each may end "
                         f"in :1, for its one-row launches only)")
    return ops


EAGER_OPS: set[str] = _eager_ops(os.environ.get("PAGEFLEET_PDL_EAGER",
                                                "rotary,attention,merge,rmsnorm:1,gemv:1"))
OP_TAG = ""


def launch_opts(op: str = "", one_row: bool = False) -> dict:
    """Keyword arguments for a launch of a kernel that takes `PDL: tl.constexpr` and
    starts with `pdl_wait(PDL)`; `op`: its role (see EAGER_OPS); `one_row`: the launch
    is over one row (a role ":1" in EAGER_OPS applies)."""
    mode = pdl()
    if mode == PDL_EARLY and EAGER_OPS and (
            op in EAGER_OPS or (OP_TAG and f"{op}@{OP_TAG}" in EAGER_OPS)
            or (one_row and f"{op}:1" in EAGER_OPS)):
        mode = PDL_EAGER
    return {"PDL": mode, "launch_pdl": True} if mode else {"PDL": PDL_OFF}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the kernel before this one has finished (a no-op without PDL); in the
    early mode, then let the next kernel launch."""
    if PDL == 3:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()


# -- splits reduced by their last arrival -----------------------------------------------------
# A kernel that splits its reduction axis over programs (the quantized split-K GEMVs and
# GEMMs) used to write float32 partials and launch a second kernel to sum them: 56 more
# launches in a B=1 step of an fp8 7B model, more with more splits. Instead every
# program of a tile writes its partial and counts itself in on an
# arrival counter; the one that arrives last sums the partials in split order (the same
# additions the second kernel did, so the same bits) and resets the counter to zero for
# the next launch. No program waits on another, so no grid size or residency can
# deadlock, and a captured CUDA graph replays it as it is (the counters are zero between
# launches). The counters are one per-device buffer shared by every such kernel, which
# holds because the engine launches them on one stream, one after another (with PDL too:
# `pdl_wait` returns only once the kernel before has finished and its writes are
# visible); two of them running at once on two streams would count on the same slots.
COUNTER_SLOTS = 1 << 16
_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}
_CAPTURE_WARNED: set[tuple[str, int | None]] = set()


def arrival_counters(device: torch.device, slots: int) -> torch.Tensor | None:
    """The device's zeroed arrival counters, or None when `slots` do not fit or the buffer
    would first be allocated inside a CUDA-graph capture (the engine's warm-up launches
    every such kernel eagerly before it captures; a caller falls back to its two-kernel
    form)."""
    if slots > COUNTER_SLOTS:
        return None
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            if key not in _CAPTURE_WARNED:
                _CAPTURE_WARNED.add(key)
                logging.getLogger("pagefleet.engine").warning(
                    "split-K arrival counters first needed inside a CUDA-graph capture on "
                    "%s: that graph sums its splits with a second kernel", device)
            return None
        buf = _COUNTERS[key] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return buf


@triton.jit
def last_arrival(cnt_ptr, arrivals):
    """True in the one program of the `arrivals` sharing `cnt_ptr` that counts itself in
    last, which then sees every other one's stores (the barrier orders this program's own
    stores before its release; the acquire, before its loads: CUTLASS's split-K
    semaphore). It resets the counter for the next launch. Read the others' partials
    with `.cg` loads (L2, never a stale L1 line)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == arrivals - 1
    if last:
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
    return last
