"""The operator switches of the Gluon kernels (ops/gluon_common.py): each kernel's
variable turns it off with 0, and a value other than 0 or 1 is an error naming the
variable, not a silent default."""

from __future__ import annotations

import importlib

import pytest
import triton

from pagefleet.server.ops import gluon_attention, gluon_common, gluon_w4


@pytest.mark.parametrize("module,var", [(gluon_attention, "PAGEFLEET_GLUON_PREFILL"),
                                        (gluon_w4, "PAGEFLEET_GLUON_GEMV")],
                         ids=["prefill", "gemv"])
def test_gluon_kernel_switch(module, var, monkeypatch):
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
