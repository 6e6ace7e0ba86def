"""The operator switches of the Gluon kernels (ops/gluon_common.py): each kernel's
variable turns it off with 0, and a value other than 0 or 1 is an error naming the
variable, not a silent default."""

from __future__ import annotations

import importlib

import pytest

# kernel_helpers first: it sets TRITON_INTERPRET=1 before anything imports triton (a
# kernel module imported without it would compile for a GPU in every later test).
from tests.server import kernel_helpers  # noqa: F401
import triton  # noqa: E402


@pytest.mark.parametrize("name,var", [("gluon_attention", "PAGEFLEET_GLUON_PREFILL"),
                                      ("gluon_w4", "PAGEFLEET_GLUON_GEMV")],
                         ids=["prefill", "gemv"])
def test_gluon_kernel_switch(name, var, monkeypatch):
    from pagefleet.server.ops import gluon_common
    module = importlib.import_module(f"pagefleet.server.ops.{name}")
    try:
        monkeypatch.setenv(var, "0")
        assert not importlib.reload(module).AVAILABLE
        monkeypatch.setenv(var, "yes")
        with pytest.raises(ValueError, match=var):
            importlib.reload(module)
        monkeypatch.setenv(var, "1")
        assert importlib.reload(module).AVAILABLE is (
            module.IMPORTED and gluon_common.supported_triton(triton.__version__))
    finally:
        monkeypatch.delenv(var)
        importlib.reload(module)
