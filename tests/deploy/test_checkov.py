"""checkov on the chart's render and on what the operator makes of the examples: every
failed check is one that docs/deploy.md lists with its reason. checkov is heavy and
not a project dependency: the test runs when `checkov` is on PATH (or
$PAGEFLEET_CHECKOV), and is skipped otherwise."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy import render, tools

DOCS = render.REPO / "docs" / "deploy.md"


def justified() -> set[str]:
    """The check ids in the 'why it stays' table of docs/deploy.md."""
    text = DOCS.read_text()
    table = text.split("| check | where | why it stays |", 1)[1].split("\n\n", 1)[0]
    ids: set[str] = set()
    for line in table.splitlines()[2:]:
        first = line.split("|")[1]
        for m in re.finditer(r"(CKV2?_K8S)_(\d+(?:/\d+)*)", first):
            ids |= {f"{m.group(1)}_{n}" for n in m.group(2).split("/")}
    return ids


def test_the_justification_table_parses() -> None:
    assert {"CKV_K8S_11", "CKV_K8S_15", "CKV_K8S_43", "CKV_K8S_10", "CKV_K8S_12", "CKV_K8S_13"} <= justified()


def test_remaining_checkov_failures_are_justified(helm_bin: str, tmp_path: Path) -> None:
    checkov = tools.find("checkov")
    if checkov is None:
        pytest.skip("checkov not installed (pip install checkov in a separate venv, put it on PATH)")
    from tests.deploy.test_chart import _rendered_examples

    (tmp_path / "examples.yaml").write_text(yaml.safe_dump_all([o for _, o in _rendered_examples()]))
    (tmp_path / "chart.yaml").write_text(render.helm(*render.template_args(include_crds=False),
                                                     helm_path=helm_bin).stdout)
    failed: set[str] = set()
    for name in ("examples.yaml", "chart.yaml"):
        res = subprocess.run([checkov, "-f", str(tmp_path / name), "--framework", "kubernetes", "--quiet",
                              "--skip-download", "-o", "json"], capture_output=True, text=True, timeout=600)
        report = json.loads(res.stdout)
        report = report[0] if isinstance(report, list) else report
        failed |= {c["check_id"] for c in report["results"]["failed_checks"]}
    assert failed <= justified(), f"undocumented checkov failures: {sorted(failed - justified())}"
