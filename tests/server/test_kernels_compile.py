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


# The server image's Triton (torch 2.11.0's 3.6.0, Dockerfile), installed beside the
# test Triton by .ci/run (`pip install --no-deps --target .ci/triton36 triton==3.6.0`):
# code that 3.9 compiles and 3.6 refuses stopped the AWQ engine on the H200 once
# (BENCHMARKS.md, 2026-12-03, eighth session).
TRITON36 = Path(__file__).resolve().parents[2] / ".ci" / "triton36"


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton build ships no ptxas")
@pytest.mark.parametrize("triton_dir", [None, TRITON36], ids=["test-triton", "triton-3.6"])
def test_kernels_compile_for_hopper(triton_dir: Path | None) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    if triton_dir is not None:
        if not (triton_dir / "triton").is_dir():
            pytest.skip(f"no Triton in {triton_dir} (.ci/run installs 3.6.0 there)")
        # (no empty entry: it would put the working directory, whose operator/ package
        # shadows the standard library's, on the path)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(triton_dir), env.get("PYTHONPATH"))
                                            if p)
    script = Path(__file__).with_name("compile_sm90.py")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout.count("ok ") == 45, proc.stdout   # every case in compile_sm90
    if triton_dir is not None:   # the compile ran under that Triton, not the test one
        assert f"from {triton_dir}{os.sep}" in proc.stdout.splitlines()[0], proc.stdout[:300]
