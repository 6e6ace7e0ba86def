"""The SASS-reading tools (benchmarks/sass_loop.py, sass_scoreboards.py) name every
constexpr of the kernels they compile: a kernel that gains one (MERGE, FOLD) otherwise
breaks them silently, as it did for a session, and they are only run by hand. Checked
without compiling (`compile_sm90.signature` raises on a constexpr left out), in a
process of its own with TRITON_INTERPRET=0 (interpreted kernels carry no parameter
list)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import importlib.util, sys
sys.path.insert(0, sys.argv[1] + "/tests/server")
from compile_sm90 import signature
from pagefleet.server.ops import gluon_w4
if not gluon_w4.IMPORTED:
    print("no gluon"); sys.exit(0)
def module(name):
    spec = importlib.util.spec_from_file_location(name, f"{sys.argv[1]}/benchmarks/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
sl = module("sass_loop")
cases = list(sl.loop_cases().values()) + list(sl.gluon_tile_cases().values())
for fn, ptrs, cx, *_ in cases:
    signature(fn, ptrs, cx)
sb = module("sass_scoreboards")
for extra in ({"DEPTH": 1, "XS_TILES": 0}, {"DEPTH": 3, "XS_TILES": 32}):
    fn, ptrs, cx, *_ = sb.kernel_case(extra)
    signature(fn, ptrs, cx)
print(f"named: {len(cases) + 2} cases")
"""


def test_sass_tools_name_every_constexpr():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", CHECK, str(ROOT)], capture_output=True,
                          text=True, env=env, cwd="/", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "named:" in proc.stdout or "no gluon" in proc.stdout, proc.stdout
