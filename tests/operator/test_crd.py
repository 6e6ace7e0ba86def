"""The CRD: committed copies do not drift, its schema (and CEL rule) accepts the
examples and rejects invalid ModelDeployments, in agreement with parse_spec."""

from __future__ import annotations

import copy
import operator as op
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from pagefleet.operator import crd
from pagefleet.operator.spec import SpecError, apply_defaults, parse_spec
from pagefleet.server.cli import main as pagefleet_main

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "manifests" / "examples").glob("*.yaml"))


def test_committed_crd_yaml_matches_the_generator() -> None:
    expected = crd.crd_yaml()
    for path in ("charts/pagefleet/crds/modeldeployment.yaml", "manifests/crd.yaml"):
        assert (REPO / path).read_text() == expected, f"{path} drifted: run `pagefleet crd > {path}`"
    assert (REPO / "charts/pagefleet/crds/kopf-peering.yaml").read_text() == crd.peering_crds_yaml()


def test_pagefleet_crd_command_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert pagefleet_main(["crd"]) == 0
    out = capsys.readouterr().out
    assert out == crd.crd_yaml()
    assert yaml.safe_load(out) == crd.crd_manifest()
    assert pagefleet_main(["crd", "--peering"]) == 0
    kinds = [d["spec"]["names"]["kind"] for d in yaml.safe_load_all(capsys.readouterr().out)]
    assert kinds == ["ClusterKopfPeering", "KopfPeering"]


def test_crd_shape() -> None:
    m = crd.crd_manifest()
    spec = m["spec"]
    assert (m["metadata"]["name"], spec["group"], spec["scope"]) == (
        "modeldeployments.pagefleet.dev", "pagefleet.dev", "Namespaced")
    assert spec["names"]["kind"] == "ModelDeployment" and spec["names"]["shortNames"] == ["mdep"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Model", "Replicas", "Ready", "Waiting", "Age"]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert {"observedGeneration", "replicas", "readyReplicas", "desiredReplicas", "waitingRequests",
            "selector", "endpoint", "lastScaleTime", "conditions"} <= status.keys()


# --- the schema as the API server would apply it --------------------------------

SCHEMA = crd.crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def cel_rules(schema: dict[str, Any], path: str = "spec") -> list[tuple[str, dict[str, Any]]]:
    """(json path of the object, rule) for every x-kubernetes-validations entry."""
    out = [(path, rule) for rule in schema.get("x-kubernetes-validations", [])]
    for key, sub in schema.get("properties", {}).items():
        out += cel_rules(sub, f"{path}.{key}")
    return out


_CMP = {"<=": op.le, "<": op.lt, ">=": op.ge, ">": op.gt, "==": op.eq, "!=": op.ne}


def _cel_string(value: Any) -> str:
    """CEL's string() of an int or a string (an IntOrString is CEL `dyn`)."""
    assert isinstance(value, (int, str)) and not isinstance(value, bool), value
    return str(value)


def eval_cel(rule: str, obj: dict[str, Any]) -> bool:
    """The subset of CEL our rules use: `self.a <op> self.b`, and "not both of two
    optional fields in a set of values" (`!has(self.a) || !has(self.b) ||
    !(string(self.a) in [...] && string(self.b) in [...])`). Anything else fails the
    test, so a new rule cannot go unchecked."""
    m = re.fullmatch(r"self\.(\w+) (<=|<|>=|>|==|!=) self\.(\w+)", rule)
    if m:
        return _CMP[m.group(2)](obj[m.group(1)], obj[m.group(3)])
    m = re.fullmatch(r"!has\(self\.(\w+)\) \|\| !has\(self\.(\w+)\) \|\| "
                     r"!\(string\(self\.\1\) in \[([^]]*)\] && string\(self\.\2\) in \[([^]]*)\]\)", rule)
    assert m, f"eval_cel does not understand {rule!r}; extend it"
    a, b = m.group(1), m.group(2)
    if a not in obj or b not in obj:
        return True
    values_a, values_b = (set(re.findall(r"'([^']*)'", m.group(i))) for i in (3, 4))
    return not (_cel_string(obj[a]) in values_a and _cel_string(obj[b]) in values_b)


