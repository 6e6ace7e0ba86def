"""The `ModelDeployment` CustomResourceDefinition, in one place.

Everything the API server needs to know about the resource lives here: the
openAPIV3 schema (types, ranges, enums, defaults, the CEL rule for min <= max),
the status and scale subresources and the printer columns. `pagefleet crd` prints
it; `charts/pagefleet/crds/` and `manifests/crd.yaml` hold that output verbatim and
a test fails when they drift. `spec.py` applies the same defaults (an API server
would, the test emulator does not) and re-checks the same rules, so a CR that slipped
past validation (or an emulator without any) still gets a clear error.

Engine enums come from the server's own config dataclasses, so the CRD accepts
exactly the values `pagefleet serve` accepts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from pagefleet.server.config import EngineConfig

GROUP = "pagefleet.dev"
VERSION = "v1alpha1"
PLURAL = "modeldeployments"
SINGULAR = "modeldeployment"
KIND = "ModelDeployment"
SHORT_NAMES = ["mdep"]
API_VERSION = f"{GROUP}/{VERSION}"
CRD_NAME = f"{PLURAL}.{GROUP}"

# spec.engine key -> EngineConfig field. The order is the order of the rendered args.
ENGINE_FIELDS: dict[str, str] = {
    "maxModelLen": "max_model_len",
    "gpuMemoryUtilization": "gpu_memory_utilization",
    "maxNumSeqs": "max_num_seqs",
    "maxNumBatchedTokens": "max_num_batched_tokens",
    "blockSize": "block_size",
    "enablePrefixCaching": "enable_prefix_caching",
    "enableChunkedPrefill": "enable_chunked_prefill",
    "kvCacheDtype": "kv_cache_dtype",
    "dtype": "dtype",
    "schedulingPolicy": "scheduling_policy",
}

DEFAULT_METRIC = "vllm:num_requests_waiting"
# Kubernetes resource.Quantity, as the API server's own OpenAPI spells it.
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
METRIC_NAME_PATTERN = r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"
MIN_MAX_RULE = "self.minReplicas <= self.maxReplicas"


def _engine_choices(name: str) -> list[Any]:
    """The values `pagefleet serve` accepts for an EngineConfig field."""
    for f in dataclasses.fields(EngineConfig):
        if f.name == name:
            return list(f.metadata["choices"])
    raise KeyError(name)


def _int(minimum: int | None = None, default: int | None = None, description: str = "",
         maximum: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "integer", "description": description}
    if minimum is not None:
        out["minimum"] = minimum
    if maximum is not None:
        out["maximum"] = maximum
    if default is not None:
        out["default"] = default
    return out


def _quantity(description: str) -> dict[str, Any]:
    return {"description": description, "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN, "x-kubernetes-int-or-string": True}


def _free_object(description: str) -> dict[str, Any]:
    """A Kubernetes core type we pass through untouched (affinity, tolerations...)."""
    return {"type": "object", "description": description,
            "x-kubernetes-preserve-unknown-fields": True}


def engine_schema() -> dict[str, Any]:
    """spec.engine: server flags. Unset fields keep the server's own defaults."""
    return {
        "type": "object",
        "description": "Server engine flags (same meaning as `pagefleet serve` / vLLM). "
                       "Unset fields keep the server's defaults.",
        "properties": {
            "maxModelLen": _int(1, description="--max-model-len: context length (prompt + "
                                "output). Sizes the KV cache per sequence."),
            "gpuMemoryUtilization": {
                "type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1,
                "description": "--gpu-memory-utilization: fraction of GPU memory, in (0, 1]."},
            "maxNumSeqs": _int(1, description="--max-num-seqs: sequences per engine step."),
            "maxNumBatchedTokens": _int(1, description="--max-num-batched-tokens: tokens per "
                                        "engine step."),
            "blockSize": {"type": "integer", "enum": _engine_choices("block_size"),
                          "description": "--block-size: tokens per KV cache block."},
            "enablePrefixCaching": {"type": "boolean",
                                    "description": "--enable-prefix-caching / --no-enable-prefix-caching."},
            "enableChunkedPrefill": {"type": "boolean",
                                     "description": "--enable-chunked-prefill / --no-enable-chunked-prefill."},
            "kvCacheDtype": {"type": "string", "enum": _engine_choices("kv_cache_dtype"),
                             "description": "--kv-cache-dtype."},
            "dtype": {"type": "string", "enum": _engine_choices("dtype"),
                      "description": "--dtype."},
            "schedulingPolicy": {"type": "string", "enum": _engine_choices("scheduling_policy"),
                                 "description": "--scheduling-policy."},
            "extraArgs": {"type": "array", "items": {"type": "string"},
                          "description": "More `pagefleet serve` flags, appended verbatim. "
                                         "--host, --port, --served-model-name and --api-key "
                                         "are the operator's."},
        },
    }


