"""Triton's CPU interpreter, less two kinds of redundant work (tests only).

1. Under TRITON_INTERPRET=1, every call of a `@triton.jit` helper from inside a kernel
(`InterpretedFunction.__call__`) runs `_patch_lang` again: `inspect.getmembers` over
triton.language, its tensor class and math module, rebinding every builtin. The
kernel's launch (`GridExecutor.__call__`) has already done exactly that for the same
modules and undoes it when the grid finishes, so the helper's pass changes nothing
(builtins already rebound are not builtins any more; the rest is set to the same
values) and its scope is never restored. It cost about a third of the interpreted
kernel tests' CPU time (profiled on triton 3.9.0: 51,000 helper calls at ~2 ms each
in one model test). `install()` skips that pass only where it is a no-op: inside a
running grid, for a helper whose language modules (`tl`, `tl.core` as seen in its
globals) the launch (or an earlier helper in it) has patched. Anything else takes the
original path.

2. `_get_np_dtype` is memoized per scalar type (below).

The kernels run the same interpreted code either way. Checked against triton 3.9.0's
interpreter (the version pyproject pins for the CPU tests); other versions are left
alone, and PAGEFLEET_TRITON_INTERPRETER_AS_IS=1 leaves it alone too (tests/conftest.py).
"""

from __future__ import annotations

import types

PATCHED_VERSION = "3.9.0"


def install() -> bool:
    try:
        import triton
        from triton.runtime import interpreter as ti
    except ImportError:   # the operator-only install
        return False
    if triton.__version__ != PATCHED_VERSION or getattr(ti, "_pagefleet_once", False):
        return False
    if not all(hasattr(ti, n) for n in ("_patch_lang", "_LangPatchScope", "GridExecutor",
                                        "_get_np_dtype", "tl")):
        return False
    tl = ti.tl
    original_patch = ti._patch_lang
    original_grid_call = ti.GridExecutor.__call__
    state = {"active": False, "first": False, "langs": frozenset()}
    langs_cache: dict[int, frozenset[int]] = {}

    def langs_of(fn) -> frozenset[int]:
        key = id(fn.__globals__)
        if key not in langs_cache:
            langs_cache[key] = frozenset(
                id(v) for v in list(fn.__globals__.values())
                if isinstance(v, types.ModuleType) and (v is tl or v is tl.core))
        return langs_cache[key]

    def patch_lang(fn):
        if state["active"]:
            langs = langs_of(fn)
            if state["first"]:   # the launch's own patch, restored when the grid ends
                state["first"] = False
                state["langs"] = langs
            elif langs and langs <= state["langs"]:
                return ti._LangPatchScope()   # already patched for this grid: a no-op
            else:
                state["langs"] = state["langs"] | langs
        return original_patch(fn)

    def grid_call(self, *args, **kwargs):
        saved = dict(state)
        state.update(active=True, first=True, langs=frozenset())
        try:
            return original_grid_call(self, *args, **kwargs)
        finally:
            state.update(saved)

    # `_get_np_dtype` builds a dict of 19 dtypes on every call (every load, store, cast
    # and binary op: ~8% of an interpreted kernel's time). Its answer depends on the
    # scalar type alone (a block's element type; uint64 for any pointer), the same
    # branches as the original's, so it is built once per scalar type.
    original_np_dtype = ti._get_np_dtype
    pointer = original_np_dtype(tl.pointer_type(tl.int8))
    np_dtypes: dict = {}

    def get_np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            return pointer
        try:
            return np_dtypes[scalar]
        except KeyError:
            np_dtypes[scalar] = result = original_np_dtype(scalar)
            return result
        except TypeError:   # not hashable: the original path
            return original_np_dtype(tt_dtype)

    ti._patch_lang = patch_lang
    ti.GridExecutor.__call__ = grid_call
    ti._get_np_dtype = get_np_dtype
    ti._pagefleet_once = True
    return True
