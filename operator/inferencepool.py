"""Pure: the Gateway API Inference Extension InferencePools a namespace should have.

An InferencePool (`inference.networking.k8s.io/v1`) names a set of model-server pods
(a label selector), their port, and the endpoint picker (EPP) a GIE-capable gateway
(Envoy Gateway, kgateway, Istio) asks where each request goes. llm-d's picker scores
pods on the vLLM metrics pagefleet exports and on two pod labels the operator puts on
every server pod (resources.pod_labels): `llm-d.ai/role: prefill-decode` and
`llm-d.ai/context-length-range: 0-<maxModelLen>`.

One pool per model name (servedModelName) and namespace, not per ModelDeployment:
the long/short split and canaries of one model are several ModelDeployments, and only
one pool over all of their pods lets the picker choose by context length (the
tightest range that holds the request, as the pagefleet gateway picks the smallest
fitting pool). The pool selects every pagefleet server pod of that model name in the
namespace; it exists while at least one of its ModelDeployments asks for it
(`spec.gateway.inferencePool`), carries an owner reference to each of them (none a
controller, so garbage collection removes it with the last one), and takes its
endpoint picker from the first of them by name.

`desired` is computed from all ModelDeployments of the namespace, so every reconcile
writes the same object whichever of them triggers it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagefleet.operator import crd, resources
from pagefleet.operator.spec import ModelDeploymentSpec

LABEL_COMPONENT = "app.kubernetes.io/component"


def pool_name(served_model_name: str) -> str:
    """The InferencePool of a model name: a valid object name, distinct for
    look-alike model names."""
    return resources.served_label(served_model_name)


def selector(served_model_name: str) -> dict[str, str]:
    return {resources.LABEL_SERVED: resources.served_label(served_model_name),
            LABEL_COMPONENT: "server", "app.kubernetes.io/managed-by": resources.MANAGER}


def inference_pool(served_model_name: str, namespace: str,
                   members: Sequence[ModelDeploymentSpec]) -> dict[str, Any]:
    """The pool of one model name; `members`: its ModelDeployments that ask for it
    (at least one)."""
    members = sorted(members, key=lambda s: s.name)
    picker = members[0].gateway.endpoint_picker
    assert picker is not None, "members ask for the pool"
    owners = [{"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": s.name, "uid": s.uid,
               "controller": False, "blockOwnerDeletion": False} for s in members if s.uid]
    meta: dict[str, Any] = {
        "name": pool_name(served_model_name), "namespace": namespace,
        "labels": {"app.kubernetes.io/name": "pagefleet", LABEL_COMPONENT: "inference-pool",
                   "app.kubernetes.io/managed-by": resources.MANAGER,
                   resources.LABEL_SERVED: resources.served_label(served_model_name)},
        "annotations": {"pagefleet.dev/served-model-name": served_model_name}}
    if owners:
        meta["ownerReferences"] = owners
    return {
        "apiVersion": crd.GIE_API_VERSION,
        "kind": crd.GIE_KIND,
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": selector(served_model_name)},
            "targetPorts": [{"number": resources.PORT}],
            "endpointPickerRef": {"group": "", "kind": "Service", "name": picker.name,
                                  "port": {"number": picker.port},
                                  "failureMode": picker.failure_mode},
        },
    }


def desired(specs: Sequence[ModelDeploymentSpec], namespace: str) -> dict[str, dict[str, Any]]:
    """name -> InferencePool for the namespace's ModelDeployments (parsed, valid, not
    being deleted)."""
    by_model: dict[str, list[ModelDeploymentSpec]] = {}
    for s in specs:
        if s.gateway.inference_pool:
            by_model.setdefault(s.served_model_name, []).append(s)
    return {pool_name(m): inference_pool(m, namespace, members) for m, members in sorted(by_model.items())}


def ours(obj: Mapping[str, Any]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels.get("app.kubernetes.io/managed-by") == resources.MANAGER


def api_has_inference_pools(discovery: Mapping[str, Any] | None) -> bool:
    """The API group version's discovery document lists the resource (the CRD is
    installed and served)."""
    return any(r.get("name") == crd.GIE_PLURAL for r in (discovery or {}).get("resources") or [])
