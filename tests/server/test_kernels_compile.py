"""The quantized-GEMM and prefill-attention kernels compile for sm_90 with the configs
they ship, checked here without a GPU (tests/server/compile_sm90.py): the interpreter
tests run the kernel bodies as Python and cannot see what Triton's compiler refuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton build ships no ptxas")
def test_kernels_compile_for_hopper() -> None:
    script = Path(__file__).with_name("compile_sm90.py")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count("ok ") == 11, proc.stdout
