"""The `ModelDeployment` CustomResourceDefinition, in one place.

Everything the API server needs to know about the resource lives here: the
openAPIV3 schema (types, ranges, enums, defaults, the CEL rule for min <= max, a
description on every field, core types such as affinity from `coretypes.json`),
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

from pagefleet.operator import coretypes
from pagefleet.server.config import CUDA_OOM_EXIT_CODE, EngineConfig, ServerConfig, flag_name

GROUP = "pagefleet.dev"
VERSION = "v1alpha1"
PLURAL = "modeldeployments"
SINGULAR = "modeldeployment"
KIND = "ModelDeployment"
SHORT_NAMES = ["mdep"]
API_VERSION = f"{GROUP}/{VERSION}"
CRD_NAME = f"{PLURAL}.{GROUP}"

# spec.engine key -> EngineConfig/ServerConfig field. The order is the order of the
# rendered args.
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
    "quantization": "quantization",
    "schedulingPolicy": "scheduling_policy",
    "shortPromptTokens": "short_prompt_tokens",
    "shutdownTimeout": "shutdown_timeout",
}

# Autoscaling metrics with a name: what each reads from a pod's /metrics (summed over
# the pod's samples) and its default target per replica. Any other value of
# spec.autoscaling.metric is a gauge name read as is.
METRIC_CONCURRENCY = "concurrency"
METRIC_WAITING = "waiting"
METRIC_KV_CACHE = "kvCacheUsage"
NAMED_METRICS: dict[str, tuple[str, ...]] = {
    METRIC_CONCURRENCY: ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    METRIC_WAITING: ("vllm:num_requests_waiting",),
    METRIC_KV_CACHE: ("vllm:kv_cache_usage_perc",),
}
DEFAULT_METRIC = METRIC_CONCURRENCY
MAX_GPUS = 8
# Kubernetes resource.Quantity, as the API server's own OpenAPI spells it.
QUANTITY_PATTERN = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
METRIC_NAME_PATTERN = r"^[a-zA-Z_:][a-zA-Z0-9_:]*$"
MIN_MAX_RULE = "self.minReplicas <= self.maxReplicas"
DEFAULT_IDLE_SECONDS = 300          # autoscaling.scaleToZeroIdleSeconds
DEFAULT_GATEWAY_WEIGHT = 100        # gateway.weight (server/gateway/kube.py reads the same)
DEFAULT_EPP_PORT = 9002             # the endpoint picker's gRPC port (GIE's default)
EPP_FAILURE_MODES = ["FailClose", "FailOpen"]
# Gateway API Inference Extension: the InferencePool the operator can emit.
GIE_GROUP = "inference.networking.k8s.io"
GIE_VERSION = "v1"
GIE_API_VERSION = f"{GIE_GROUP}/{GIE_VERSION}"
GIE_KIND = "InferencePool"
GIE_PLURAL = "inferencepools"
# spec.rollout: Kubernetes IntOrString, as a Deployment's rollingUpdate takes it. A
# percentage is a string `N%` (no leading zeros, so 0 and "0%" are the only zeros);
# maxUnavailable cannot exceed 100% (Kubernetes refuses it).
SURGE_PERCENT_PATTERN = r"^(0|[1-9][0-9]*)%$"
UNAVAILABLE_PERCENT_PATTERN = r"^(100|[1-9]?[0-9])%$"
ZERO_VALUES = (0, "0%")
# Both 0: no pod could ever be replaced (the Deployment API refuses it too). The CEL
# compares the string forms, since an IntOrString is CEL `dyn` (int or string).
ROLLOUT_RULE = ("!has(self.maxSurge) || !has(self.maxUnavailable) || "
                "!(string(self.maxSurge) in ['0', '0%'] && string(self.maxUnavailable) in ['0', '0%'])")
# spec.startupTimeoutSeconds: how long a pod may take from start to its first healthy
# /health (download + load). At least 60 s: less is below what even a small model
# needs to load, and would only crash-loop it. At most 4 h: a 405B checkpoint in
# bf16 (~810 GB) downloads in ~3.6 h at 500 Mbit/s; slower than that, pre-load a
# modelCache. Past it a hung download should be restarted, and the Deployment's
# progressDeadlineSeconds (derived from it) should still report a stuck rollout
# within the same day. No schema `default`: the API server would write it into every
# existing ModelDeployment, changing its template hash and rolling every fleet on the
# CRD upgrade; spec.py applies DEFAULT_STARTUP_TIMEOUT_S instead.
MIN_STARTUP_TIMEOUT_S = 60
MAX_STARTUP_TIMEOUT_S = 4 * 3600
DEFAULT_STARTUP_TIMEOUT_S = 30 * 60
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


def _engine_field(name: str) -> dataclasses.Field:
    for cls in (EngineConfig, ServerConfig):
        for f in dataclasses.fields(cls):
            if f.name == name:
                return f
    raise KeyError(name)


def _engine_choices(name: str) -> list[Any]:
    """The values `pagefleet serve` accepts for a config field."""
    return list(_engine_field(name).metadata["choices"])


def _flag_doc(name: str) -> str:
    """`--flag`: the server's own help text, so the CRD says what `pagefleet serve --help` says."""
    f = _engine_field(name)
    return f"{flag_name(f)}: {f.metadata['help']}"


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


