"""Render the Helm chart, and the plain manifests in manifests/ from it.

manifests/ is the chart's default render for `kubectl apply -f manifests/`: the same
objects helm would install with `--namespace pagefleet-system`, plus the Namespace,
minus Helm's own bookkeeping labels. Regenerate after changing the chart:

    python tests/deploy/render.py --write

`tests/deploy/test_manifests.py` fails when manifests/ drifts from the chart.
manifests/crd.yaml is written by `pagefleet crd` (it must equal the chart's
crds/modeldeployment.yaml; checked, not written, here).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

# libyaml's loader where PyYAML has it: the pure-Python one spent most of the chart
# tests' time scanning helm's output.
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.deploy import tools  # noqa: E402

REPO = tools.REPO
CHART = REPO / "charts" / "pagefleet"
MANIFESTS = REPO / "manifests"
RELEASE = "pagefleet"
NAMESPACE = "pagefleet-system"
HEADER = ("# Generated from charts/pagefleet by `python tests/deploy/render.py --write`.\n"
          "# Do not edit by hand: change the chart and regenerate (a test fails on drift).\n")
MONITORING_VALUES = {"monitoring.serviceMonitor.enabled": "true",
                     "monitoring.prometheusRule.enabled": "true",
                     "monitoring.dashboard.enabled": "true"}
GATEWAY_VALUES = {"gateway.enabled": "true"}
HELM_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")


def helm(*args: str, check: bool = True, helm_path: str | None = None) -> subprocess.CompletedProcess[str]:
    exe = helm_path or tools.find("helm")
    if exe is None:
        raise RuntimeError("helm not found: run `python tests/deploy/tools.py`")
    return subprocess.run([exe, *args], capture_output=True, text=True, check=check)


def template_args(values: dict[str, str] | None = None, include_crds: bool = True,
                  release: str = RELEASE, namespace: str = NAMESPACE,
                  values_files: list[Path] | None = None) -> list[str]:
    args = ["template", release, str(CHART), "--namespace", namespace]
    if include_crds:
        args.append("--include-crds")
    for f in values_files or []:
        args += ["--values", str(f)]
    for key, value in (values or {}).items():
        args += ["--set", f"{key}={value}"]
    return args


def render(values: dict[str, str] | None = None, include_crds: bool = True,
           helm_path: str | None = None, **kw: Any) -> list[dict[str, Any]]:
    out = helm(*template_args(values, include_crds, **kw), helm_path=helm_path).stdout
    return [d for d in yaml.load_all(out, Loader=YAML_LOADER) if d]


def _strip_helm(obj: dict[str, Any]) -> dict[str, Any]:
    """Plain manifests are not managed by Helm: drop its labels everywhere."""
    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if k == "labels" and isinstance(v, dict):
                    v = {lk: lv for lk, lv in v.items() if lk not in HELM_LABELS}
                out[k] = walk(v)
            return out
        if isinstance(node, list):
            return [walk(i) for i in node]
        return node
    return walk(obj)


def _dump(objs: list[dict[str, Any]], note: str = "") -> str:
    return HEADER + note + yaml.safe_dump_all(objs, sort_keys=False, width=100)


def manifest_files() -> dict[str, str]:
    """relative path under manifests/ -> file text."""
    base = [_strip_helm(o) for o in render({"createNamespace": "true"})]
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for obj in base:
        by_kind.setdefault(obj["kind"], []).append(obj)
    crds = by_kind.pop("CustomResourceDefinition", [])
    peering = [c for c in crds if c["spec"]["group"] == "kopf.dev"]
    files = {
        "namespace.yaml": _dump(by_kind.pop("Namespace")),
        "kopf-peering.yaml": _dump(peering, "# kopf's peering CRDs: operator replicas see each other and only one acts.\n"),
        "operator.yaml": _dump(by_kind.pop("ServiceAccount") + by_kind.pop("Deployment")),
        "rbac.yaml": _dump(by_kind.pop("ClusterRole") + by_kind.pop("ClusterRoleBinding")),
    }
    if by_kind:
        raise AssertionError(f"unplaced kinds in the default render: {sorted(by_kind)}")
    monitoring = [_strip_helm(o) for o in render(MONITORING_VALUES, include_crds=False)]
    by_kind = {}
    for obj in monitoring:
        by_kind.setdefault(obj["kind"], []).append(obj)
    files["monitoring/servicemonitor.yaml"] = _dump(by_kind["ServiceMonitor"])
    files["monitoring/prometheusrule.yaml"] = _dump(by_kind["PrometheusRule"])
    files["monitoring/grafana-dashboard.yaml"] = _dump(by_kind["ConfigMap"])
    # The gateway (off by default): what a gateway-enabled render adds to or changes in
    # the default one, for `kubectl apply -f manifests/gateway/` after manifests/.
    default = {_key(o): o for o in base}
    added = [o for o in (_strip_helm(o) for o in render(GATEWAY_VALUES, include_crds=False))
             if default.get(_key(o)) != o]
    note = ("# The gateway: apply after manifests/ (`kubectl apply -f manifests/gateway/`). The\n"
            "# operator Deployment here adds --gateway-service (scale from zero).\n")

    def is_gateway_deployment(o: dict[str, Any]) -> bool:
        return o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-gateway")

    groups = {
        "gateway/gateway.yaml": [o for o in added if o["kind"] in ("ServiceAccount", "Service", "PodDisruptionBudget")
                                 or is_gateway_deployment(o)],
        "gateway/operator.yaml": [o for o in added if o["kind"] == "Deployment" and not is_gateway_deployment(o)],
        "gateway/rbac.yaml": [o for o in added if o["kind"] in ("ClusterRole", "ClusterRoleBinding", "Role",
                                                                "RoleBinding")],
    }
    if sum(len(g) for g in groups.values()) != len(added):
        raise AssertionError(f"unplaced kinds in the gateway render: {sorted({o['kind'] for o in added})}")
    files.update({rel: _dump(objs, note) for rel, objs in groups.items()})
    return files


def _key(obj: dict[str, Any]) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def write() -> list[Path]:
    written = []
    for rel, text in manifest_files().items():
        path = MANIFESTS / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            written.append(path)
    return written


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        for p in write():
            print(f"wrote {p.relative_to(REPO)}")
    else:
        for rel, text in manifest_files().items():
            print(f"--- manifests/{rel}\n{text}")
