"""Validation helpers: Kubernetes schemas (kubernetes-validate), our CRD's
openAPIV3Schema, and a structural schema for the prometheus-operator kinds we render
(only the fields we use, typed as monitoring.coreos.com/v1 types them)."""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

import jsonschema
import kubernetes_validate
import kubernetes_validate.utils

# kubernetes-validate reads a kind's schema and the 1.5 MB definitions file from disk
# on every call; the chart and manifest tests validate each object against nine
# minors, so the reads are cached (the schemas are only read, never changed).
kubernetes_validate.utils.schema_contents = functools.lru_cache(maxsize=None)(
    kubernetes_validate.utils.schema_contents)

# The Kubernetes minors we promise to install on (Chart.yaml kubeVersion >= 1.27).
KUBE_VERSIONS = ("1.27", "1.28", "1.29", "1.30", "1.31", "1.32", "1.33", "1.34", "1.35")
PROM_DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {"type": "object", "required": ["name", "namespace"],
         "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                        "namespace": {"type": "string"}, "labels": _STR_MAP, "annotations": _STR_MAP}}
_SELECTOR = {"type": "object", "additionalProperties": False,
             "properties": {"matchLabels": _STR_MAP, "matchExpressions": {"type": "array"}}}

MONITORING_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"}, "metadata": _META,
            "spec": {"type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
                     "properties": {
                         "jobLabel": {"type": "string"},
                         "selector": _SELECTOR,
                         "namespaceSelector": {"type": "object", "additionalProperties": False,
                                               "properties": {"any": {"type": "boolean"},
                                                              "matchNames": {"type": "array", "items": {"type": "string"}}}},
                         "endpoints": {"type": "array", "minItems": 1, "items": {
                             "type": "object", "additionalProperties": False,
                             "properties": {"port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                                            "interval": {"type": "string", "pattern": PROM_DURATION},
                                            "scrapeTimeout": {"type": "string", "pattern": PROM_DURATION},
                                            "honorLabels": {"type": "boolean"}}}}}}}},
    "PrometheusRule": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"}, "metadata": _META,
            "spec": {"type": "object", "additionalProperties": False, "properties": {
                "groups": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False, "required": ["name", "rules"],
                    "properties": {"name": {"type": "string", "minLength": 1},
                                   "interval": {"type": "string", "pattern": PROM_DURATION},
                                   "rules": {"type": "array", "items": {
                                       "type": "object", "additionalProperties": False, "required": ["expr"],
                                       "properties": {"alert": {"type": "string"}, "record": {"type": "string"},
                                                      "expr": {"anyOf": [{"type": "string", "minLength": 1},
                                                                         {"type": "integer"}]},
                                                      "for": {"type": "string", "pattern": PROM_DURATION},
                                                      "labels": _STR_MAP, "annotations": _STR_MAP}}}}}}}}}},
}


def validate_k8s(obj: dict[str, Any], version: str) -> None:
    """Raise on an object that the Kubernetes `version` API would reject (strict: no
    unknown fields)."""
    if obj["apiVersion"].startswith("monitoring.coreos.com/"):
        jsonschema.validate(obj, MONITORING_SCHEMAS[obj["kind"]])
        return
    kubernetes_validate.validate(obj, version, strict=True)


def _structural(schema: Any) -> Any:
    """A CRD openAPIV3Schema as a JSON schema: int-or-string admits both."""
    if isinstance(schema, dict):
        out = {k: _structural(v) for k, v in schema.items()}
        if out.pop("x-kubernetes-int-or-string", False):
            out.pop("type", None)
            pattern = out.pop("pattern", None)
            out["anyOf"] = [{"type": "integer"}, {"type": "string", **({"pattern": pattern} if pattern else {})}]
        for key in [k for k in out if k.startswith("x-kubernetes-")]:
            out.pop(key)
        return out
    if isinstance(schema, list):
        return [_structural(i) for i in schema]
    return schema


def validate_cr(obj: dict[str, Any], crd: dict[str, Any]) -> None:
    """Validate a custom resource against its CRD's schema (as the API server would,
    minus CEL rules, which are checked by the operator's spec parser too)."""
    group = crd["spec"]["group"]
    api_version, kind = obj["apiVersion"], obj["kind"]
    assert kind == crd["spec"]["names"]["kind"], kind
    version = next(v for v in crd["spec"]["versions"] if f"{group}/{v['name']}" == api_version)
    schema = _structural(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
    # openAPIV3 (draft 4): exclusiveMinimum is a boolean.
    jsonschema.Draft4Validator(schema).validate(obj)
    name = obj["metadata"]["name"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, name


# Gateway API Inference Extension, inference.networking.k8s.io/v1 InferencePool: the
# fields the operator writes, typed and bounded as the API's Go types declare them
# (api/v1/inferencepool_types.go: selector.matchLabels, one targetPort 1..65535,
# endpointPickerRef with a name, kind Service by default, failureMode FailOpen|FailClose,
# and the CEL rule "kind != 'Service' || has(port)", checked by validate_inference_pool).
_PORT = {"type": "object", "additionalProperties": False, "required": ["number"],
         "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
INFERENCE_POOL_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"}, "kind": {"const": "InferencePool"},
        "metadata": _META,
        "spec": {"type": "object", "additionalProperties": False,
                 "required": ["selector", "targetPorts", "endpointPickerRef"],
                 "properties": {
                     "selector": {"type": "object", "additionalProperties": False, "required": ["matchLabels"],
                                  "properties": {"matchLabels": {**_STR_MAP, "minProperties": 1}}},
                     "targetPorts": {"type": "array", "minItems": 1, "maxItems": 1, "items": _PORT},
                     "endpointPickerRef": {
                         "type": "object", "additionalProperties": False, "required": ["name"],
                         "properties": {
                             "group": {"type": "string", "maxLength": 253},
                             "kind": {"type": "string", "minLength": 1, "maxLength": 63,
                                      "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"},
                             "name": {"type": "string", "minLength": 1, "maxLength": 253},
                             "port": _PORT,
                             "failureMode": {"enum": ["FailOpen", "FailClose"]}}}}}}}


def validate_inference_pool(obj: dict[str, Any]) -> None:
    jsonschema.validate(obj, INFERENCE_POOL_SCHEMA)
    ref = obj["spec"]["endpointPickerRef"]
    if ref.get("kind", "Service") == "Service" and "port" not in ref:
        raise jsonschema.ValidationError("endpointPickerRef: port is required when kind is 'Service'")