def _str(description: str, **kw: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **kw}


def _bool(description: str, default: bool | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "boolean", "description": description}
    if default is not None:
        out["default"] = default
    return out


def _quantity(description: str) -> dict[str, Any]:
    return {"description": description, "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN, "x-kubernetes-int-or-string": True}


def _int_or_percent(description: str, percent_pattern: str) -> dict[str, Any]:
    """A Kubernetes IntOrString: an integer >= 0 or a percentage string."""
    return {"description": description, "anyOf": [{"type": "integer"}, {"type": "string"}],
            "x-kubernetes-int-or-string": True, "minimum": 0, "pattern": percent_pattern}


def rollout_schema() -> dict[str, Any]:
    """spec.rollout: the Deployment's rollingUpdate. No defaults in the schema: the
    operator's defaults depend on the model cache PVC's access modes (resources.py)."""
    return {
        "type": "object",
        "description": "How a spec change rolls the pods (the Deployment's rollingUpdate). Unset: "
                       "maxSurge 1, maxUnavailable 0 (a new pod loads its model before an old one "
                       "goes), or maxSurge 0, maxUnavailable 1 when the modelCache PVC can be "
                       "mounted on one node only. Changing it rolls no pod.",
        "properties": {
            "maxSurge": _int_or_percent(
                "Pods above the replica count during a rollout: an integer or a percentage "
                "(rounded up). Default 1, or 0 with a single-node (ReadWriteOnce) modelCache, "
                "which refuses any other value. 0 lets a rollout proceed on a full GPU pool.",
                SURGE_PERCENT_PATTERN),
            "maxUnavailable": _int_or_percent(
                "Pods below the replica count during a rollout: an integer or a percentage up "
                "to 100% (rounded down). Default 0, or 1 where maxSurge is 0.",
                UNAVAILABLE_PERCENT_PATTERN),
        },
        # No fieldPath/reason: Kubernetes 1.27 (the oldest the chart supports) lacks them.
        "x-kubernetes-validations": [{"rule": ROLLOUT_RULE,
                                      "message": "maxSurge and maxUnavailable must not both be 0"}],
    }


def _string_map(description: str) -> dict[str, Any]:
    return {"type": "object", "description": description, "additionalProperties": {"type": "string"}}


def _secret_key_ref(description: str, default_key: str) -> dict[str, Any]:
    return {"type": "object", "description": description, "required": ["name"], "properties": {
        "name": _str("Name of the Secret (same namespace).", minLength=1),
        "key": _str(f"Key in the Secret (default {default_key}).", minLength=1, default=default_key)}}


def engine_schema() -> dict[str, Any]:
    """spec.engine: server flags. Unset fields keep the server's own defaults."""
    props: dict[str, Any] = {
        "maxModelLen": _int(1, description=_flag_doc("max_model_len")),
        "gpuMemoryUtilization": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1,
                                 "description": _flag_doc("gpu_memory_utilization") + " In (0, 1]."},
        "maxNumSeqs": _int(1, description=_flag_doc("max_num_seqs")),
        "maxNumBatchedTokens": _int(1, description=_flag_doc("max_num_batched_tokens")),
        "blockSize": {"type": "integer", "enum": _engine_choices("block_size"),
                      "description": _flag_doc("block_size")},
        "enablePrefixCaching": _bool(_flag_doc("enable_prefix_caching")),
        "enableChunkedPrefill": _bool(_flag_doc("enable_chunked_prefill")),
        "kvCacheDtype": _str(_flag_doc("kv_cache_dtype"), enum=_engine_choices("kv_cache_dtype")),
        "dtype": _str(_flag_doc("dtype"), enum=_engine_choices("dtype")),
        "quantization": _str(_flag_doc("quantization"), enum=_engine_choices("quantization")),
        "schedulingPolicy": _str(_flag_doc("scheduling_policy"), enum=_engine_choices("scheduling_policy")),
        "shortPromptTokens": _int(0, description=_flag_doc("short_prompt_tokens")),
        "shutdownTimeout": {"type": "number", "minimum": 0,
                            "description": _flag_doc("shutdown_timeout") + " The pod's "
                            "terminationGracePeriodSeconds is sized from it."},
        "extraArgs": {"type": "array", "items": {"type": "string"},
                      "description": "More `pagefleet serve` flags, appended verbatim and parsed "
                                     "with the server's own parser (no abbreviations). --host, "
                                     "--port, --served-model-name, --api-key and --config are the "
                                     "operator's; --tensor-parallel-size must equal resources.gpus."},
    }
    assert list(props)[:-1] == list(ENGINE_FIELDS), "ENGINE_FIELDS and the schema list the same keys"
    return {"type": "object",
            "description": "Server flags (same meaning as `pagefleet serve` / vLLM). Unset fields "
                           "keep the server's defaults.",
            "properties": props}


