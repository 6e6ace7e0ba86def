"""What the Gluon kernels (`gluon_attention`, `gluon_w4`) share: which Triton releases
they serve on, their operator switches, and the per-device Hopper check.

Gluon's API moves between releases (warp_specialize's signature, the TMA names, layout
classes), so a Gluon kernel serves only on the releases CI compiles it with
(tests/server/compile_sm90.py, under the test Triton and the server image's) and the
H200 ran (3.6); on any other release the Triton kernels beside it serve, a few percent
slower, rather than a compile error at warm-up.
"""

from __future__ import annotations

import os

import torch

TESTED_TRITON = ((3, 6), (3, 9))


def supported_triton(version: str) -> bool:
    """Whether `version` (as `triton.__version__` spells it) is a tested release."""
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) in TESTED_TRITON


def env_switch(name: str) -> bool:
    """An operator's switch for one Gluon kernel: "1" (default) lets it serve where it
    applies, "0" keeps the Triton kernels everywhere (should it misbehave on a GPU or
    driver it was not run on); anything else is an error naming the variable."""
    env = os.environ.get(name, "1").strip()
    if env not in ("0", "1"):
        raise ValueError(f"{name}={env!r}: expected 0 or 1")
    return env == "1"


_HOPPER: dict[int | None, bool] = {}


def hopper(index: int | None) -> bool:
    """Compute capability 9.0 and not the interpreter, per device: asked once, since the
    kernels' `usable` runs for every layer of every step."""
    if index not in _HOPPER:
        from pagefleet.server.ops.triton_common import INTERPRET
        _HOPPER[index] = (not INTERPRET
                          and torch.cuda.get_device_capability(index) == (9, 0))
    return _HOPPER[index]
