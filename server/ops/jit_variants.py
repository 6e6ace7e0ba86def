"""Which compiled variants of pagefleet's Triton kernels a workload asks for.

Triton compiles one binary per *specialization* of a kernel: every constexpr value and,
for the other arguments, their type, whether an integer is 1 or a multiple of 16 and
whether a pointer is 16-byte aligned (unless the kernel opts out with
`do_not_specialize` / `do_not_specialize_on_alignment`). A variant first met while
serving compiles inside the engine's step: 0.3-0.7 s for an attention kernel on an
H200, during which every stream stalls. On the GPU side by side with vLLM that showed
as TTFT spikes in the first waves of each new workload shape.

`record()` computes the key Triton would at each launch of our kernels, so a test can
check on the CPU (TRITON_INTERPRET=1, nothing compiled) that the engine's warm-up
reaches every variant a varied workload reaches. Not for production: it costs a few
microseconds per launch.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterator
from typing import Any

import triton.language as tl

KERNEL_MODULES = ("triton_activation", "triton_attention", "triton_bitmask", "triton_layernorm",
                  "triton_quant", "triton_rotary", "triton_sampling")
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


def kernels() -> dict[str, Any]:
    """name -> launched kernel object (JITFunction, or InterpretedFunction under the
    interpreter) of every kernel in the op modules."""
    found: dict[str, Any] = {}
    for mod_name in KERNEL_MODULES:
        mod = importlib.import_module(f"pagefleet.server.ops.{mod_name}")
        for name, obj in vars(mod).items():
            if hasattr(obj, "run") and hasattr(obj, "fn") and inspect.isfunction(obj.fn) \
                    and obj.fn.__module__ == mod.__name__:   # defined here, not imported
                found[f"{mod_name}.{name}"] = obj
    return found


def _options(kernel: Any) -> tuple[set, set]:
    opts = getattr(kernel, "kwargs", None) or {}
    dns = opts.get("do_not_specialize", getattr(kernel, "do_not_specialize", None)) or ()
    dnsa = opts.get("do_not_specialize_on_alignment",
                    getattr(kernel, "do_not_specialize_on_alignment", None)) or ()
    return set(dns), set(dnsa)


def variant_key(kernel: Any, args: tuple, kwargs: dict) -> tuple:
    """The specialization a launch with these arguments compiles (Triton's own rules)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    params = list(inspect.signature(kernel.fn).parameters.values())
    dns, dnsa = _options(kernel)
    key: list = []
    for i, p in enumerate(params):
        value = args[i] if i < len(args) else kwargs.get(p.name, p.default)
        if p.annotation is tl.constexpr or p.annotation == "tl.constexpr":
            key.append(("constexpr", value))
        elif isinstance(value, float):
            key.append(("fp32", None))
        else:
            spec = not (i in dns or p.name in dns)
            align = not (i in dnsa or p.name in dnsa)
            key.append(tuple(native_specialize_impl(BaseBackend, value, False, spec, align)))
    key.extend((k, kwargs[k]) for k in LAUNCH_OPTIONS if k in kwargs)
    return tuple(key)


@contextlib.contextmanager
def record() -> Iterator[dict[str, set]]:
    """Within the block, every launch of our kernels adds its variant key to
    `seen[kernel name]`."""
    seen: dict[str, set] = {}
    patched = []
    for name, kernel in kernels().items():
        original = kernel.run

        def run(*args, _name=name, _kernel=kernel, _run=original, **kwargs):
            launch = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
            seen.setdefault(_name, set()).add(variant_key(_kernel, args, launch))
            return _run(*args, **kwargs)

        kernel.run = run
        patched.append(kernel)
    try:
        yield seen
    finally:
        for kernel in patched:
            del kernel.run


def new_variants(before: dict[str, set], after: dict[str, set]) -> dict[str, list]:
    """Variants in `after` that `before` did not reach, by kernel, readable."""
    out = {}
    for name, keys in after.items():
        extra = keys - before.get(name, set())
        if extra:
            out[name] = sorted(map(repr, extra))
    return out