def autoscaling_schema() -> dict[str, Any]:
    """spec.autoscaling: HPA-like scaling on a per-pod metric."""
    return {
        "type": "object",
        "description": "Scale replicas from the servers' own metrics (Kubernetes HPA semantics). "
                       "When enabled the operator owns the Deployment's replica count and "
                       "spec.replicas is ignored.",
        "properties": {
            "enabled": _bool("Turn the autoscaler on.", False),
            "minReplicas": _int(0, 1, "Lower bound of the replica count. 0: scale to zero "
                                "after scaleToZeroIdleSeconds without requests, and back to 1 "
                                "when the pagefleet gateway holds a request for this model "
                                "(needs the gateway and the operator's --gateway-service)."),
            "maxReplicas": _int(1, 4, "Upper bound of the replica count."),
            "metric": _str(
                "What a replica's load is: `concurrency` (vllm:num_requests_running + "
                "vllm:num_requests_waiting, the default), `waiting` (vllm:num_requests_waiting), "
                "`kvCacheUsage` (vllm:kv_cache_usage_perc, 0..1), or the name of any gauge on the "
                "servers' /metrics. A pod's samples are summed.",
                pattern=METRIC_NAME_PATTERN, default=DEFAULT_METRIC),
            "target": {"type": "number", "exclusiveMinimum": True, "minimum": 0,
                       "description": "Target value of the metric per replica: desired = "
                                      "ceil(sum over pods / target). Default: engine.maxNumSeqs "
                                      "(or the server's) for concurrency, 5 for waiting, 0.8 for "
                                      "kvCacheUsage; required for a gauge name."},
            "targetWaitingRequests": {
                "type": "number", "exclusiveMinimum": True, "minimum": 0,
                "description": "Deprecated: the same as metric: waiting with this target."},
            "scaleUpStabilizationSeconds": _int(0, 0, "Scale up to the lowest recommendation "
                                                "of this window (0: at once)."),
            "scaleDownStabilizationSeconds": _int(0, 300, "Scale down to the highest "
                                                  "recommendation of this window."),
            "intervalSeconds": _int(1, 15, "Seconds between evaluations (and status updates)."),
            "scaleToZeroIdleSeconds": _int(1, DEFAULT_IDLE_SECONDS, "With minReplicas 0: scale "
                                           "to 0 once the model had no request in the gateway "
                                           "and none in flight for this many seconds."),
        },
        # No fieldPath/reason: Kubernetes 1.27 (the oldest the chart supports) lacks them.
        "x-kubernetes-validations": [{"rule": MIN_MAX_RULE,
                                      "message": "minReplicas must be <= maxReplicas"}],
    }


