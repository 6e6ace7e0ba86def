"""What the images install: the wheel of the build context (not the editable dev
install the rest of the suite imports), run the way the Dockerfile runs it.

- The wheel holds every package and module under server/ and operator/ (a subpackage
  missing from it fails only in the images: the dev install imports the source tree).
- The server image, simulated without docker: a fresh venv with only that wheel
  (the third-party packages come from this venv, through a path entry), the build
  step's `python -c` run from the build-time working directory laid out as the
  Dockerfile leaves it, then `pagefleet serve` (demo model, spawned engine core) from
  the runtime working directory, with the Dockerfile's ENV. A source tree in either
  directory shadows the standard library (operator/ is `import operator`) unless
  the interpreter leaves the working directory off sys.path.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.deploy import tools
from tests.deploy.test_dockerfile import resolved

REPO = tools.REPO
SOURCE_DIRS = {"server": "pagefleet/server", "operator": "pagefleet/operator"}


def _copies(stage: str) -> list[tuple[str, str, str]]:
    """(source, absolute destination, WORKDIR at that point) of each COPY of the
    build context in `stage`."""
    out = []
    workdir = "/"
    for instr, args in resolved(stage):
        if instr == "WORKDIR":
            workdir = os.path.join(workdir, args.strip())
        elif instr == "COPY":
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            for src in words[:-1]:
                dest = os.path.normpath(os.path.join(workdir, words[-1]))
                if words[-1].endswith("/") and not src.endswith("/"):
                    dest = os.path.join(dest, os.path.basename(src))
                out.append((src.rstrip("/"), dest, workdir))
    return out


def _final_workdir(stage: str) -> str:
    workdir = "/"
    for instr, args in resolved(stage):
        if instr == "WORKDIR":
            workdir = os.path.join(workdir, args.strip())
    return os.path.normpath(workdir)


def _env(stage: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for instr, args in resolved(stage):
        if instr == "ENV":
            for word in shlex.split(args):
                key, _, value = word.partition("=")
                env[key] = value
    return env


def _lay_out(root: Path, directory: str, stage: str) -> Path:
    """`directory` of the image under `root`, with what the stage COPYs into it."""
    target = root / directory.lstrip("/")
    target.mkdir(parents=True, exist_ok=True)
    for src, dest, _ in _copies(stage):
        if os.path.dirname(dest) != directory and dest != directory:
            continue
        path = REPO / src
        where = root / dest.lstrip("/")
        if path.is_dir():
            shutil.copytree(path, where, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
        else:
            where.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, where)
    return target


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of the server stage's build context (`pip install .` builds the same)."""
    root = tmp_path_factory.mktemp("ctx")
    copies = _copies("server")
    (workdir,) = {w for _, _, w in copies if not w.startswith("/home")}
    ctx = _lay_out(root, os.path.normpath(workdir), "server")
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "--quiet", "--wheel-dir", str(out), str(ctx)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    (whl,) = out.glob("pagefleet-*.whl")
    return whl


def test_the_wheel_holds_every_package_and_module(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = set()
    for src, prefix in SOURCE_DIRS.items():
        for path in (REPO / src).rglob("*.py"):
            rel = path.relative_to(REPO / src)
            if "__pycache__" in rel.parts:
                continue
            expected.add(f"{prefix}/{rel.as_posix()}")
    missing = sorted(expected - names)
    assert not missing, f"not in the wheel (a non-editable install lacks them): {missing}"
    # Package data: the core-type schemas the CRD embeds, the demo model's files.
    assert "pagefleet/operator/coretypes.json" in names
    assert any(n.startswith("pagefleet/server/demo/model/") for n in names)


def _venv_with(wheel: Path, root: Path) -> Path:
    """A fresh venv with the wheel installed (no deps); the third-party packages come
    from this venv's site-packages as a plain path entry (its .pth files, the
    editable install's among them, are not run)."""
    venv = root / "venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}

    def run(*cmd: str) -> str:
        res = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, f"{cmd}: {res.stdout[-2000:]}{res.stderr[-2000:]}"
        return res.stdout

    run(sys.executable, "-m", "venv", str(venv))
    py = str(venv / "bin" / "python")
    run(py, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel))
    site = run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    (Path(site) / "zz_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def _image_env(stage: str, venv: Path, home: Path) -> dict[str, str]:
    """The Dockerfile's ENV over a bare environment (no PYTHONPATH: the image has none);
    only the model cache path is moved somewhere writable."""
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}
    env.update(_env(stage))
    env["HF_HOME"] = str(home / "hf-cache")
    return env


def test_the_server_image_builds_and_serves_from_its_working_directories(wheel: Path, tmp_path: Path) -> None:
    venv = _venv_with(wheel, tmp_path)
    root = tmp_path / "image"
    env = _image_env("server", venv, tmp_path)
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import pagefleet.server; print(pagefleet.server.__file__)"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert str(venv) in where, f"the wheel's code, not this checkout's: {where}"
    # The build step: every `python` command of the RUN that installs the package,
    # from the working directory it runs in (holding the copied sources).
    copies = _copies("server")
    (build_dir,) = {w for _, _, w in copies}
    build_cwd = _lay_out(root, os.path.normpath(build_dir), "server")
    run = next(a for i, a in resolved("server") if i == "RUN" and "pip install --no-deps ." in a)
    models = tmp_path / "models"
    models.mkdir()
    steps = [s.strip() for s in run.split("&&") if re.match(r"\s*python\b", s)]
    assert steps, "the build step's python command"
    for step in steps:
        res = subprocess.run(shlex.split(step.replace("/opt/pagefleet/models", str(models))),
                             cwd=build_cwd, env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, f"build step {step!r} in {build_dir}: {res.stderr[-2000:]}"
    # The entry point, from the runtime working directory.
    run_cwd = _lay_out(root, _final_workdir("server"), "server")
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(venv / "bin" / "pagefleet"), "serve", "--host", "127.0.0.1", "--port", "0"],
                                cwd=run_cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        url = ""
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            assert proc.poll() is None, f"pagefleet serve exited with {proc.returncode}:\n{text[-3000:]}"
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", text)
            url = m.group(1) if m else ""
            try:
                if url and httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        else:
            pytest.fail(f"not ready in 180 s:\n{log.read_text(errors='replace')[-3000:]}")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