def schema_errors(doc: dict[str, Any]) -> list[str]:
    """API-server-like validation: defaulting, then openAPIV3 (draft 4 semantics, as
    Kubernetes uses), then the CEL rules. Returns the offending field paths."""
    doc = copy.deepcopy(doc)
    if isinstance(doc.get("spec"), dict):
        apply_defaults(crd.spec_schema(), doc["spec"])
    errors = [".".join(str(p) for p in e.absolute_path) or "<root>"
              for e in jsonschema.Draft4Validator(SCHEMA).iter_errors(doc)]
    errors = [("spec" if e == "<root>" else e) for e in errors]
    if not errors:
        for path, rule in cel_rules(SCHEMA["properties"]["spec"]):
            obj: Any = doc
            for part in path.split("."):
                obj = obj.get(part) if isinstance(obj, dict) else None
            if isinstance(obj, dict) and not eval_cel(rule["rule"], obj):
                errors.append(path + rule.get("fieldPath", ""))
    return errors


def test_cel_rule_logic() -> None:
    rules = dict(cel_rules(SCHEMA["properties"]["spec"]))
    assert set(rules) == {"spec.autoscaling", "spec.rollout"}
    rule = rules["spec.autoscaling"]
    assert rule["rule"] == crd.MIN_MAX_RULE
    assert eval_cel(rule["rule"], {"minReplicas": 1, "maxReplicas": 4})
    assert eval_cel(rule["rule"], {"minReplicas": 3, "maxReplicas": 3})
    assert not eval_cel(rule["rule"], {"minReplicas": 5, "maxReplicas": 4})
    # With defaults applied first (as the API server does) a lone minReplicas is checked too.
    assert schema_errors({"spec": {"model": "m", "autoscaling": {"minReplicas": 6}}}) == [
        "spec.autoscaling"]
    # No fieldPath/reason: Kubernetes 1.27's CRD schema has neither (strict validation fails).
    assert set(rule) == {"rule", "message"}


@pytest.mark.parametrize("rollout,ok", [
    ({"maxSurge": 0, "maxUnavailable": 0}, False),
    ({"maxSurge": "0%", "maxUnavailable": 0}, False),
    ({"maxSurge": 0, "maxUnavailable": "0%"}, False),
    ({"maxSurge": "0%", "maxUnavailable": "0%"}, False),
    ({"maxSurge": 0, "maxUnavailable": 1}, True),
    ({"maxSurge": 0, "maxUnavailable": "10%"}, True),
    ({"maxSurge": "10%", "maxUnavailable": 0}, True),
    ({"maxSurge": 0}, True),                      # the unset one takes a non-zero default
    ({"maxUnavailable": 0}, True),
    ({}, True),
])
def test_rollout_cel_rule_refuses_both_zero(rollout: dict[str, Any], ok: bool) -> None:
    """Kubernetes refuses a Deployment with maxSurge and maxUnavailable both 0 (no pod
    could ever be replaced); the CRD refuses it at `kubectl apply`, as parse_spec does."""
    rule = dict(cel_rules(SCHEMA["properties"]["spec"]))["spec.rollout"]
    assert (rule["rule"], set(rule)) == (crd.ROLLOUT_RULE, {"rule", "message"})
    assert eval_cel(rule["rule"], rollout) is ok
    assert schema_errors({"spec": {"model": "m", "rollout": rollout}}) == ([] if ok else ["spec.rollout"])
    if ok:
        parse_spec({"metadata": {"name": "m"}, "spec": {"model": "m", "rollout": rollout}})
    else:
        with pytest.raises(SpecError):
            parse_spec({"metadata": {"name": "m"}, "spec": {"model": "m", "rollout": rollout}})


