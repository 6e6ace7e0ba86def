"""The Helm chart: lint, render, every object valid for Kubernetes 1.30-1.35,
least-privilege RBAC, values.schema.json, monitoring assets."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagefleet.operator import crd
from tests.deploy import render, schemas

CHART = render.CHART
# Value sets a platform team would install with; each must lint, render and validate.
VALUE_SETS: dict[str, dict[str, str]] = {
    "default": {},
    "monitoring": dict(render.MONITORING_VALUES),
    "standalone": {"peering.enabled": "false"},
    "namespaces-cluster-rbac": {"operator.watchNamespaces": "{team-a,team-*}"},
    "namespaced-rbac": {"rbac.namespaced": "true", "operator.watchNamespaces": "{team-a,team-b}",
                        **render.MONITORING_VALUES},
    # Two replicas with the defaults: each gets its own peering priority (finding 1).
    "ha-debug": {"operator.replicas": "2", "operator.logLevel": "debug", "image.tag": "0.1.1",
                 "serverImage.tag": "0.1.1", "serviceAccount.name": "pf-op", "peering.lifetime": "20"},
    "network-policy": {"networkPolicy.enabled": "true", "networkPolicy.namespaces": "{models,team-b}"},
    "network-policy-monitoring": {"networkPolicy.enabled": "true", "networkPolicy.namespaces": "{models}",
                                  **render.MONITORING_VALUES},
    "no-rbac-existing-sa": {"rbac.create": "false", "serviceAccount.create": "false",
                            "serviceAccount.name": "my-operator"},
    # The gateway: all namespaces (ClusterRole), or the one namespace of a namespaced install
    # (Roles only), with a key Secret it may read and the network policies.
    "gateway": {"gateway.enabled": "true"},
    "gateway-namespaced": {"gateway.enabled": "true", "rbac.namespaced": "true",
                           "operator.watchNamespaces": "{team-a}", "gateway.apiKeySecrets": "{team-a-key}",
                           "gateway.replicas": "1", "rbac.inferencePools": "false"},
    "gateway-network-policy": {"gateway.enabled": "true", "networkPolicy.enabled": "true",
                               "networkPolicy.namespaces": "{models}", "gateway.namespace": "models"},
    # Namespace patterns with peering (the default) and two replicas; with monitoring and
    # network policies for the exact namespaces.
    "namespace-patterns-ha": {"operator.watchNamespaces": "{team-*}", "operator.replicas": "2"},
    "namespace-patterns-monitoring": {"operator.watchNamespaces": "{team-a,team-*}", **render.MONITORING_VALUES,
                                      "networkPolicy.enabled": "true", "networkPolicy.namespaces": "{team-a,team-b}"},
    # Every image pinned by digest (the gateway's follows serverImage's).
    "digests": {"image.digest": "sha256:" + "a" * 64, "serverImage.digest": "sha256:" + "b" * 64,
                "serverImage.tag": "0.1.0", "gateway.enabled": "true"},
}
ALLOWED_VERBS = {"get", "list", "watch", "create", "patch", "delete"}


def _render(helm_bin: str, values: dict[str, str], include_crds: bool = True) -> list[dict[str, Any]]:
    return render.render(values, include_crds=include_crds, helm_path=helm_bin)


def _kinds(objs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for o in objs:
        out.setdefault(o["kind"], []).append(o)
    return out


def _set_args(values: dict[str, str]) -> list[str]:
    return [a for k, v in values.items() for a in ("--set", f"{k}={v}")]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_lint(helm_bin: str, name: str) -> None:
    res = subprocess.run([helm_bin, "lint", "--strict", str(CHART), *_set_args(VALUE_SETS[name])],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 chart(s) failed" in res.stdout


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_rendered_object_is_valid_kubernetes(helm_bin: str, name: str) -> None:
    objs = _render(helm_bin, VALUE_SETS[name])
    assert objs
    for obj in objs:
        for version in schemas.KUBE_VERSIONS:
            try:
                schemas.validate_k8s(obj, version)
            except Exception as e:  # noqa: BLE001 - report which object and version
                pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} invalid for "
                            f"Kubernetes {version}: {getattr(e, 'message', e)}")
        if obj["kind"] not in ("CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding", "Namespace"):
            assert obj["metadata"].get("namespace"), f"{obj['kind']} without a namespace"


def test_crds_are_the_operators_own(helm_bin: str) -> None:
    """crds/ and manifests/crd.yaml hold exactly what `pagefleet crd` prints."""
    crds = _kinds(_render(helm_bin, {}))["CustomResourceDefinition"]
    by_name = {c["metadata"]["name"]: c for c in crds}
    assert by_name[crd.CRD_NAME] == crd.crd_manifest()
    assert yaml.safe_load((render.MANIFESTS / "crd.yaml").read_text()) == crd.crd_manifest()
    assert {n for n in by_name if n.endswith(".kopf.dev")} == {"clusterkopfpeerings.kopf.dev",
                                                               "kopfpeerings.kopf.dev"}
    # CRDs are not templated: a `helm template` without --include-crds has none.
    assert "CustomResourceDefinition" not in _kinds(_render(helm_bin, {}, include_crds=False))


def _rules(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for o in objs if o["kind"] == kind for r in o.get("rules", [])]


def _grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(g, res, v) for r in rules for g in r["apiGroups"] for res in r["resources"] for v in r["verbs"]}


NAMESPACED_GRANTS = {
    ("pagefleet.dev", "modeldeployments", "get"), ("pagefleet.dev", "modeldeployments", "list"), ("pagefleet.dev", "modeldeployments", "watch"),
    ("pagefleet.dev", "modeldeployments", "patch"), ("pagefleet.dev", "modeldeployments/status", "patch"),
    # blockOwnerDeletion on the children (OwnerReferencesPermissionEnforcement, OpenShift)
    ("pagefleet.dev", "modeldeployments/finalizers", "update"),
    *{(g, r, v) for g, r in (("apps", "deployments"), ("", "services"), ("policy", "poddisruptionbudgets"))
      for v in ("get", "list", "watch", "create", "patch", "delete")},
    ("", "pods", "list"), ("", "pods", "watch"), ("", "persistentvolumeclaims", "get"), ("", "events", "create"),
    *{("inference.networking.k8s.io", "inferencepools", v) for v in ("get", "list", "create", "patch", "delete")},
}
CRD_GRANTS = {("apiextensions.k8s.io", "customresourcedefinitions", "list"),
              ("apiextensions.k8s.io", "customresourcedefinitions", "watch")}


def _peering(plural: str) -> set[tuple[str, str, str]]:
    return {("kopf.dev", plural, v) for v in ("get", "list", "watch", "create", "patch")}


def _is_gateway(obj: dict[str, Any]) -> bool:
    return obj["metadata"]["labels"].get("app.kubernetes.io/component") == "gateway"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rbac_has_no_wildcards_and_no_secrets(helm_bin: str, name: str) -> None:
    objs = _render(helm_bin, VALUE_SETS[name])
    for role in [o for o in objs if o["kind"] in ("ClusterRole", "Role")]:
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], f"wildcard in {key}: {rule}"
            if rule["resources"] == ["modeldeployments/finalizers"]:
                # The one update: what blockOwnerDeletion on the children needs
                # (OwnerReferencesPermissionEnforcement); nothing else can be updated.
                assert rule["verbs"] == ["update"], rule
                continue
            assert set(rule["verbs"]) <= ALLOWED_VERBS, rule
            assert not {"update", "deletecollection", "escalate", "bind", "impersonate"} & set(rule["verbs"])
            if "secrets" in rule["resources"]:
                # Only the gateway reads Secrets: get, by name, the ones the values list.
                assert _is_gateway(role) and rule["verbs"] == ["get"] and rule["resourceNames"], rule
            else:
                assert not rule.get("resourceNames"), rule
            # The API key reaches server pods through secretKeyRef; the operator never reads it.
            assert not (_is_gateway(role) is False and "secrets" in rule["resources"]), rule


def test_rbac_cluster_wide_is_exactly_what_the_operator_calls(helm_bin: str) -> None:
    objs = _render(helm_bin, {})
    assert _grants(_rules(objs, "ClusterRole")) == NAMESPACED_GRANTS | CRD_GRANTS | _peering("clusterkopfpeerings")
    assert not _rules(objs, "Role")
    (binding,) = _kinds(objs)["ClusterRoleBinding"]
    (sa,) = _kinds(objs)["ServiceAccount"]
    (dep,) = _kinds(objs)["Deployment"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": sa["metadata"]["namespace"]}]
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    # Standalone: no peering rules at all.
    standalone = _render(helm_bin, VALUE_SETS["standalone"])
    assert _grants(_rules(standalone, "ClusterRole")) == NAMESPACED_GRANTS | CRD_GRANTS


def test_rbac_namespaced_mode(helm_bin: str) -> None:
    """Exact namespace names: kopf does not scan, so no ClusterRole at all (finding 13)."""
    objs = _render(helm_bin, VALUE_SETS["namespaced-rbac"])
    assert "ClusterRole" not in _kinds(objs) and "ClusterRoleBinding" not in _kinds(objs)
    globs = _render(helm_bin, VALUE_SETS["namespaces-cluster-rbac"])
    assert _grants(_rules(globs, "ClusterRole")) == (NAMESPACED_GRANTS | CRD_GRANTS | _peering("kopfpeerings")
                                                     | {("", "namespaces", "list"), ("", "namespaces", "watch")})
    roles = _kinds(objs)["Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert _grants(role["rules"]) == NAMESPACED_GRANTS | _peering("kopfpeerings")
    bindings = _kinds(objs)["RoleBinding"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    args = _kinds(objs)["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args


def test_operator_deployment(helm_bin: str) -> None:
    (dep,) = _kinds(_render(helm_bin, {}))["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/pagefleet/pagefleet-operator:0.1.0"
    assert "--server-image=ghcr.io/pagefleet/pagefleet:0.1.0" in c["args"]
    assert "--peering=pagefleet" in c["args"] and "--standalone" not in c["args"]
    assert not any(a.startswith("--namespace") for a in c["args"])  # all namespaces
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["livenessProbe"]["httpGet"]["port"] == "health"
    assert {"name": "health", "containerPort": 8080, "protocol": "TCP"} in c["ports"]
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    # The args parse with the real CLI (no flag the operator does not know).
    from pagefleet.operator.cli import operator_parser

    operator_parser().parse_args(c["args"])
    ha = _kinds(_render(helm_bin, VALUE_SETS["ha-debug"]))["Deployment"][0]
    hc = ha["spec"]["template"]["spec"]["containers"][0]
    assert ha["spec"]["replicas"] == 2 and "--verbose" in hc["args"] and "--peering-lifetime=20" in hc["args"]
    assert not any(a.startswith("--priority") for a in hc["args"]), "each replica picks its own priority"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in hc["env"]
    assert hc["image"].endswith(":0.1.1")
    operator_parser().parse_args(hc["args"])
    standalone = _kinds(_render(helm_bin, VALUE_SETS["standalone"]))["Deployment"][0]
    assert "--standalone" in standalone["spec"]["template"]["spec"]["containers"][0]["args"]
    assert standalone["spec"]["strategy"]["type"] == "Recreate"


BAD_VALUES = [
    ({"operator.logLevel": "loud"}, "logLevel"),
    ({"operator.replicas": "-1"}, "replicas"),
    ({"operator.bogus": "1"}, "bogus"),
    ({"image.pullPolicy": "Sometimes"}, "pullPolicy"),
    ({"image.tag": "has space"}, "tag"),
    ({"operator.watchNamespaces": "{Team_A}"}, "watchNamespaces"),
    ({"monitoring.prometheusRule.kvCacheUsage.threshold": "1.5"}, "threshold"),
    ({"monitoring.prometheusRule.ttftP99.for": "five minutes"}, "for"),
    ({"monitoring.serviceMonitor.interval": "15"}, "interval"),
    ({"operator.extraArgs": "{verbose}"}, "extraArgs"),
    ({"peering.name": "Not_A_Name"}, "name"),
    ({"rbac.namespaced": "true"}, "watchNamespaces"),                       # template check
    ({"rbac.namespaced": "true", "operator.watchNamespaces": "{team-*}"}, "exact namespace"),
    ({"operator.replicas": "2", "peering.enabled": "false"}, "peering"),
    ({"serviceAccount.create": "false"}, "serviceAccount.name"),
    ({"operator.replicas": "2", "operator.extraArgs": "{--priority=10}"}, "same priority"),
    ({"networkPolicy.enabled": "true"}, "networkPolicy.namespaces"),
    ({"peering.lifetime": "1"}, "lifetime"),
    ({"gateway.enabled": "true", "operator.watchNamespaces": "{a,b}"}, "gateway.namespace"),
    ({"gateway.enabled": "true", "gateway.namespace": "team-*"}, "gateway/namespace"),
    ({"gateway.enabled": "true", "operator.watchNamespaces": "{team-*}"}, "one namespace name"),
    ({"gateway.enabled": "true", "rbac.namespaced": "true", "operator.watchNamespaces": "{a}",
      "gateway.namespace": "*"}, "a Role cannot cover all namespaces"),
    ({"gateway.port": "80"}, "port"),
    ({"gateway.apiKeySecrets": "{Not_A_Name}"}, "apiKeySecrets"),
    ({"gateway.bogus": "1"}, "bogus"),
    # Durations Prometheus refuses (units out of order, repeated).
    ({"monitoring.prometheusRule.ttftP99.for": "30s5m"}, "for"),
    ({"monitoring.serviceMonitor.interval": "1s1s"}, "interval"),
    ({"image.digest": "sha256:abc"}, "digest"),
    ({"serverImage.digest": "md5:" + "a" * 64}, "digest"),
    ({"networkPolicy.enabled": "true", "operator.watchNamespaces": "{team-a,team-*}"}, "needs networkPolicy.namespaces"),
]


@pytest.mark.parametrize("values,needle", BAD_VALUES, ids=[str(v) for v, _ in BAD_VALUES])
def test_bad_values_are_rejected(helm_bin: str, values: dict[str, str], needle: str) -> None:
    res = render.helm(*render.template_args(values), check=False, helm_path=helm_bin)
    assert res.returncode != 0, f"accepted {values}"
    assert needle in res.stderr, res.stderr


def test_notes_tell_the_next_step(helm_bin: str, tmp_path: Path) -> None:
    res = subprocess.run([helm_bin, "install", "pf", str(CHART), "--dry-run=client", "-n", "ml"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    notes = res.stdout.split("NOTES:", 1)[1]
    assert "rollout status deployment/pf-pagefleet-operator" in notes
    assert "kubectl apply -f manifests/examples/" in notes
    assert "monitoring.serviceMonitor.enabled=true" in notes  # monitoring is off: say how
    assert "gateway" not in notes
    res = subprocess.run([helm_bin, "install", "pf", str(CHART), "--dry-run=client", "-n", "ml",
                          "--set", "gateway.enabled=true"], capture_output=True, text=True)
    notes = res.stdout.split("NOTES:", 1)[1]
    assert "port-forward svc/pf-pagefleet-gateway 8080:8080" in notes and "all namespaces" in notes
    res = subprocess.run([helm_bin, "install", "pf", str(CHART), "--dry-run=client", "-n", "ml",
                          *_set_args(VALUE_SETS["namespace-patterns-monitoring"])], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "ServiceMonitor selects pagefleet's server Services in any namespace" in res.stdout.split("NOTES:", 1)[1]


# ------------------------------------------------------------------- monitoring

# The metrics pagefleet serves (DESIGN.md; vLLM's names). A rule or a panel on a
# name outside this list would silently show nothing.
SERVER_METRICS = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    *{f"{h}_{s}" for h in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                           "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds")
      for s in ("bucket", "sum", "count")},
    "vllm:cache_config_info", "vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_hits_total", "http_requests_total",
}
OTHER_METRICS = {"up", "prober_probe_total"}  # Prometheus' own and the kubelet's


def metric_names(expr: str) -> set[str]:
    """Parse a PromQL expression (raises on a syntax error) and return its metric names."""
    import promql_parser

    grafana = {"$__rate_interval": "5m", "$namespace": ".*", "$model": ".*"}
    for k, v in grafana.items():
        expr = expr.replace(k, v)
    parsed = str(promql_parser.parse(expr))
    return set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{", parsed))


def _monitoring(helm_bin: str) -> dict[str, list[dict[str, Any]]]:
    return _kinds(_render(helm_bin, render.MONITORING_VALUES, include_crds=False))


def _alerts(helm_bin: str) -> dict[str, dict[str, Any]]:
    (rule,) = _monitoring(helm_bin)["PrometheusRule"]
    return {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}


def test_monitoring_is_off_by_default(helm_bin: str) -> None:
    kinds = _kinds(_render(helm_bin, {}, include_crds=False))
    assert not {"ServiceMonitor", "PrometheusRule", "ConfigMap"} & set(kinds)


def test_alerts_are_the_ones_production_runs(helm_bin: str, tmp_path: Path) -> None:
    """Seed report 002: KV cache > 0.95 for 2 min, p99 TTFT > 2 s for 5 min, failing
    health checks > 5/min; seed 000: waiting > 0 for 10 s means saturated."""
    alerts = _alerts(helm_bin)
    kv = alerts["PagefleetKVCacheNearlyFull"]
    assert re.search(r"vllm:kv_cache_usage_perc\{[^}]*\}\) > 0\.95$", kv["expr"]) and kv["for"] == "2m"
    ttft = alerts["PagefleetTTFTP99High"]
    assert "histogram_quantile(0.99" in ttft["expr"] and "vllm:time_to_first_token_seconds_bucket" in ttft["expr"]
    assert ttft["expr"].rstrip().endswith("> 2") and ttft["for"] == "5m"
    queue = alerts["PagefleetQueueSaturated"]
    assert "vllm:num_requests_waiting" in queue["expr"] and queue["expr"].endswith("> 0") and queue["for"] == "10s"
    health = alerts["PagefleetHealthChecksFailing"]
    assert 'result="failed"' in health["expr"] and "[1m]" in health["expr"]
    # kubelet's probe series of any container named "server" (a common name): kept to
    # the pods pagefleet's ServiceMonitor scrapes.
    assert re.search(r'\) > 5\)\s+and on \(namespace, pod\) up\{job="pagefleet"\}$', health["expr"]), health["expr"]
    assert "up{" in alerts["PagefleetServerDown"]["expr"]
    # Seed 002: "dropped requests/s > 10": the servers' 429s and 503s, per Service.
    rejected = alerts["PagefleetRequestsRejected"]
    assert re.search(r'rate\(http_requests_total\{job="pagefleet",\s*status=~"429\|503"\}\[1m\]\)\)\s*> 10$',
                     rejected["expr"]), rejected["expr"]
    assert rejected["for"] == "2m" and "sum by (namespace, service)" in rejected["expr"]
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
        used = metric_names(rule["expr"])
        assert used and used <= SERVER_METRICS | OTHER_METRICS, (name, used)
        # Go template placeholders survived Helm's own templating.
        assert "{{ $labels." in rule["annotations"]["summary"] + rule["annotations"]["description"], name
    # Thresholds are values.
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"monitoring": {"prometheusRule": {
        "enabled": True, "kvCacheUsage": {"threshold": 0.9}, "ttftP99": {"for": "10m"},
        "rejections": {"perSecond": 2.5, "for": "5m"}}}}))
    tuned = _kinds(render.render(include_crds=False, helm_path=helm_bin, values_files=[values]))
    rules = {r["alert"]: r for g in tuned["PrometheusRule"][0]["spec"]["groups"] for r in g["rules"]}
    assert rules["PagefleetKVCacheNearlyFull"]["expr"].endswith("> 0.9")
    assert rules["PagefleetTTFTP99High"]["for"] == "10m"
    assert rules["PagefleetRequestsRejected"]["expr"].endswith("> 2.5")
    assert rules["PagefleetRequestsRejected"]["for"] == "5m"


def test_servicemonitor_selects_the_operators_services(helm_bin: str) -> None:
    from pagefleet.operator import resources
    from pagefleet.operator.spec import parse_spec

    (sm,) = _monitoring(helm_bin)["ServiceMonitor"]
    example = next(d for d in yaml.safe_load_all((render.MANIFESTS / "examples" / "short-qa.yaml").read_text())
                   if d and d["kind"] == crd.KIND)
    example["metadata"]["namespace"] = "default"
    svc = resources.service(parse_spec(example))
    labels = svc["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert endpoint["path"] == resources.METRICS_PATH
    # job="pagefleet" (what the rules select on) comes from this Service label.
    assert labels[sm["spec"]["jobLabel"]] == "pagefleet"
    assert sm["spec"]["namespaceSelector"] == {"any": True}
    scoped = _kinds(_render(helm_bin, VALUE_SETS["namespaced-rbac"], include_crds=False))["ServiceMonitor"][0]
    assert scoped["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}


def test_dashboard(helm_bin: str) -> None:
    (cm,) = _monitoring(helm_bin)["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["pagefleet.json"])
    assert dash == json.loads((CHART / "dashboards" / "pagefleet.json").read_text())
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("throughput", "time to first token", "inter-token", "running / waiting",
                  "kv cache", "prefix cache hit", "preemption", "replicas"):
        assert topic in titles, topic
    used: set[str] = set()
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used |= metric_names(target["expr"])
    assert used <= SERVER_METRICS | OTHER_METRICS, used - SERVER_METRICS - OTHER_METRICS
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


# ------------------------------------------------------------------- examples

def _example_docs() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, d) for p in sorted((render.MANIFESTS / "examples").glob("*.yaml"))
            for d in yaml.safe_load_all(p.read_text()) if d]


def test_examples_validate_against_the_crd_and_kubernetes() -> None:
    docs = _example_docs()
    names = {n for n, _ in docs}
    assert {"long-context.yaml", "short-qa.yaml", "autoscaling.yaml", "api-key.yaml"} <= names
    the_crd = crd.crd_manifest()
    for name, doc in docs:
        if doc["kind"] == crd.KIND:
            schemas.validate_cr(doc, the_crd)
        else:
            doc = dict(doc, metadata=dict(doc["metadata"], namespace="default"))
            for version in schemas.KUBE_VERSIONS:
                schemas.validate_k8s(doc, version)


def test_examples_split_long_context_from_short_qa() -> None:
    """Seed 000: a long-context deployment with few sequences, a short-QA one with
    many; an autoscaled one; one whose key comes from a Secret."""
    mdeps = {n: d for n, d in _example_docs() if d["kind"] == crd.KIND}
    long_, short = mdeps["long-context.yaml"]["spec"], mdeps["short-qa.yaml"]["spec"]
    assert long_["engine"]["maxModelLen"] >= 32768 > short["engine"]["maxModelLen"]
    assert long_["engine"]["maxNumSeqs"] < short["engine"]["maxNumSeqs"]
    assert mdeps["autoscaling.yaml"]["spec"]["autoscaling"]["enabled"] is True
    secret = next(d for n, d in _example_docs() if n == "api-key.yaml" and d["kind"] == "Secret")
    ref = mdeps["api-key.yaml"]["spec"]["apiKeySecretRef"]
    assert ref["name"] == secret["metadata"]["name"]
    assert ref.get("key", "api-key") in secret.get("stringData", secret.get("data", {}))


def test_bad_custom_resources_are_rejected_by_the_crd_schema() -> None:
    the_crd = crd.crd_manifest()
    good = {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "x"},
            "spec": {"model": "m", "engine": {"maxNumSeqs": 4}, "resources": {"memory": "8Gi"}}}
    schemas.validate_cr(good, the_crd)
    import jsonschema

    for bad_spec in ({"engine": {"maxNumSeqs": 0}}, {"engine": {"blockSize": 7}},
                     {"resources": {"memory": "lots"}}, {"model": ""}, {"replicas": -1},
                     {"engine": {"gpuMemoryUtilization": 0}}):
        bad = json.loads(json.dumps(good))
        bad["spec"].update(bad_spec)
        with pytest.raises(jsonschema.ValidationError):
            schemas.validate_cr(bad, the_crd)


# ------------------------------------------------------------- pod security

def test_pod_security_checker_can_fail() -> None:
    from tests.deploy.podsecurity import restricted_violations

    bad = {"hostNetwork": True, "volumes": [{"name": "h", "hostPath": {"path": "/"}}],
           "containers": [{"name": "c", "securityContext": {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}}}]}
    found = restricted_violations(bad)
    for needle in ("hostNetwork", "hostPath", "privileged", "SYS_ADMIN", "allowPrivilegeEscalation",
                   "runAsNonRoot", "seccompProfile", "drop ALL"):
        assert any(needle in v for v in found), (needle, found)


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_operator_and_gateway_pods_are_pod_security_restricted(helm_bin: str, name: str) -> None:
    from tests.deploy.podsecurity import restricted_violations

    deps = _kinds(_render(helm_bin, VALUE_SETS[name]))["Deployment"]
    assert len(deps) == (2 if VALUE_SETS[name].get("gateway.enabled") == "true" else 1)
    for dep in deps:
        assert restricted_violations(dep["spec"]["template"]["spec"]) == [], dep["metadata"]["name"]


def _rendered_examples() -> list[tuple[str, dict[str, Any]]]:
    """What the operator makes of every example: its Deployment, Service and PDB."""
    from pagefleet.operator import resources
    from pagefleet.operator.spec import parse_spec

    out = []
    pvcs = {d["metadata"]["name"]: d for _, d in _example_docs() if d["kind"] == "PersistentVolumeClaim"}
    for name, doc in _example_docs():
        if doc["kind"] != crd.KIND:
            continue
        doc = json.loads(json.dumps(doc))
        doc["metadata"].update(namespace="models", uid="6f1c1f3e-3f6a-4a55-9d2a-0c7d8f1b2a3c")
        spec = parse_spec(doc)
        claim = (doc["spec"].get("modelCache") or {}).get("claimName")
        modes = pvcs[claim]["spec"]["accessModes"] if claim else None
        replicas = resources.initial_replicas(spec, None)
        out += [(name, resources.deployment(spec, replicas, modes)), (name, resources.service(spec)),
                (name, resources.pod_disruption_budget(spec, replicas))]
    return out


@pytest.mark.parametrize("version", ["1.27", "1.35"])
def test_every_examples_objects_are_strictly_valid(version: str) -> None:
    for name, obj in _rendered_examples():
        try:
            schemas.validate_k8s(obj, version)
        except Exception as e:  # noqa: BLE001 - report which object
            pytest.fail(f"{name}: {obj['kind']} invalid for Kubernetes {version}: {getattr(e, 'message', e)}")


def test_every_examples_server_pods_are_pod_security_restricted() -> None:
    from tests.deploy.podsecurity import restricted_violations

    deployments = [(n, o) for n, o in _rendered_examples() if o["kind"] == "Deployment"]
    assert len(deployments) == 5
    for name, dep in deployments:
        assert restricted_violations(dep["spec"]["template"]["spec"]) == [], name


def test_long_context_example_rolls_without_a_surge_pod() -> None:
    """Finding 8: its cache PVC is ReadWriteOnce, so a surge pod elsewhere could never
    mount it; the operator replaces pods one at a time instead."""
    (dep,) = [o for n, o in _rendered_examples() if n == "long-context.yaml" and o["kind"] == "Deployment"]
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}


def test_network_policy_lets_the_operator_scrape_the_servers(helm_bin: str) -> None:
    from pagefleet.operator import resources
    from pagefleet.operator.spec import parse_spec

    objs = _kinds(_render(helm_bin, VALUE_SETS["network-policy"], include_crds=False))
    policies = {(p["metadata"]["namespace"], p["metadata"]["name"]): p for p in objs["NetworkPolicy"]}
    (op_dep,) = objs["Deployment"]
    op_labels = op_dep["spec"]["template"]["metadata"]["labels"]
    doc = next(d for n, d in _example_docs() if n == "short-qa.yaml" and d["kind"] == crd.KIND)
    doc = dict(doc, metadata=dict(doc["metadata"], namespace="models"))
    server_labels = resources.deployment(parse_spec(doc), 1)["spec"]["template"]["metadata"]["labels"]
    for ns in ("models", "team-b"):
        ingress = policies[(ns, "pagefleet-operator-scrape")]["spec"]
        assert ingress["podSelector"]["matchLabels"].items() <= server_labels.items()
        (rule,) = ingress["ingress"]
        (peer,) = rule["from"]
        assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": render.NAMESPACE}
        assert peer["podSelector"]["matchLabels"].items() <= op_labels.items()
        assert rule["ports"] == [{"protocol": "TCP", "port": resources.PORT}]
    egress = policies[(render.NAMESPACE, "pagefleet-operator-egress")]["spec"]
    assert egress["podSelector"]["matchLabels"].items() <= op_labels.items()
    to_servers = egress["egress"][-1]
    assert to_servers["ports"] == [{"protocol": "TCP", "port": resources.PORT}]
    assert to_servers["to"][0]["podSelector"]["matchLabels"].items() <= server_labels.items()
    assert "NetworkPolicy" not in _kinds(_render(helm_bin, {}, include_crds=False)), "off by default"


def test_network_policy_admits_prometheus_with_the_service_monitor(helm_bin: str) -> None:
    """The scrape policy isolates the server pods; with a ServiceMonitor the policy
    must let Prometheus in on the port the ServiceMonitor scrapes, or every server
    looks down (PagefleetServerDown)."""
    from pagefleet.operator import resources

    objs = _kinds(_render(helm_bin, VALUE_SETS["network-policy-monitoring"], include_crds=False))
    (monitor,) = objs["ServiceMonitor"]
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [resources.PORT_NAME]
    (policy,) = [p for p in objs["NetworkPolicy"] if p["metadata"]["name"] == "pagefleet-operator-scrape"]
    prometheus = [r for r in policy["spec"]["ingress"]
                  if any((p.get("podSelector") or {}).get("matchLabels") == {"app.kubernetes.io/name": "prometheus"}
                         for p in r["from"])]
    assert prometheus, policy["spec"]["ingress"]
    assert prometheus[0]["ports"] == [{"protocol": "TCP", "port": resources.PORT}]
    assert prometheus[0]["from"][0]["namespaceSelector"] == {}
    # Narrowed to the monitoring namespace; or turned off.
    narrowed = _kinds(_render(helm_bin, {**VALUE_SETS["network-policy-monitoring"],
                                         "networkPolicy.prometheusFrom[0].namespaceSelector.matchLabels"
                                         ".kubernetes\\.io/metadata\\.name": "monitoring"},
                              include_crds=False))["NetworkPolicy"]
    rules = next(p for p in narrowed if p["metadata"]["name"] == "pagefleet-operator-scrape")["spec"]["ingress"]
    assert rules[-1]["from"][0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    off = _kinds(_render(helm_bin, {**VALUE_SETS["network-policy-monitoring"], "networkPolicy.allowPrometheus": "false"},
                         include_crds=False))["NetworkPolicy"]
    assert len(next(p for p in off if p["metadata"]["name"] == "pagefleet-operator-scrape")["spec"]["ingress"]) == 1


# ------------------------------------------------------------------- the gateway

GATEWAY_GRANTS = {("pagefleet.dev", "modeldeployments", "list"), ("pagefleet.dev", "modeldeployments", "watch"),
                  ("", "pods", "list"), ("", "pods", "watch")}


def test_gateway_is_off_by_default(helm_bin: str) -> None:
    objs = _render(helm_bin, {}, include_crds=False)
    assert not [o for o in objs if _is_gateway(o)]
    (dep,) = _kinds(objs)["Deployment"]
    assert not any(a.startswith("--gateway-service") for a in dep["spec"]["template"]["spec"]["containers"][0]["args"])


def test_gateway_deployment_service_and_operator_flag(helm_bin: str) -> None:
    from pagefleet.operator import gateway as op_gateway
    from pagefleet.operator.cli import operator_parser
    from pagefleet.server.cli import build_gateway_config

    kinds = _kinds(_render(helm_bin, VALUE_SETS["gateway"], include_crds=False))
    deps = {d["metadata"]["name"]: d for d in kinds["Deployment"]}
    gw, op = deps["pagefleet-gateway"], deps["pagefleet-operator"]
    pod = gw["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert gw["spec"]["replicas"] == 2, "several replicas that share nothing"
    assert gw["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    assert c["image"] == "ghcr.io/pagefleet/pagefleet:0.1.0" and c["command"] == ["pagefleet", "gateway"]
    # The args parse into a valid config with the real CLI.
    cfg = build_gateway_config(c["args"])
    assert (cfg.discovery, cfg.namespace, cfg.host, cfg.port) == ("kubernetes", "*", "0.0.0.0", 8080)
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert {"name": "http", "containerPort": 8080, "protocol": "TCP"} in c["ports"]
    assert "nvidia.com/gpu" not in json.dumps(c["resources"])
    assert pod["automountServiceAccountToken"] is True and pod["serviceAccountName"] == "pagefleet-gateway"
    (svc,) = [s for s in kinds["Service"] if s["metadata"]["name"] == "pagefleet-gateway"]
    labels = gw["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}]
    (pdb,) = kinds["PodDisruptionBudget"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # The operator scrapes every replica behind that Service.
    args = op["spec"]["template"]["spec"]["containers"][0]["args"]
    (flag,) = [a for a in args if a.startswith("--gateway-service=")]
    ref = op_gateway.parse_ref(flag.split("=", 1)[1])
    assert (ref.namespace, ref.name) == (render.NAMESPACE, svc["metadata"]["name"])
    assert ref.port in {p["name"] for p in svc["spec"]["ports"]}
    operator_parser().parse_args(args)
    # One namespace: the gateway watches it; one replica: no PDB.
    one = _kinds(_render(helm_bin, VALUE_SETS["gateway-namespaced"], include_crds=False))
    gw1 = next(d for d in one["Deployment"] if d["metadata"]["name"] == "pagefleet-gateway")
    assert build_gateway_config(gw1["spec"]["template"]["spec"]["containers"][0]["args"]).namespace == "team-a"
    assert "PodDisruptionBudget" not in one


def test_gateway_rbac_is_exactly_what_the_gateway_calls(helm_bin: str) -> None:
    """Read-only: list + watch of ModelDeployments and pods (server/gateway/kube.py),
    get of the named key Secrets only; the operator may list the gateway's
    EndpointSlices in the release namespace only."""
    objs = _render(helm_bin, VALUE_SETS["gateway"], include_crds=False)
    (role,) = [o for o in objs if o["kind"] == "ClusterRole" and _is_gateway(o)]
    assert _grants(role["rules"]) == GATEWAY_GRANTS
    (binding,) = [o for o in objs if o["kind"] == "ClusterRoleBinding" and _is_gateway(o)]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pagefleet-gateway", "namespace": render.NAMESPACE}]
    (ep_role,) = [o for o in objs if o["kind"] == "Role"]
    assert ep_role["metadata"]["namespace"] == render.NAMESPACE
    assert _grants(ep_role["rules"]) == {("discovery.k8s.io", "endpointslices", "list")}
    (ep_binding,) = [o for o in objs if o["kind"] == "RoleBinding"]
    assert ep_binding["subjects"][0]["name"] == "pagefleet-operator"
    # The operator's own ClusterRole is unchanged by the gateway.
    op_role = [o for o in objs if o["kind"] == "ClusterRole" and not _is_gateway(o)]
    assert _grants(op_role[0]["rules"]) == NAMESPACED_GRANTS | CRD_GRANTS | _peering("clusterkopfpeerings")
    # Namespaced install: Roles only, the Secret by name, no InferencePool rule.
    ns = _render(helm_bin, VALUE_SETS["gateway-namespaced"], include_crds=False)
    assert "ClusterRole" not in _kinds(ns)
    (gw_role,) = [o for o in ns if o["kind"] == "Role" and _is_gateway(o)]
    assert gw_role["metadata"]["namespace"] == "team-a"
    secret_rule = next(r for r in gw_role["rules"] if "secrets" in r["resources"])
    assert secret_rule == {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["team-a-key"], "verbs": ["get"]}
    assert _grants(gw_role["rules"]) == GATEWAY_GRANTS | {("", "secrets", "get")}
    op_roles = [o for o in ns if o["kind"] == "Role" and o["metadata"]["name"] == "pagefleet-operator"]
    assert _grants(op_roles[0]["rules"]) == {g for g in NAMESPACED_GRANTS if g[0] != "inference.networking.k8s.io"} \
        | _peering("kopfpeerings")


def test_network_policy_lets_the_gateway_reach_the_servers_and_the_operator_the_gateway(helm_bin: str) -> None:
    from pagefleet.operator import resources
    from pagefleet.operator.spec import parse_spec

    objs = _kinds(_render(helm_bin, VALUE_SETS["gateway-network-policy"], include_crds=False))
    policies = {(p["metadata"]["namespace"], p["metadata"]["name"]): p["spec"] for p in objs["NetworkPolicy"]}
    deps = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in objs["Deployment"]}
    gw_labels, op_labels = deps["pagefleet-gateway"], deps["pagefleet-operator"]
    doc = next(d for n, d in _example_docs() if n == "short-qa.yaml" and d["kind"] == crd.KIND)
    doc = dict(doc, metadata=dict(doc["metadata"], namespace="models"))
    server_labels = resources.deployment(parse_spec(doc), 1)["spec"]["template"]["metadata"]["labels"]

    def allows(rule: dict[str, Any], labels: dict[str, str], port: int) -> bool:
        return any(peer.get("podSelector", {}).get("matchLabels", {}).items() <= labels.items()
                   for peer in rule.get("from", rule.get("to", [{}]))) and \
            {"protocol": "TCP", "port": port} in rule["ports"]

    scrape = policies[("models", "pagefleet-operator-scrape")]
    assert any(allows(r, gw_labels, resources.PORT) for r in scrape["ingress"]), "gateway -> servers"
    assert any(allows(r, op_labels, resources.PORT) for r in scrape["ingress"]), "operator -> servers"
    ingress = policies[(render.NAMESPACE, "pagefleet-gateway-ingress")]
    assert ingress["podSelector"]["matchLabels"].items() <= gw_labels.items()
    assert allows(ingress["ingress"][0], op_labels, 8080), "operator -> the gateway's /metrics"
    assert ingress["ingress"][1] == {"ports": [{"protocol": "TCP", "port": 8080}]}, "clients (the default)"
    # The clients' default follows gateway.port.
    moved = _kinds(_render(helm_bin, {**VALUE_SETS["gateway-network-policy"], "gateway.port": "9090"},
                           include_crds=False))["NetworkPolicy"]
    moved_ingress = next(p["spec"] for p in moved if p["metadata"]["name"] == "pagefleet-gateway-ingress")
    assert moved_ingress["ingress"][1] == {"ports": [{"protocol": "TCP", "port": 9090}]}
    op_egress = policies[(render.NAMESPACE, "pagefleet-operator-egress")]
    assert any(allows(r, gw_labels, 8080) for r in op_egress["egress"])
    gw_egress = policies[(render.NAMESPACE, "pagefleet-gateway-egress")]
    assert gw_egress["podSelector"]["matchLabels"].items() <= gw_labels.items()
    assert any(allows(r, server_labels, resources.PORT) for r in gw_egress["egress"])


# ------------------------------------------------------------- images, namespace patterns

def test_images_pinned_by_digest(helm_bin: str) -> None:
    """docs/deploy.md (CKV_K8S_43): the operator, server and gateway images by digest."""
    from pagefleet.operator.cli import operator_parser

    a, b = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    deps = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
            for d in _kinds(_render(helm_bin, VALUE_SETS["digests"], include_crds=False))["Deployment"]}
    op, gw = deps["pagefleet-operator"], deps["pagefleet-gateway"]
    assert op["image"] == f"ghcr.io/pagefleet/pagefleet-operator@{a}"
    assert f"--server-image=ghcr.io/pagefleet/pagefleet:0.1.0@{b}" in op["args"]
    assert gw["image"] == f"ghcr.io/pagefleet/pagefleet:0.1.0@{b}"
    assert operator_parser().parse_args(op["args"]).server_image.endswith(b)
    # A gateway image of its own does not inherit the server's digest.
    own = _kinds(_render(helm_bin, {**VALUE_SETS["digests"], "gateway.image.repository": "reg/gw"},
                         include_crds=False))["Deployment"]
    gw_own = next(d for d in own if d["metadata"]["name"] == "pagefleet-gateway")
    assert gw_own["spec"]["template"]["spec"]["containers"][0]["image"] == "reg/gw:0.1.0"


def test_namespace_patterns_stay_out_of_per_namespace_objects(helm_bin: str) -> None:
    """A pattern in operator.watchNamespaces is no namespace: the ServiceMonitor then
    selects any namespace (matchNames is exact), NetworkPolicies go to the explicit
    networkPolicy.namespaces (required then: see BAD_VALUES), and the operator gets the
    pattern and the cluster reads it needs (peering: KopfPeerings in any namespace)."""
    objs = _render(helm_bin, VALUE_SETS["namespace-patterns-monitoring"], include_crds=False)
    kinds = _kinds(objs)
    for obj in objs:
        assert "*" not in obj["metadata"].get("namespace", ""), (obj["kind"], obj["metadata"])
    (sm,) = kinds["ServiceMonitor"]
    assert sm["spec"]["namespaceSelector"] == {"any": True}
    assert sorted(p["metadata"]["namespace"] for p in kinds["NetworkPolicy"]
                  if p["metadata"]["name"].endswith("-scrape")) == ["team-a", "team-b"]
    explicit = _kinds(_render(helm_bin, {**VALUE_SETS["namespace-patterns-monitoring"],
                                         "monitoring.serviceMonitor.namespaces": "{team-a,team-b}"},
                              include_crds=False))["ServiceMonitor"][0]
    assert explicit["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    ha = _render(helm_bin, VALUE_SETS["namespace-patterns-ha"])
    (dep,) = _kinds(ha)["Deployment"]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-*" in args and "--standalone" not in args and dep["spec"]["replicas"] == 2
    assert _grants(_rules(ha, "ClusterRole")) >= _peering("kopfpeerings") | {("", "namespaces", "list"),
                                                                             ("", "namespaces", "watch")}