def gateway_schema() -> dict[str, Any]:
    """spec.gateway: what `pagefleet gateway` (Kubernetes discovery) and the optional
    Gateway API Inference Extension InferencePool need. None of it shapes the pods."""
    return {
        "type": "object",
        "description": "How the pagefleet gateway routes to this ModelDeployment (one pool of "
                       "the model named servedModelName), and the optional InferencePool.",
        "properties": {
            "weight": _int(0, DEFAULT_GATEWAY_WEIGHT, "Rollout weight among the pools of the "
                           "same model and context length (e.g. 90 and 10 for a canary); 0 "
                           "drains this pool.", maximum=1000000),
            "tokenizer": _str("What the gateway tokenizes prompts with (a Hub id or a path in "
                              "the gateway pod; default: model). Set it when the gateway cannot "
                              "read the model's path.", minLength=1),
            "queueTimeoutSeconds": {
                "type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 86400,
                "description": "Seconds the gateway holds a request for this model while no "
                               "replica can take it (the gateway's --queue-timeout otherwise): "
                               "with minReplicas 0, cover a cold start (scheduling, image pull, "
                               "model load). The largest value among the model's pools applies."},
            "inferencePool": {
                "type": "object",
                "description": "Emit a Gateway API Inference Extension InferencePool "
                               f"({GIE_API_VERSION}) for the model, so GIE-capable gateways "
                               "(Envoy Gateway, kgateway, Istio) route to its pods through an "
                               "endpoint picker (llm-d's reads the pods' llm-d.ai/role and "
                               "llm-d.ai/context-length-range labels). Only when that CRD is "
                               "installed; one pool per model name and namespace.",
                "required": ["endpointPicker"],
                "properties": {
                    "enabled": _bool("Emit the InferencePool.", True),
                    "endpointPicker": {
                        "type": "object",
                        "description": "The endpoint picker (EPP) Service the gateway consults.",
                        "required": ["name"],
                        "properties": {
                            "name": _str("Name of the endpoint picker's Service (same "
                                         "namespace).", minLength=1, maxLength=253),
                            "port": _int(1, DEFAULT_EPP_PORT, "Its port.", maximum=65535),
                            "failureMode": _str("What the gateway does when the picker does not "
                                                "answer.", enum=EPP_FAILURE_MODES,
                                                default="FailClose"),
                        },
                    },
                },
            },
        },
    }


def oom_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "OOM remediation: when the pods crash with a CUDA out-of-memory (the server's "
                       f"exit code {CUDA_OOM_EXIT_CODE}) or are OOMKilled maxOOMs times within "
                       "windowSeconds, the operator lowers the effective gpuMemoryUtilization by "
                       "step (not below floor) and rolls the pods. Recorded in status, never in "
                       "the spec; a spec change starts over from the spec's value.",
        "properties": {
            "enabled": _bool("Turn OOM remediation on.", True),
            "maxOOMs": _int(1, 3, "OOMs within the window that trigger one step down."),
            "windowSeconds": _int(1, 600, "The counting window."),
            "step": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 0.5,
                     "default": 0.05, "description": "How much to lower gpuMemoryUtilization per step."},
            "floor": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1,
                      "default": 0.5, "description": "Never lower gpuMemoryUtilization below this."},
        },
    }


