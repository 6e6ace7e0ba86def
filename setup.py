"""The package list, found instead of written by hand. pyproject.toml maps
`pagefleet.server` to server/ and `pagefleet.operator` to operator/ (package-dir), and
setuptools' `packages.find` cannot put the `pagefleet.` prefix on what it finds. A
subpackage left out of a hand-written list is missing from every non-editable install
(the images) while the editable dev install still imports it; this list cannot forget
one. Everything else is in pyproject.toml; tests/deploy/test_packaging.py checks the
wheel.
"""

import tomllib
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent


def packages() -> list[str]:
    config = tomllib.loads((HERE / "pyproject.toml").read_text())["tool"]["setuptools"]
    out = []
    for package, where in config["package-dir"].items():
        out.append(package)
        out += [f"{package}.{sub}" for sub in find_packages(where=str(HERE / where))]
    return sorted(out)


setup(packages=packages())
