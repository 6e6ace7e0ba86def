"""Build operator/coretypes.json: structural (CRD-ready) schemas of the Kubernetes core
types that a ModelDeployment passes into its pods (affinity, tolerations, env, ...).

Why vendored: the CRD must reject a mistyped toleration or affinity at `kubectl apply`
time, with `kubectl explain` descriptions, and `pagefleet crd` runs in the operator
image, which has no kubernetes-validate. So the schemas are converted once from the
Kubernetes OpenAPI definitions that kubernetes-validate ships (the oldest minor the
chart supports, so nothing newer than the cluster is accepted), and committed.
`tests/operator/test_crd.py` fails when the committed file drifts from this output.

    python tests/operator/gen_coretypes.py --write

The conversion: `$ref`s inlined; `type: [T, "null"]` -> T; IntOrString and Quantity
-> `x-kubernetes-int-or-string`; `additionalProperties: false` dropped (a structural
schema may not combine it with `properties`; the API server's strict field
validation rejects unknown fields instead); embedded ObjectMeta reduced to labels and
annotations; descriptions cut to their first paragraph (CRD size); volumes limited to
the types Pod Security `restricted` allows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate

KUBE_VERSION = "1.27.0"
REPO = Path(__file__).resolve().parents[2]
OUTPUT = REPO / "operator" / "coretypes.json"
CORE = "io.k8s.api.core.v1."
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
# name -> definition, in the order the CRD uses them.
TYPES = {
    "Affinity": CORE + "Affinity",
    "Toleration": CORE + "Toleration",
    "TopologySpreadConstraint": CORE + "TopologySpreadConstraint",
    "EnvVar": CORE + "EnvVar",
    "Volume": CORE + "Volume",
    "VolumeMount": CORE + "VolumeMount",
    "LocalObjectReference": CORE + "LocalObjectReference",
    "PodSecurityContext": CORE + "PodSecurityContext",
    "SecurityContext": CORE + "SecurityContext",
}
# Pod Security Standards, `restricted`: the only volume types it allows.
RESTRICTED_VOLUME_TYPES = ("configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                           "persistentVolumeClaim", "projected", "secret")


def definitions() -> dict[str, Any]:
    base = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    with open(base / f"v{KUBE_VERSION}-local-strict" / "_definitions.json") as fh:
        return json.load(fh)["$defs"]


def _description(text: str | None) -> str | None:
    if not text:
        return None
    return text.split("\n\n", 1)[0].strip()


def convert(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        if name == OBJECT_META:
            out: dict[str, Any] = {"type": "object", "properties": {
                key: {"type": "object", "additionalProperties": {"type": "string"},
                      "description": f"Kubernetes {key} of the embedded object."}
                for key in ("labels", "annotations")}}
        else:
            out = convert(defs[name], defs)
        desc = _description(schema.get("description"))
        if desc:
            out["description"] = desc
        return out
    out = {}
    type_ = schema.get("type")
    if isinstance(type_, list):
        type_ = next(t for t in type_ if t != "null")
    if "oneOf" in schema or schema.get("format") == "int-or-string":
        out["x-kubernetes-int-or-string"] = True
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    elif type_:
        out["type"] = type_
    desc = _description(schema.get("description"))
    if desc:
        out["description"] = desc
    if "enum" in schema:
        out["enum"] = [e for e in schema["enum"] if e is not None]
    if "properties" in schema:
        out["properties"] = {k: convert(v, defs) for k, v in schema["properties"].items()}
    if schema.get("required"):
        out["required"] = list(schema["required"])
    if "items" in schema:
        out["items"] = convert(schema["items"], defs)
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = convert(schema["additionalProperties"], defs)
    return out


def build() -> dict[str, Any]:
    defs = definitions()
    out = {}
    for name, ref in TYPES.items():
        schema = convert(defs[ref], defs)
        if name == "Volume":
            schema["properties"] = {k: v for k, v in schema["properties"].items()
                                    if k == "name" or k in RESTRICTED_VOLUME_TYPES}
        out[name] = schema
    return {"kubernetesVersion": KUBE_VERSION, "types": out}


def render() -> str:
    return json.dumps(build(), indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        OUTPUT.write_text(render())
        print(f"wrote {OUTPUT.relative_to(REPO)} ({OUTPUT.stat().st_size} bytes)")
    else:
        sys.stdout.write(render())