def spec_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "What to serve and how.",
        "required": ["model"],
        "properties": {
            "model": _str("Hugging Face repo id or a path inside the pod (e.g. on the model "
                          "cache volume).", minLength=1),
            "servedModelName": _str("Model name in the API (default: model).", minLength=1),
            "image": _str("Server image (default: the operator's --server-image, recorded in "
                          "status.serverImage so an operator upgrade does not roll the pods).",
                          minLength=1),
            "engine": engine_schema(),
            "replicas": _int(0, 1, "Replicas when autoscaling is off (the scale subresource "
                             "writes this)."),
            "autoscaling": autoscaling_schema(),
            "rollout": rollout_schema(),
            "startupTimeoutSeconds": _int(
                MIN_STARTUP_TIMEOUT_S, description=(
                    "Seconds a pod may take from container start (after the image pull) to "
                    "serving: weights download, load, warm-up. Past it the pod is restarted: "
                    "this is the startup probe's "
                    f"budget, rounded up to its 10 s period. Default {DEFAULT_STARTUP_TIMEOUT_S} "
                    f"(30 minutes), {MIN_STARTUP_TIMEOUT_S} to {MAX_STARTUP_TIMEOUT_S} (4 hours). The "
                    "Deployment's progressDeadlineSeconds is this budget plus 10 minutes, and "
                    "when set it is also the server's --startup-timeout. "
                    "Changing it rolls the pods (the probe is part of the pod template)."),
                maximum=MAX_STARTUP_TIMEOUT_S),
            "gateway": gateway_schema(),
            "resources": {
                "type": "object",
                "description": "Per replica.",
                "properties": {
                    "gpus": _int(0, 1, f"nvidia.com/gpu per replica, 0 (CPU only) to {MAX_GPUS}. More "
                                 "than one shards the model with --tensor-parallel-size.",
                                 maximum=MAX_GPUS),
                    "cpu": _quantity("CPU request."),
                    "memory": _quantity("Memory request and limit."),
                    "shmSize": _quantity("Size of the in-memory /dev/shm (default 2Gi, 8Gi with "
                                         "more than one GPU: NCCL uses it)."),
                    "ephemeralStorage": _quantity("Size of the emptyDir that holds the downloaded "
                                                  "weights when there is no modelCache (requested "
                                                  "as ephemeral-storage; default 50Gi)."),
                },
            },
            "apiKeySecretRef": _secret_key_ref("Secret holding the API key, exposed to the server "
                                               "as PAGEFLEET_API_KEY.", "api-key"),
            "hfTokenSecretRef": _secret_key_ref("Secret holding a Hugging Face token, exposed as "
                                                "HF_TOKEN (gated models).", "token"),
            "modelCache": {
                "type": "object",
                "description": "PersistentVolumeClaim mounted where HF_HOME points, so restarts and "
                               "new replicas skip the download. A ReadWriteOnce claim makes "
                               "rollouts replace pods without a surge pod (maxSurge 0), one at a "
                               "time unless rollout.maxUnavailable says more.",
                "required": ["claimName"],
                "properties": {
                    "claimName": _str("Name of the PersistentVolumeClaim (same namespace).", minLength=1),
                    "mountPath": _str("Where it is mounted (HF_HOME).", pattern="^/",
                                      default="/models/hf-cache"),
                    "readOnly": _bool("Mount read-only (weights pre-loaded).", False),
                },
            },
            "nodeSelector": _string_map("Pod nodeSelector."),
            "tolerations": coretypes.list_of("Toleration", "Pod tolerations (GPU pods also "
                                             "tolerate the nvidia.com/gpu taint)."),
            "affinity": coretypes.schema("Affinity", "Pod affinity."),
            "topologySpreadConstraints": coretypes.list_of(
                "TopologySpreadConstraint", "Pod topology spread. Default: spread replicas over "
                "nodes (kubernetes.io/hostname, maxSkew 1, ScheduleAnyway); [] turns it off."),
            "priorityClassName": _str("Pod priorityClassName."),
            "runtimeClassName": _str("Pod runtimeClassName (e.g. nvidia)."),
            "imagePullSecrets": coretypes.list_of("LocalObjectReference", "Pull secrets of the server image."),
            "serviceAccountName": _str("Service account of the pods (default: the namespace's "
                                       "default one).", pattern=DNS_SUBDOMAIN_PATTERN),
            "automountServiceAccountToken": _bool("Mount the service account token into the "
                                                  "pods. The server needs none.", False),
            "podMetadata": {"type": "object", "description": "Extra pod labels and annotations "
                            "(Istio, Kueue, gateways). The operator's own keys win.",
                            "properties": {"labels": _string_map("Extra pod labels."),
                                           "annotations": _string_map("Extra pod annotations.")}},
            "volumes": coretypes.list_of("Volume", "Extra pod volumes (the types Pod Security "
                                         "`restricted` allows)."),
            "volumeMounts": coretypes.list_of("VolumeMount", "Extra mounts in the server container."),
            "podSecurityContext": coretypes.schema("PodSecurityContext", "Overrides of the pod "
                                                   "securityContext (keys merge over the "
                                                   "restricted defaults)."),
            "securityContext": coretypes.schema("SecurityContext", "Overrides of the server "
                                                "container's securityContext (keys merge over "
                                                "the restricted defaults)."),
            "env": coretypes.list_of("EnvVar", "Extra container env (the operator's own variables win)."),
            "disruption": {
                "type": "object",
                "description": "The PodDisruptionBudget.",
                "properties": {
                    "maxUnavailable": _int(1, 1, "Replicas a node drain may take at once (with 2 "
                                           "or more replicas)."),
                    "evictLastReplica": _bool("Let a drain evict the only replica (the model goes "
                                              "offline). Default: a 1-replica model blocks drains.",
                                              False),
                },
            },
            "oomRemediation": oom_schema(),
        },
    }


