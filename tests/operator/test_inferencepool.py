"""InferencePool emission (Gateway API Inference Extension): the rendered object and
the llm-d pod labels (pure), and the real operator against the API emulator, with the
InferencePool API absent and then installed."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import kmock
import pytest

from pagefleet.operator import crd, inferencepool, resources
from pagefleet.operator.spec import parse_spec
from tests.deploy.schemas import validate_inference_pool
from tests.operator.harness import Cluster

EPP = {"endpointPicker": {"name": "qwen-epp"}}


def mdep(name: str, served: str = "qwen2.5-7b", pool: dict[str, Any] | None = None, uid: str | None = None,
         **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
                            "metadata": {"name": name, "namespace": "ml", "uid": uid or f"uid-{name}"},
                            "spec": {"model": "Qwen/Qwen2.5-7B-Instruct", "servedModelName": served, **spec}}
    if pool is not None:
        body["spec"].setdefault("gateway", {})["inferencePool"] = pool
    return body


def pod_labels(body: dict[str, Any]) -> dict[str, str]:
    return resources.deployment(parse_spec(body), 1)["spec"]["template"]["metadata"]["labels"]


def test_pods_carry_llm_ds_role_and_context_length_range() -> None:
    short = pod_labels(mdep("short", engine={"maxModelLen": 4096}))
    assert short[resources.LLMD_ROLE_LABEL] == "prefill-decode"
    assert short[resources.LLMD_CONTEXT_LABEL] == "0-4096"
    assert pod_labels(mdep("x", engine={"extraArgs": ["--max-model-len", "32768"]}))[resources.LLMD_CONTEXT_LABEL] == "0-32768"
    assert resources.LLMD_CONTEXT_LABEL not in pod_labels(mdep("unknown")), "the model's own length is not known here"
    # The served name is a label value even when it is not a valid one itself.
    odd = pod_labels(mdep("odd", served="Qwen/Qwen2.5-7B-Instruct"))
    assert odd[resources.LABEL_SERVED] == resources.served_label("Qwen/Qwen2.5-7B-Instruct") != \
        resources.served_label("qwen-qwen2-5-7b-instruct")


def test_one_pool_per_model_over_its_long_short_and_canary_pods() -> None:
    bodies = [mdep("qwen-short", pool=EPP, engine={"maxModelLen": 4096}),
              mdep("qwen-long", pool={"endpointPicker": {"name": "other-epp", "port": 9100,
                                                         "failureMode": "FailOpen"}},
                   engine={"maxModelLen": 32768}),
              mdep("qwen-canary", engine={"maxModelLen": 4096}),           # no switch: not an owner
              mdep("llama", served="llama", engine={"maxModelLen": 8192})]
    specs = [parse_spec(b) for b in bodies]
    pools = inferencepool.desired(specs, "ml")
    assert list(pools) == [inferencepool.pool_name("qwen2.5-7b")]
    (pool,) = pools.values()
    validate_inference_pool(pool)
    assert pool["metadata"]["namespace"] == "ml"
    assert pool["spec"]["targetPorts"] == [{"number": resources.PORT}]
    # The picker of the first owner by name (qwen-long), with its port and failure mode.
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "other-epp",
                                                 "port": {"number": 9100}, "failureMode": "FailOpen"}
    assert [(o["name"], o["controller"]) for o in pool["metadata"]["ownerReferences"]] == [
        ("qwen-long", False), ("qwen-short", False)]
    # It selects every pod of the model (both context classes, the canary too), no other.
    sel = pool["spec"]["selector"]["matchLabels"]
    for body in bodies[:3]:
        assert sel.items() <= pod_labels(body).items(), body["metadata"]["name"]
    assert not sel.items() <= pod_labels(bodies[3]).items()
    # Defaults: port 9002, FailClose; a switch set to false asks for nothing.
    only = inferencepool.desired([parse_spec(bodies[0])], "ml")
    ref = next(iter(only.values()))["spec"]["endpointPickerRef"]
    assert (ref["port"], ref["failureMode"]) == ({"number": crd.DEFAULT_EPP_PORT}, "FailClose")
    off = mdep("qwen-short", pool={**EPP, "enabled": False})
    assert inferencepool.desired([parse_spec(off)], "ml") == {}


def test_the_schema_check_can_fail() -> None:
    (pool,) = inferencepool.desired([parse_spec(mdep("a", pool=EPP))], "ml").values()
    for mutate in (lambda p: p["spec"].update(targetPorts=[]),
                   lambda p: p["spec"]["endpointPickerRef"].pop("port"),
                   lambda p: p["spec"]["endpointPickerRef"].update(failureMode="Sometimes"),
                   lambda p: p["spec"]["selector"].update(matchLabels={})):
        bad = copy.deepcopy(pool)
        mutate(bad)
        with pytest.raises(jsonschema.ValidationError):
            validate_inference_pool(bad)


# ------------------------------------------------------------------ the operator

pytestmark_async = pytest.mark.asyncio(loop_scope="session")
NS = "gie"
POOL = inferencepool.pool_name("qwen2.5-7b")
POOL_PATH = f"/apis/{crd.GIE_API_VERSION}/namespaces/{NS}/{crd.GIE_PLURAL}"


def _cond(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


async def _pool(cluster: Cluster) -> dict[str, Any] | None:
    return await cluster.kube.get(f"{POOL_PATH}/{POOL}")


@pytestmark_async
async def test_inference_pools_follow_the_modeldeployments(cluster: Cluster, operator: str) -> None:
    # 1. The InferencePool API is not installed: nothing emitted, a condition and a
    #    Warning Event say why; the rest of the ModelDeployment is unaffected.
    short = mdep("qwen-short", pool=EPP, engine={"maxModelLen": 4096})
    del short["metadata"]["uid"]
    await cluster.apply(short, NS)
    md = await cluster.wait_condition(NS, "qwen-short", "InferencePool", "False")
    assert _cond(md, "InferencePool")["reason"] == "CRDNotInstalled"
    assert crd.GIE_PLURAL in _cond(md, "InferencePool")["message"]
    await cluster.wait_object("Deployment", NS, "qwen-short")
    events = await cluster.wait_for(lambda: cluster.events(NS, "qwen-short"), "an Event")
    assert any(e["reason"] == "InferencePool" and e["type"] == "Warning" for e in events), events

    # 2. Installed (the CRD appears): the next reconcile emits the pool.
    cluster.emulator.resources[f"{crd.GIE_API_VERSION}/{crd.GIE_PLURAL}"] = kmock.ResourceInfo(
        kind=crd.GIE_KIND, singular="inferencepool", namespaced=True,
        verbs={"create", "delete", "get", "list", "patch", "update", "watch"})
    await cluster.patch(crd.KIND, NS, "qwen-short", {"spec": {"gateway": {"weight": 90}}})
    md = await cluster.wait_condition(NS, "qwen-short", "InferencePool", "True")
    assert md["status"]["inferencePool"] == POOL
    pool = await cluster.wait_for(lambda: _pool(cluster), "the InferencePool")
    validate_inference_pool({k: v for k, v in pool.items() if k != "status"} | {
        "metadata": {k: pool["metadata"][k] for k in ("name", "namespace", "labels")}})
    dep = await cluster.get("Deployment", NS, "qwen-short")
    assert pool["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert [o["name"] for o in pool["metadata"]["ownerReferences"]] == ["qwen-short"]

    # 3. The long pool of the same model joins it as a second owner.
    long_ = mdep("qwen-long", pool=EPP, engine={"maxModelLen": 32768})
    del long_["metadata"]["uid"]
    await cluster.apply(long_, NS)

    async def owners() -> list[str] | None:
        p = await _pool(cluster)
        names = sorted(o["name"] for o in (p or {}).get("metadata", {}).get("ownerReferences") or [])
        return names if names == ["qwen-long", "qwen-short"] else None
    await cluster.wait_for(owners, "both ModelDeployments owning the pool")

    # 4. One is deleted: the pool stays with the other; the switch goes off there: gone.
    assert await cluster.delete(crd.KIND, NS, "qwen-short")

    async def only_long() -> bool:
        p = await _pool(cluster)
        return p is not None and [o["name"] for o in p["metadata"].get("ownerReferences") or []] == ["qwen-long"]
    await cluster.wait_for(only_long, "the pool owned by qwen-long alone")
    await cluster.patch(crd.KIND, NS, "qwen-long", {"spec": {"gateway": {"inferencePool": {"enabled": False}}}})

    async def gone() -> bool:
        return await _pool(cluster) is None
    await cluster.wait_for(gone, "the pool deleted once nobody asks for it")
    md = await cluster.wait_object(crd.KIND, NS, "qwen-long",
                                   lambda o: not _cond(o, "InferencePool"), "the condition dropped")
    assert "inferencePool" not in md["status"]
