"""Each phase of a device benchmark in its own process with a timeout, so that a crash
or a hang costs that phase only (device time is scarce). Used by profile_serving.py and
step_trace.py: `python3 SCRIPT [PHASES]` runs the named phases (comma-separated, default
`default`), each as `python3 SCRIPT --phase NAME`, which writes `$OUT/<prefix>_NAME.json`
(the phase's result, or its traceback)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import traceback
from pathlib import Path


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(script: str, phases: dict, out: Path, prefix: str, default: list[str]) -> None:
    """`phases`: name -> (function returning a JSON-able dict, timeout in seconds)."""
    out.mkdir(parents=True, exist_ok=True)
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        name = sys.argv[2]
        try:
            data = phases[name][0]()
        except Exception:  # noqa: BLE001 - the error is the result
            traceback.print_exc()
            data = {"error": traceback.format_exc()[-3000:]}
        (out / f"{prefix}_{name}.json").write_text(json.dumps(data, indent=1, default=str))
        return
    for name in (sys.argv[1].split(",") if len(sys.argv) > 1 else default):
        t0 = time.time()
        log(f"== {name}")
        try:
            subprocess.run([sys.executable, script, "--phase", name], timeout=phases[name][1],
                           check=False)
        except subprocess.TimeoutExpired:
            log(f"{name}: timed out after {phases[name][1]} s")
        log(f"{name}: {time.time() - t0:.0f} s")
