"""Programmatic dependent launch (server/ops/triton_common.py): a kernel launched with
`launch_pdl` may start before the kernel it reads from has finished, so it must wait
(`pdl_wait(PDL)`) before touching memory. These checks hold every launch site to that,
statically, so a new kernel cannot take the launch option without the wait; and the
switch itself stays off where it cannot apply."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pagefleet.server.ops import triton_common

OPS = Path(triton_common.__file__).parent


def _launches(tree: ast.Module) -> set[str]:
    """Kernels launched as `kernel[grid](..., **launch_opts())` in a module."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) \
                and isinstance(node.func.value, ast.Name):
            if any(k.arg is None and isinstance(k.value, ast.Call)
                   and getattr(k.value.func, "id", "") == "launch_opts" for k in node.keywords):
                names.add(node.func.value.id)
    return names


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]          # the docstring
    return body[0]


def _ptrs_before_last_wait(fn: ast.FunctionDef) -> set[str]:
    """The kernel's pointer arguments named on lines before its last `pdl_wait(PDL)`
    (other than for their `.dtype`, which reads no memory)."""
    waits = [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Call)
             and ast.unparse(n) == "pdl_wait(PDL)"]
    args = {a.arg for a in fn.args.args if a.arg.endswith("_ptr")}
    body_start = _first_statement(fn).lineno
    dtype_only = {id(n.value) for n in ast.walk(fn)
                  if isinstance(n, ast.Attribute) and n.attr == "dtype"}
    return {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id in args
            and id(n) not in dtype_only and body_start <= n.lineno < max(waits, default=0)}


def test_every_pdl_launch_waits_first():
    """Each PDL-launched kernel waits before touching memory; the few that read ahead
    (a module's EARLY_READS: step inputs, constant tables and cached keys, which the
    kernel before them never writes) name before their last wait only the pointers
    declared there."""
    import importlib
    checked = early = 0
    for path in sorted(OPS.glob("triton_*.py")):
        tree = ast.parse(path.read_text())
        declared = getattr(importlib.import_module(f"pagefleet.server.ops.{path.stem}"),
                           "EARLY_READS", {})
        defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        for name in _launches(tree):
            fn = defs[name]
            assert "PDL" in [a.arg for a in fn.args.args], f"{path.name}:{name} takes no PDL"
            checked += 1
            if name in declared:
                seen = _ptrs_before_last_wait(fn)
                assert seen and seen <= set(declared[name]), \
                    f"{path.name}:{name} reads {sorted(seen)} before its wait, declared " \
                    f"{sorted(declared[name])}"
                early += 1
                continue
            first = _first_statement(fn)
            assert ast.unparse(first) == "pdl_wait(PDL)", \
                f"{path.name}:{name} touches memory before pdl_wait(PDL): {ast.unparse(first)}"
    # The decode path's kernels (norms, rotary + KV write, attention, SiLU, quantized GEMVs).
    assert checked >= 15 and early == 5   # + the rotary reading a deferred q/k/v row


def test_no_pdl_under_the_interpreter_or_when_switched_off(monkeypatch):
    monkeypatch.setattr(triton_common, "_PDL", None)
    if triton_common.INTERPRET:
        assert triton_common.pdl() == triton_common.PDL_OFF
        assert triton_common.launch_opts() == {"PDL": triton_common.PDL_OFF}
    monkeypatch.setattr(triton_common, "INTERPRET", False)
    for env in ("0", "1", "early"):
        monkeypatch.setattr(triton_common, "_PDL", None)
        monkeypatch.setenv("PAGEFLEET_PDL", env)
        import torch
        if env == "0" or not torch.cuda.is_available():   # off, or no CUDA device: never on
            assert triton_common.pdl() == triton_common.PDL_OFF
    monkeypatch.setattr(triton_common, "_PDL", None)
    monkeypatch.setenv("PAGEFLEET_PDL", "yes")
    with pytest.raises(ValueError, match="PAGEFLEET_PDL='yes'"):
        triton_common.pdl()
    monkeypatch.setattr(triton_common, "_PDL", None)


@pytest.mark.parametrize("module", ["triton_attention", "triton_quant", "triton_layernorm",
                                    "triton_rotary", "triton_activation"])
def test_launching_modules_use_launch_opts(module):
    """Each module of the decode path launches through launch_opts (a kernel launched
    plainly after a PDL-launched one is correct too, only slower; this keeps coverage)."""
    assert _launches(ast.parse((OPS / f"{module}.py").read_text()))


def test_eager_roles(monkeypatch):
    """PAGEFLEET_PDL_EAGER names kernel roles released before their wait in the early
    mode (an unknown role is an error, not silently never eager); a role "@tag" only
    while OP_TAG is tag; no other mode changes."""
    assert triton_common._eager_ops(" rotary, attention,merge ") == {"rotary", "attention",
                                                                      "merge"}
    assert triton_common._eager_ops("") == set()
    with pytest.raises(ValueError, match="unknown kernel roles \\['rotray'\\]"):
        triton_common._eager_ops("rotray")
    monkeypatch.setattr(triton_common, "EAGER_OPS", {"merge", "rmsnorm@in"})
    monkeypatch.setattr(triton_common, "_PDL", triton_common.PDL_EARLY)
    eager = {"PDL": triton_common.PDL_EAGER, "launch_pdl": True}
    assert triton_common.launch_opts("merge") == eager
    assert triton_common.launch_opts("attention")["PDL"] == triton_common.PDL_EARLY
    assert triton_common.launch_opts("rmsnorm")["PDL"] == triton_common.PDL_EARLY
    monkeypatch.setattr(triton_common, "OP_TAG", "in")
    assert triton_common.launch_opts("rmsnorm") == eager
    monkeypatch.setattr(triton_common, "OP_TAG", "")
    # a role ":1": its one-row launches only (the B=1 decode step's)
    assert triton_common._eager_ops("gemv:1,rmsnorm@in") == {"gemv:1", "rmsnorm@in"}
    with pytest.raises(ValueError, match="unknown kernel roles"):
        triton_common._eager_ops("gemv:2")
    monkeypatch.setattr(triton_common, "EAGER_OPS", {"gemv:1"})
    assert triton_common.launch_opts("gemv", one_row=True) == eager
    assert triton_common.launch_opts("gemv")["PDL"] == triton_common.PDL_EARLY
    assert triton_common.launch_opts("rmsnorm", one_row=True)["PDL"] == triton_common.PDL_EARLY
    monkeypatch.setattr(triton_common, "_PDL", triton_common.PDL_WAIT)
    assert triton_common.launch_opts("merge")["PDL"] == triton_common.PDL_WAIT
    assert triton_common.launch_opts("gemv", one_row=True)["PDL"] == triton_common.PDL_WAIT
    monkeypatch.setattr(triton_common, "_PDL", None)


def test_launch_roles_are_known():
    """Every role a launch site names is one EAGER_OPS can hold (a misspelt role would
    never be released early)."""
    roles = set()
    for path in sorted(OPS.glob("triton_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "launch_opts" \
                    and node.args:
                roles.add(node.args[0].value)
    assert roles and roles <= set(triton_common.ROLES)
    assert {"rotary", "attention", "merge"} <= roles