def status_schema() -> dict[str, Any]:
    condition = {
        "type": "object",
        "description": "A Kubernetes condition.",
        "required": ["type", "status"],
        "properties": {
            "type": _str("Available, Progressing, Degraded, Ready, Reconciling, Stalled, "
                         "MetricsAvailable, OOMRemediation, CacheShared, Active, InferencePool."),
            "status": _str("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "reason": _str("Machine-readable reason."),
            "message": _str("Human-readable message."),
            "lastTransitionTime": _str("When status last changed.", format="date-time"),
            "observedGeneration": _int(description="The generation this condition describes."),
        },
    }
    stamp = {"type": "object", "description": "A past recommendation.", "properties": {
        "time": _str("When.", format="date-time"), "replicas": _int(description="Replicas."),
        "added": _int(description="Replicas added (scale-ups).")}}
    return {
        "type": "object",
        "description": "What the operator observed and did.",
        "properties": {
            "observedGeneration": _int(description="The last generation whose Deployment, Service "
                                       "and PodDisruptionBudget were all applied."),
            "replicas": _int(description="Pods of the Deployment."),
            "readyReplicas": _int(description="Ready pods."),
            "desiredReplicas": _int(description="Replicas the operator asks for."),
            "waitingRequests": {"type": "number", "description": "vllm:num_requests_waiting summed "
                                "over the pods that reported it (absent when none did)."},
            "runningRequests": {"type": "number", "description": "vllm:num_requests_running summed "
                                "over the pods that reported it (absent when none did)."},
            "metricValue": {"type": "number", "description": "The autoscaling metric per reporting "
                            "replica."},
            "selector": _str("Label selector of the pods (scale subresource)."),
            "endpoint": _str("OpenAI base URL inside the cluster."),
            "serverImage": _str("The server image the pods run (spec.image or the operator "
                                "default at the time of the spec's last change)."),
            "templateHash": _str("Hash of the spec (and remediation) the pod template was "
                                 "rendered from."),
            "lastScaleTime": _str("When the autoscaler last changed the replicas.", format="date-time"),
            "gatewayWaitingRequests": {"type": "number", "description": "Requests the pagefleet "
                                       "gateway holds for this pool (summed over the gateway's "
                                       "replicas; absent when it was not read)."},
            "lastRequestTime": _str("The model's last request through the gateway (the idle "
                                    "window of scale to zero counts from it).", format="date-time"),
            "inferencePool": _str("Name of the InferencePool this ModelDeployment's pods belong "
                                  "to (with gateway.inferencePool)."),
            "autoscaler": {"type": "object", "description": "Autoscaler history, so an operator "
                           "restart keeps the stabilization windows and rate limit.", "properties": {
                               "recommendations": {"type": "array", "items": stamp,
                                                   "description": "Recent recommendations."},
                               "scaleUps": {"type": "array", "items": stamp,
                                            "description": "Recent scale-ups."}}},
            "oomRemediation": {"type": "object", "description": "OOM remediation state (reset by "
                               "a spec change).", "properties": {
                                   "gpuMemoryUtilization": {"type": "number", "description":
                                                            "The effective value the pods run with."},
                                   "specHash": _str("Hash of the spec this applies to."),
                                   "ooms": {"type": "array", "description": "Recent OOM exits counted.",
                                            "items": {"type": "object", "description": "One OOM exit.",
                                                      "properties": {
                                                          "pod": _str("Pod name."),
                                                          "time": _str("When it ended.", format="date-time"),
                                                          "reason": _str("CudaOutOfMemory or OOMKilled.")}}},
                                   "lastRemediationTime": _str("When it last stepped down.",
                                                               format="date-time")}},
            "conditions": {"type": "array", "items": condition,
                           "description": "Available, Progressing, Degraded and the "
                                          "kstatus trio Ready, Reconciling, Stalled, plus "
                                          "MetricsAvailable, OOMRemediation, CacheShared, "
                                          "Active (scale to zero) and InferencePool.",
                           "x-kubernetes-list-type": "map",
                           "x-kubernetes-list-map-keys": ["type"]},
        },
    }


def openapi_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "A fleet of `pagefleet serve` replicas behind one Service, autoscaled on "
                       "the servers' own metrics.",
        "required": ["spec"],
        "properties": {
            "apiVersion": _str("APIVersion of this object."),
            "kind": _str("Kind of this object."),
            "metadata": {"type": "object", "description": "Standard object metadata."},
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
