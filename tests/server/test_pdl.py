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


def test_every_pdl_launch_waits_first():
    checked = 0
    for path in sorted(OPS.glob("triton_*.py")):
        tree = ast.parse(path.read_text())
        defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        for name in _launches(tree):
            fn = defs[name]
            assert "PDL" in [a.arg for a in fn.args.args], f"{path.name}:{name} takes no PDL"
            first = _first_statement(fn)
            assert ast.unparse(first) == "pdl_wait(PDL)", \
                f"{path.name}:{name} touches memory before pdl_wait(PDL): {ast.unparse(first)}"
            checked += 1
    # The decode path's kernels (norms, rotary + KV write, attention, SiLU, quantized GEMVs).
    assert checked >= 15


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
