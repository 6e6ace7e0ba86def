"""The quantized-GEMM, attention and rotary + KV-write kernels compile for sm_90 with the configs
they ship, checked here without a GPU (tests/server/compile_sm90.py): the interpreter
tests run the kernel bodies as Python and cannot see what Triton's compiler refuses."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Located, not imported: Triton imported before a test module sets TRITON_INTERPRET=1
# breaks the interpreter's calls from one jit function into another (a kernel's helpers)
# for the rest of the process.
_spec = importlib.util.find_spec("triton")
if _spec is None or not _spec.origin:
    pytest.skip("triton is not installed", allow_module_level=True)
PTXAS = Path(_spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton build ships no ptxas")
def test_kernels_compile_for_hopper() -> None:
    script = Path(__file__).with_name("compile_sm90.py")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count("ok ") == 31, proc.stdout   # every case in compile_sm90
