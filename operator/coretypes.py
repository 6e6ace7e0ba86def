"""Kubernetes core types a ModelDeployment passes into its pods, as structural schemas.

`coretypes.json` is generated from the Kubernetes OpenAPI definitions by
`tests/operator/gen_coretypes.py` (committed, drift-tested). The CRD embeds these
schemas, so the API server rejects a mistyped affinity or toleration at apply time and
`kubectl explain` describes every field. `check()` applies the same schema inside the
operator, because a cluster with an older CRD (or an emulator with none) lets bad
input through: the operator must then name the field instead of failing at the
Deployment's apply.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_FILE = Path(__file__).with_name("coretypes.json")


@functools.cache
def _types() -> dict[str, Any]:
    with open(_FILE) as fh:
        return json.load(fh)["types"]


def schema(name: str, description: str | None = None) -> dict[str, Any]:
    """A fresh copy of the structural schema of core/v1 `name` (e.g. 'Toleration')."""
    out = copy.deepcopy(_types()[name])
    if description:
        out["description"] = description
    return out


def list_of(name: str, description: str) -> dict[str, Any]:
    return {"type": "array", "description": description, "items": schema(name)}


class SchemaError(ValueError):
    def __init__(self, path: str, rule: str) -> None:
        super().__init__(f"{path}: {rule}")
        self.path = path
        self.rule = rule


_PY_TYPES: dict[str, tuple[type, ...]] = {
    "object": (Mapping,), "array": (list,), "string": (str,), "boolean": (bool,),
    "integer": (int,), "number": (int, float),
}


def check(value: Any, sch: Mapping[str, Any], path: str) -> None:
    """Structural validation (types, enums, required and unknown fields) with the JSON
    path of the first offending field. What an API server with the CRD would refuse."""
    if sch.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise SchemaError(path, f"must be an integer or a string (got {value!r})")
        return
    type_ = sch.get("type")
    if type_:
        ok = isinstance(value, _PY_TYPES[type_]) and not (
            type_ in ("integer", "number") and isinstance(value, bool))
        if not ok:
            raise SchemaError(path, f"must be {'an' if type_[0] in 'aeio' else 'a'} {type_} (got {value!r})")
    if "enum" in sch and value not in sch["enum"]:
        raise SchemaError(path, f"must be one of {', '.join(map(str, sch['enum']))} (got {value!r})")
    if type_ == "object":
        props = sch.get("properties")
        for key in sch.get("required", []):
            if value.get(key) is None:
                raise SchemaError(f"{path}.{key}", "is required")
        for key, sub in value.items():
            if sub is None:
                continue
            if props is not None and key in props:
                check(sub, props[key], f"{path}.{key}")
            elif isinstance(sch.get("additionalProperties"), Mapping):
                check(sub, sch["additionalProperties"], f"{path}.{key}")
            elif props is not None and not sch.get("x-kubernetes-preserve-unknown-fields"):
                raise SchemaError(f"{path}.{key}", "is not a known field")
    elif type_ == "array" and "items" in sch:
        for i, item in enumerate(value):
            check(item, sch["items"], f"{path}[{i}]")