@pytest.mark.parametrize("spec", [
    {"rollout": {"maxSurge": "150%", "maxUnavailable": "100%"}},
    {"rollout": {"maxSurge": 3, "maxUnavailable": "0%"}},
    {"startupTimeoutSeconds": 60},
    {"startupTimeoutSeconds": 14400},
])
def test_schema_and_operator_accept_the_same_rollout_and_startup_values(spec: dict[str, Any]) -> None:
    doc = {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "m"},
           "spec": {"model": "m", **spec}}
    assert schema_errors(doc) == []
    parsed = parse_spec(doc)
    rollout = spec.get("rollout", {})
    assert (parsed.rollout.max_surge, parsed.rollout.max_unavailable) == (
        rollout.get("maxSurge"), rollout.get("maxUnavailable"))
    assert parsed.startup_timeout_seconds == spec.get("startupTimeoutSeconds", crd.DEFAULT_STARTUP_TIMEOUT_S)


def model_deployments(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == crd.KIND]


def test_there_are_examples() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"long-context.yaml", "short-qa.yaml", "autoscaling.yaml", "api-key.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid(path: Path) -> None:
    docs = model_deployments(path)
    assert docs, f"{path.name} holds no ModelDeployment"
    for doc in docs:
        assert doc["apiVersion"] == crd.API_VERSION
        assert schema_errors(doc) == []
        parse_spec(doc)  # and the operator agrees


def _with(spec_changes: dict[str, Any]) -> dict[str, Any]:
    doc = model_deployments(REPO / "manifests/examples/long-context.yaml")[0]
    doc = copy.deepcopy(doc)
    for dotted, value in spec_changes.items():
        obj = doc["spec"]
        *parents, last = dotted.split(".")
        for p in parents:
            obj = obj.setdefault(p, {})
        if value is _DELETE:
            obj.pop(last, None)
        else:
            obj[last] = value
    return doc


_DELETE = object()