def autoscaling_schema() -> dict[str, Any]:
    """spec.autoscaling: HPA-like scaling on a per-pod queue metric."""
    return {
        "type": "object",
        "description": "Scale replicas from the servers' waiting queue (Kubernetes HPA "
                       "semantics). When enabled the operator owns the Deployment's "
                       "replica count and spec.replicas is ignored.",
        "properties": {
            "enabled": {"type": "boolean", "default": False},
            "minReplicas": _int(1, 1, "Lower bound of the replica count."),
            "maxReplicas": _int(1, 4, "Upper bound of the replica count."),
            "targetWaitingRequests": {
                "type": "number", "exclusiveMinimum": True, "minimum": 0, "default": 5,
                "description": "Target value of the metric per replica (sum over pods / "
                               "this = desired replicas)."},
            "metric": {"type": "string", "pattern": METRIC_NAME_PATTERN, "default": DEFAULT_METRIC,
                       "description": "Gauge scraped from each ready pod's /metrics; the "
                                      "samples of a pod are summed."},
            "scaleUpStabilizationSeconds": _int(0, 0, "Scale up to the lowest recommendation "
                                                "of this window (0: at once)."),
            "scaleDownStabilizationSeconds": _int(0, 300, "Scale down to the highest "
                                                  "recommendation of this window."),
            "intervalSeconds": _int(1, 15, "Seconds between evaluations (and status updates)."),
        },
        "x-kubernetes-validations": [{
            "rule": MIN_MAX_RULE,
            "message": "minReplicas must be <= maxReplicas",
            "fieldPath": ".minReplicas",
            "reason": "FieldValueInvalid",
        }],
    }


def spec_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["model"],
        "properties": {
            "model": {"type": "string", "minLength": 1,
                      "description": "Hugging Face repo id or a path inside the pod "
                                     "(e.g. on the model cache volume)."},
            "servedModelName": {"type": "string", "minLength": 1,
                                "description": "Model name in the API (default: model)."},
            "image": {"type": "string", "minLength": 1,
                      "description": "Server image (default: the operator's)."},
            "engine": engine_schema(),
            "replicas": _int(0, 1, "Replicas when autoscaling is off (the scale "
                             "subresource writes this)."),
            "autoscaling": autoscaling_schema(),
            "resources": {
                "type": "object",
                "description": "Per replica.",
                "properties": {
                    "gpus": _int(0, 1, "nvidia.com/gpu per replica (0: CPU only)."),
                    "cpu": _quantity("CPU request."),
                    "memory": _quantity("Memory request and limit."),
                    "shmSize": _quantity("Size of the /dev/shm emptyDir (default 2Gi)."),
                },
            },
            "apiKeySecretRef": {
                "type": "object",
                "description": "Secret holding the API key, exposed as PAGEFLEET_API_KEY.",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "key": {"type": "string", "minLength": 1, "default": "api-key"},
                },
            },
            "modelCache": {
                "type": "object",
                "description": "PersistentVolumeClaim mounted where HF_HOME points, so "
                               "restarts and new replicas skip the download.",
                "required": ["claimName"],
                "properties": {
                    "claimName": {"type": "string", "minLength": 1},
                    "mountPath": {"type": "string", "pattern": "^/", "default": "/models/hf-cache"},
                    "readOnly": {"type": "boolean", "default": False},
                },
            },
            "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
            "tolerations": {"type": "array", "items": _free_object("core/v1 Toleration")},
            "affinity": _free_object("core/v1 Affinity"),
            "priorityClassName": {"type": "string"},
            "env": {"type": "array", "description": "Extra container env (core/v1 EnvVar).",
                    "items": {"type": "object", "required": ["name"],
                              "properties": {"name": {"type": "string", "minLength": 1}},
                              "x-kubernetes-preserve-unknown-fields": True}},
        },
    }


