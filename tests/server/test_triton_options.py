"""Triton options the kernels were measured and parity-checked under, held fixed across
Triton upgrades (server/ops/triton_common.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import triton
    from pagefleet.server.ops import triton_common  # noqa: F401
    enabled = triton.knobs.language.fp_fusion_enabled(None)
import os
print(json.dumps({"env": os.environ.get("TRITON_DEFAULT_FP_FUSION"), "enabled": enabled,
                  "warned": [str(w.message)[:80] for w in caught if "FP fusion" in str(w.message)]}))
"""


def _probe(env_value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_DEFAULT_FP_FUSION"}
    if env_value is not None:
        env["TRITON_DEFAULT_FP_FUSION"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_fp_fusion_stays_on_without_asking() -> None:
    """Triton 3.9 warns that 3.10 will stop fusing a * b + c into one FMA by default;
    importing the kernels sets the default to fusion, as every measurement ran."""
    got = _probe(None)
    assert got["env"] == "1"
    assert got["enabled"] is True
    assert got["warned"] == []


@pytest.mark.parametrize("value, enabled", [("0", False), ("1", True)])
def test_an_explicit_fp_fusion_setting_wins(value: str, enabled: bool) -> None:
    got = _probe(value)
    assert got["env"] == value
    assert got["enabled"] is enabled
