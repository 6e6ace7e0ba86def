"""Strategic merge patch, the part `kubectl apply` sends for core kinds.

kmock merges every patch as a JSON merge patch (lists replace). `kubectl apply` of a
changed Deployment sends a strategic merge patch instead: a list of containers in it
holds only the changed container fields, matched to the live list by `name`, with a
`$setElementOrder/containers` directive. Merged as JSON, the container would lose its
image. This applies such a patch the way the API server does for the fields the e2e
objects use (merge keys from the Kubernetes types' patchMergeKey tags), so the emulator
can store the result; lists without a merge key replace, as they do there.
"""

from __future__ import annotations

import copy
from typing import Any

# field name -> patchMergeKey (k8s.io/api core/v1, apps/v1, meta/v1).
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
    "env": "name", "volumes": "name", "imagePullSecrets": "name", "volumeMounts": "mountPath",
    "ports": "containerPort", "conditions": "type", "ownerReferences": "uid",
    "topologySpreadConstraints": "topologyKey", "hostAliases": "ip",
}
ORDER = "$setElementOrder/"
DELETE_PRIMITIVES = "$deleteFromPrimitiveList/"


def apply(live: Any, patch: Any) -> Any:
    """The object `live` becomes under the strategic merge patch `patch`."""
    if not isinstance(patch, dict) or not isinstance(live, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    out = copy.deepcopy(live)
    retain = patch.get("$retainKeys")
    for key, value in patch.items():
        if key.startswith("$"):
            if key.startswith(DELETE_PRIMITIVES):
                field = key[len(DELETE_PRIMITIVES):]
                out[field] = [v for v in out.get(field) or [] if v not in value]
            continue
        if value is None:
            out.pop(key, None)
        elif isinstance(value, list) and key in MERGE_KEYS and isinstance(out.get(key), list):
            out[key] = _merge_list(out[key], value, MERGE_KEYS[key], patch.get(ORDER + key))
        elif isinstance(value, dict):
            out[key] = apply(out.get(key) if isinstance(out.get(key), dict) else {}, value)
        else:
            out[key] = copy.deepcopy(value)
    if retain is not None:
        out = {k: v for k, v in out.items() if k in retain}
    return out


def _merge_list(live: list[Any], patch: list[Any], key: str, order: list[Any] | None) -> list[Any]:
    items = {item.get(key): item for item in live if isinstance(item, dict)}
    keys = [item.get(key) for item in live if isinstance(item, dict)]
    for p in patch:
        if not isinstance(p, dict):
            continue
        k = p.get(key)
        if p.get("$patch") == "delete":
            items.pop(k, None)
            continue
        items[k] = apply(items.get(k, {}), p)
        if k not in keys:
            keys.append(k)
    if order is not None:
        wanted = [o.get(key) for o in order if isinstance(o, dict)]
        keys = [k for k in wanted if k in items] + [k for k in keys if k not in wanted]
    return [items[k] for k in keys if k in items]


def merge_patch(old: Any, new: Any) -> Any:
    """A JSON merge patch that turns `old` into `new` (what kmock applies)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return copy.deepcopy(new)
    out: dict[str, Any] = {}
    for key, value in new.items():
        if key not in old or old[key] != value:
            out[key] = merge_patch(old.get(key), value) if isinstance(value, dict) else copy.deepcopy(value)
    for key in old:
        if key not in new:
            out[key] = None
    return out
