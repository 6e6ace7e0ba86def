"""The Dockerfile: hadolint-clean, two targets with the right entry points, non-root,
pinned, and everything it copies exists in the build context."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.deploy import tools

REPO = tools.REPO
DOCKERFILE = REPO / "Dockerfile"


def stages() -> dict[str, list[tuple[str, str]]]:
    """stage name -> [(INSTRUCTION, args)], continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out: dict[str, list[tuple[str, str]]] = {"": []}
    current = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, args = line.partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?", args, re.I)
            assert m
            current = (m.group(2) or "").lower()
            out[current] = []
        out[current].append((instr, args.strip()))
    return out


def instr(stage: str, name: str) -> list[str]:
    return [a for i, a in stages()[stage] if i == name]


def resolved(stage: str) -> list[tuple[str, str]]:
    """A stage's instructions with those of the stages it is built FROM first."""
    st = stages()
    out: list[tuple[str, str]] = []
    for i, a in st[stage]:
        if i == "FROM":
            parent = a.split()[0].lower()
            if parent in st:
                out += resolved(parent)
        out.append((i, a))
    return out


def test_hadolint(hadolint_bin: str) -> None:
    res = subprocess.run([hadolint_bin, "--failure-threshold", "info", str(DOCKERFILE)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_hadolint_can_fail(hadolint_bin: str, tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\n")
    assert subprocess.run([hadolint_bin, str(bad)], capture_output=True).returncode != 0


def test_two_targets_with_their_entry_points() -> None:
    assert json.loads(instr("server", "ENTRYPOINT")[-1]) == ["pagefleet", "serve"]
    assert json.loads(instr("operator", "ENTRYPOINT")[-1]) == ["pagefleet", "operator"]
    assert "8000" in instr("server", "EXPOSE")[-1].split()
    assert any("/models/hf-cache" in v for v in instr("server", "VOLUME"))
    # The console script the entry points run.
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["pagefleet"] == "pagefleet.server.cli:main"


@pytest.mark.parametrize("stage,args", [("server", ["serve", "--help"]),
                                        ("operator", ["operator", "--help"])])
def test_entry_points_run(stage: str, args: list[str]) -> None:
    """The same command the image runs, from this checkout."""
    exe = json.loads(instr(stage, "ENTRYPOINT")[-1])
    assert exe[0] == "pagefleet"
    res = subprocess.run([sys.executable, "-m", "pagefleet.server.cli", *exe[1:], "--help"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"pagefleet {exe[1]}" in res.stdout


@pytest.mark.parametrize("stage", ["server", "operator"])
def test_runs_as_non_root(stage: str) -> None:
    users = [a for i, a in resolved(stage) if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")


def _dockerignore_excludes(rel: str) -> bool:
    """Docker's rule: the last matching pattern wins; '!' re-includes."""
    excluded = False
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        pat = raw.strip()
        if not pat or pat.startswith("#"):
            continue
        neg = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        parts = rel.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.replace("**/", "")) for p in prefixes):
            excluded = not neg
    return excluded


@pytest.mark.parametrize("stage", ["server", "operator"])
def test_everything_copied_exists_in_the_context(stage: str) -> None:
    copies = [a for i, a in resolved(stage) if i in ("COPY", "ADD")]
    assert copies
    for args in copies:
        words = [w for w in shlex.split(args) if not w.startswith("--")]
        for src in words[:-1]:
            path = REPO / src
            assert path.exists(), f"{stage}: COPY {src}: not in the repository"
            assert not _dockerignore_excludes(src.rstrip("/")), f"{stage}: COPY {src}: .dockerignore excludes it"
            if path.is_dir():
                assert any(path.rglob("*.py")), src
    # The packages pyproject installs are all copied (pip install . would fail otherwise).
    pkg_dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    copied = {shlex.split(a)[0].rstrip("/") for a in copies}
    assert set(pkg_dirs.values()) <= copied
    assert {"pyproject.toml", "setup.py", "README.md"} <= {w for a in copies for w in shlex.split(a)[:-1]}


def _pins(stage: str) -> dict[str, str]:
    pins: dict[str, str] = {}
    args = {}
    for i, a in resolved(stage):
        if i == "ARG" and "=" in a:
            k, v = a.split("=", 1)
            args[k] = v
        if i == "RUN" and "pip install" in a:
            for w in shlex.split(a.split("pip install", 1)[1].split("&&")[0]):
                if w.startswith("-") or w == ".":
                    continue
                for k, v in args.items():
                    w = w.replace("${%s}" % k, v)
                assert "==" in w, f"{stage}: unpinned dependency {w!r}"
                name, version = w.split("==")
                pins[name.lower().replace("_", "-")] = version
    return pins


def test_base_image_and_dependencies_are_pinned() -> None:
    base = instr("", "ARG")
    image = next(a.split("=", 1)[1] for a in base if a.startswith("PYTHON_IMAGE="))
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", image), image
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for stage, extras in (("server", ["server"]), ("operator", ["operator"])):
        pins = _pins(stage)
        reqs = [Requirement(r) for r in project["dependencies"]]
        reqs += [Requirement(r) for e in extras for r in project["optional-dependencies"][e]]
        for req in reqs:
            name = req.name.lower().replace("_", "-")
            assert name in pins, f"{stage}: {req.name} is not pinned"
            assert req.specifier.contains(Version(pins[name])), f"{stage}: {name}=={pins[name]} violates {req}"
    assert "torch" not in _pins("operator")
