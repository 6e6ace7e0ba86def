"""manifests/ is the chart's default render: a test fails when they drift."""

from __future__ import annotations

import difflib

import yaml

from tests.deploy import render, schemas


def test_manifests_match_the_chart(helm_bin: str) -> None:
    expected = render.manifest_files()
    problems = []
    for rel, text in expected.items():
        path = render.MANIFESTS / rel
        actual = path.read_text() if path.exists() else ""
        if actual != text:
            diff = "".join(difflib.unified_diff(actual.splitlines(True), text.splitlines(True),
                                                f"manifests/{rel}", "chart render", n=1))
            problems.append(diff[:2000] or f"manifests/{rel} missing")
    assert not problems, ("manifests/ drifted from charts/pagefleet; run "
                          "`python tests/deploy/render.py --write`\n" + "\n".join(problems))
    # Nothing generated-looking in manifests/ that the render no longer produces.
    generated = {p.relative_to(render.MANIFESTS).as_posix()
                 for p in render.MANIFESTS.rglob("*.yaml")
                 if p.read_text().startswith(render.HEADER)}
    assert generated <= set(expected), generated - set(expected)


def test_plain_install_is_complete_and_valid() -> None:
    """`kubectl apply -f manifests/` (top level, alphabetical) installs the CRDs, the
    namespace, then what lives in it; every object is valid Kubernetes."""
    files = sorted(p for p in render.MANIFESTS.glob("*.yaml"))
    objs = [d for p in files for d in yaml.safe_load_all(p.read_text()) if d]
    kinds = [o["kind"] for o in objs]
    for kind in ("CustomResourceDefinition", "Namespace", "ServiceAccount", "ClusterRole",
                 "ClusterRoleBinding", "Deployment"):
        assert kind in kinds, kind
    # The namespace exists before anything that lives in it is applied.
    first_namespaced = min(i for i, o in enumerate(objs) if o["metadata"].get("namespace"))
    assert kinds.index("Namespace") < first_namespaced
    assert {o["metadata"]["namespace"] for o in objs if o["metadata"].get("namespace")} == {render.NAMESPACE}
    for obj in objs:
        for version in schemas.KUBE_VERSIONS:
            schemas.validate_k8s(obj, version)
    assert not any("helm.sh/chart" in yaml.safe_dump(o) for o in objs)