INVALID = [
    ({"engine.gpuMemoryUtilization": 1.5}, "spec.engine.gpuMemoryUtilization"),
    ({"engine.gpuMemoryUtilization": 0}, "spec.engine.gpuMemoryUtilization"),
    ({"model": _DELETE}, "spec.model"),
    ({"model": ""}, "spec.model"),
    ({"engine.maxModelLen": 0}, "spec.engine.maxModelLen"),
    ({"engine.blockSize": 24}, "spec.engine.blockSize"),
    ({"engine.kvCacheDtype": "int3"}, "spec.engine.kvCacheDtype"),
    ({"engine.schedulingPolicy": "lifo"}, "spec.engine.schedulingPolicy"),
    ({"replicas": -1}, "spec.replicas"),
    ({"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}, "spec.autoscaling.minReplicas"),
    ({"autoscaling": {"targetWaitingRequests": 0}}, "spec.autoscaling.targetWaitingRequests"),
    ({"autoscaling": {"intervalSeconds": 0}}, "spec.autoscaling.intervalSeconds"),
    ({"autoscaling": {"metric": "has spaces"}}, "spec.autoscaling.metric"),
    ({"resources.memory": "lots"}, "spec.resources.memory"),
    ({"resources.gpus": -1}, "spec.resources.gpus"),
    ({"resources.gpus": 9}, "spec.resources.gpus"),
    ({"engine.quantization": "nf4"}, "spec.engine.quantization"),
    ({"tolerations": [{"operator": 1}]}, "spec.tolerations.0.operator"),
    ({"env": [{"value": "x"}]}, "spec.env.0.name"),
    ({"topologySpreadConstraints": [{"maxSkew": "one", "topologyKey": "k", "whenUnsatisfiable": "x"}]},
     "spec.topologySpreadConstraints.0.maxSkew"),
    ({"apiKeySecretRef": {"key": "k"}}, "spec.apiKeySecretRef.name"),
    ({"modelCache": {"mountPath": "/x"}}, "spec.modelCache.claimName"),
    ({"autoscaling": {"minReplicas": -1}}, "spec.autoscaling.minReplicas"),
    ({"autoscaling": {"scaleToZeroIdleSeconds": 0}}, "spec.autoscaling.scaleToZeroIdleSeconds"),
    ({"gateway": {"weight": -1}}, "spec.gateway.weight"),
    ({"gateway": {"queueTimeoutSeconds": 0}}, "spec.gateway.queueTimeoutSeconds"),
    ({"gateway": {"queueTimeoutSeconds": 100000}}, "spec.gateway.queueTimeoutSeconds"),
    ({"gateway": {"inferencePool": {"enabled": True}}}, "spec.gateway.inferencePool.endpointPicker"),
    ({"gateway": {"inferencePool": {"endpointPicker": {"name": "e", "failureMode": "Maybe"}}}},
     "spec.gateway.inferencePool.endpointPicker.failureMode"),
    ({"gateway": {"inferencePool": {"endpointPicker": {"name": "e", "port": 70000}}}},
     "spec.gateway.inferencePool.endpointPicker.port"),
    ({"rollout": {"maxSurge": 0, "maxUnavailable": 0}}, "spec.rollout"),
    ({"rollout": {"maxSurge": -1}}, "spec.rollout.maxSurge"),
    ({"rollout": {"maxSurge": "1"}}, "spec.rollout.maxSurge"),
    ({"rollout": {"maxSurge": "01%"}}, "spec.rollout.maxSurge"),
    ({"rollout": {"maxSurge": 1.5}}, "spec.rollout.maxSurge"),
    ({"rollout": {"maxUnavailable": "101%"}}, "spec.rollout.maxUnavailable"),
    ({"rollout": {"maxUnavailable": -2}}, "spec.rollout.maxUnavailable"),
    ({"startupTimeoutSeconds": 59}, "spec.startupTimeoutSeconds"),
    ({"startupTimeoutSeconds": 14401}, "spec.startupTimeoutSeconds"),
    ({"startupTimeoutSeconds": "30m"}, "spec.startupTimeoutSeconds"),
]


@pytest.mark.parametrize("changes,field", INVALID, ids=[f for _, f in INVALID])
def test_schema_and_operator_reject_the_same_field(changes: dict[str, Any], field: str) -> None:
    doc = _with(changes)
    errors = schema_errors(doc)
    # jsonschema reports 'required' at the parent; normalise to the missing field.
    assert field in errors or any(field.rsplit(".", 1)[0] == e for e in errors), errors
    with pytest.raises(SpecError) as e:
        parse_spec(doc)
    assert e.value.field == re.sub(r"\.(\d+)", r"[\1]", field)


def _walk(schema: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    out = [(path, schema)]
    for key, sub in (schema.get("properties") or {}).items():
        out += _walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        out += _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        out += _walk(schema["additionalProperties"], f"{path}{{}}")
    return out


def test_every_field_has_a_description() -> None:
    """What `kubectl explain mdep.spec...` prints: no field without one (list items and
    map values are described by their field)."""
    missing = [path for path, sub in _walk(SCHEMA, "ModelDeployment")
               if not path.endswith(("[]", "{}")) and not (sub.get("description") or "").strip()]
    assert not missing, missing
    assert len(_walk(SCHEMA, "ModelDeployment")) > 400, "core types (affinity, volumes...) are spelled out"


def test_vendored_core_types_match_the_kubernetes_openapi() -> None:
    from tests.operator import gen_coretypes

    assert gen_coretypes.OUTPUT.read_text() == gen_coretypes.render(), (
        "operator/coretypes.json drifted: run `python tests/operator/gen_coretypes.py --write`")


def test_gpus_are_bounded_and_quantization_matches_the_server() -> None:
    from pagefleet.server.config import QUANTIZATION_METHODS

    spec = SCHEMA["properties"]["spec"]["properties"]
    assert (spec["resources"]["properties"]["gpus"]["minimum"], spec["resources"]["properties"]["gpus"]["maximum"]) == (0, 8)
    assert spec["engine"]["properties"]["quantization"]["enum"] == list(QUANTIZATION_METHODS)