def status_schema() -> dict[str, Any]:
    condition = {
        "type": "object",
        "required": ["type", "status"],
        "properties": {
            "type": {"type": "string"},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "reason": {"type": "string"},
            "message": {"type": "string"},
            "lastTransitionTime": {"type": "string", "format": "date-time"},
            "observedGeneration": {"type": "integer"},
        },
    }
    return {
        "type": "object",
        "properties": {
            "observedGeneration": {"type": "integer"},
            "replicas": {"type": "integer"},
            "readyReplicas": {"type": "integer"},
            "desiredReplicas": {"type": "integer"},
            "waitingRequests": {"type": "number"},
            "selector": {"type": "string"},
            "endpoint": {"type": "string"},
            "lastScaleTime": {"type": "string", "format": "date-time"},
            "conditions": {"type": "array", "items": condition,
                           "x-kubernetes-list-type": "map",
                           "x-kubernetes-list-map-keys": ["type"]},
        },
    }


def openapi_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema(),
            "status": status_schema(),
        },
    }


def printer_columns() -> list[dict[str, Any]]:
    return [
        {"name": "Model", "type": "string", "jsonPath": ".spec.model"},
        {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas"},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "Waiting", "type": "number", "jsonPath": ".status.waitingRequests"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition object (apiextensions.k8s.io/v1)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME,
                     "labels": {"app.kubernetes.io/name": "pagefleet",
                                "app.kubernetes.io/component": "operator"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": PLURAL, "singular": SINGULAR, "kind": KIND,
                      "shortNames": list(SHORT_NAMES), "categories": ["pagefleet"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": openapi_schema()},
                "subresources": {
                    "status": {},
                    "scale": {"specReplicasPath": ".spec.replicas",
                              "statusReplicasPath": ".status.replicas",
                              "labelSelectorPath": ".status.selector"},
                },
                "additionalPrinterColumns": printer_columns(),
            }],
        },
    }


HEADER = ("# Generated by `pagefleet crd` from operator/crd.py. Do not edit by hand:\n"
          "# change operator/crd.py and regenerate (a test fails when this file drifts).\n")


def crd_yaml() -> str:
    return HEADER + yaml.safe_dump(crd_manifest(), sort_keys=False, width=100)


def peering_crds() -> list[dict[str, Any]]:
    """kopf's own peering CRDs (kopf.dev/v1): with them installed, extra operator
    replicas see each other and only the highest-priority one acts."""
    def one(kind: str, plural: str, scope: str) -> dict[str, Any]:
        return {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.kopf.dev"},
            "spec": {
                "scope": scope,
                "group": "kopf.dev",
                "names": {"kind": kind, "plural": plural, "singular": plural[:-1]},
                "versions": [{
                    "name": "v1", "served": True, "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object", "properties": {"status": {
                        "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}},
                }],
            },
        }
    return [one("ClusterKopfPeering", "clusterkopfpeerings", "Cluster"),
            one("KopfPeering", "kopfpeerings", "Namespaced")]


def peering_crds_yaml() -> str:
    return HEADER.replace("`pagefleet crd`", "`pagefleet crd --peering`") + yaml.safe_dump_all(
        peering_crds(), sort_keys=False, width=100)
