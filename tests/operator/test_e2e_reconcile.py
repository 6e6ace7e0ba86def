"""The real operator process against the Kubernetes API emulator: examples become
Deployments and Services, spec changes roll through, deletes clean up, and bad
ModelDeployments are reported as Degraded (with an Event naming the field)."""

from __future__ import annotations

from typing import Any

import pytest

from pagefleet.operator import crd
from tests.operator.harness import Cluster, load_example

pytestmark = pytest.mark.asyncio(loop_scope="session")

KIND = crd.KIND

# What each example must produce, written out by hand from the YAML (not recomputed
# with the renderer under test): adjacent (flag, value) pairs and single flags.
EXPECTED_ARGS: dict[str, dict[str, list[list[str]]]] = {
    "long-context.yaml": {"qwen-long": [
        ["--served-model-name", "qwen2.5-7b-long"], ["--max-model-len", "32768"], ["--max-num-seqs", "16"],
        ["--max-num-batched-tokens", "8192"], ["--gpu-memory-utilization", "0.9"],
        ["--enable-prefix-caching"], ["--dtype", "bfloat16"]]},
    "short-qa.yaml": {"qwen-short": [
        ["--served-model-name", "qwen2.5-7b"], ["--max-model-len", "4096"], ["--max-num-seqs", "128"],
        ["--scheduling-policy", "fcfs"]]},
    "autoscaling.yaml": {"qwen-autoscaled": [["--max-model-len", "8192"], ["--max-num-seqs", "96"]]},
    "api-key.yaml": {"qwen-private": [["--max-model-len", "8192"]]},
}


def contains_run(args: list[str], run: list[str]) -> bool:
    return any(args[i:i + len(run)] == run for i in range(len(args)))


def server_container(dep: dict[str, Any]) -> dict[str, Any]:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("example", sorted(EXPECTED_ARGS))
async def test_example_creates_deployment_service_and_pdb(cluster: Cluster, operator: str, example: str) -> None:
    ns = "ex-" + example.removesuffix(".yaml")
    docs = load_example(example)
    crs = {}
    for doc in docs:
        created = await cluster.apply(doc, ns)
        if doc["kind"] == KIND:
            crs[doc["metadata"]["name"]] = (doc, created)
    assert set(crs) == set(EXPECTED_ARGS[example])

    for name, (doc, created) in crs.items():
        dep = await cluster.wait_object("Deployment", ns, name)
        svc = await cluster.wait_object("Service", ns, name)
        pdb = await cluster.wait_object("PodDisruptionBudget", ns, name)
        c = server_container(dep)
        args = c["args"]
        assert args[0] == doc["spec"]["model"]
        assert contains_run(args, ["--host", "0.0.0.0"]) and contains_run(args, ["--port", "8000"])
        for run in EXPECTED_ARGS[example][name]:
            assert contains_run(args, run), (run, args)
        # Probes, GPU, draining, rollout.
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
        assert c["resources"]["limits"]["nvidia.com/gpu"] == str(doc["spec"]["resources"]["gpus"])
        assert c["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
        # The rollout never lowers capacity, except that a ReadWriteOnce cache (the
        # long-context example's PVC) cannot take a surge pod on another node.
        single_node = any(d["kind"] == "PersistentVolumeClaim" and d["spec"]["accessModes"] == ["ReadWriteOnce"]
                          for d in docs)
        assert dep["spec"]["strategy"]["rollingUpdate"] == (
            {"maxUnavailable": 1, "maxSurge": 0} if single_node else {"maxUnavailable": 0, "maxSurge": 1})
        # Owner references point at the CR (by uid), on every child.
        for child in (dep, svc, pdb):
            (ref,) = child["metadata"]["ownerReferences"]
            assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
                KIND, name, created["metadata"]["uid"], True)
        assert svc["spec"]["ports"][0] == {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
        assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
        # Replicas: spec.replicas, or minReplicas under autoscaling.
        autoscaling = doc["spec"].get("autoscaling", {})
        expected_replicas = autoscaling["minReplicas"] if autoscaling.get("enabled") else doc["spec"].get("replicas", 1)
        assert dep["spec"]["replicas"] == expected_replicas
        # Example-specific wiring.
        env = {e["name"]: e for e in c.get("env", [])}
        if "apiKeySecretRef" in doc["spec"]:
            ref = doc["spec"]["apiKeySecretRef"]
            assert env["PAGEFLEET_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": ref["name"], "key": ref["key"]}
            assert any(d["kind"] == "Secret" and d["metadata"]["name"] == ref["name"] for d in docs), \
                "the example ships its Secret"
        if "modelCache" in doc["spec"]:
            claim = doc["spec"]["modelCache"]["claimName"]
            vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
            assert vols["model-cache"]["persistentVolumeClaim"]["claimName"] == claim
            mount = next(m for m in c["volumeMounts"] if m["name"] == "model-cache")
            assert env["HF_HOME"]["value"] == mount["mountPath"]
        # Status: selector and endpoint for the scale subresource and for clients.
        md = await cluster.wait_object(KIND, ns, name, lambda o: "selector" in (o.get("status") or {}),
                                       f"{name} status.selector")
        st = md["status"]
        assert st["selector"] == "app.kubernetes.io/component=server,pagefleet.dev/model-deployment=" + name
        assert st["endpoint"] == f"http://{name}.{ns}.svc:8000/v1"
        assert {c["type"] for c in st["conditions"]} >= {"Available", "Progressing", "Degraded",
                                                        "Ready", "Reconciling", "Stalled"}
        if "modelCache" in doc["spec"]:
            cache = next(c for c in st["conditions"] if c["type"] == "CacheShared")
            assert (cache["status"], cache["reason"]) == ("False", "SingleNodeAccessMode")


async def apply_long_context(cluster: Cluster, ns: str, **meta: Any) -> dict[str, Any]:
    doc = next(d for d in load_example("long-context.yaml") if d["kind"] == KIND)
    doc["metadata"].update(meta)
    return await cluster.apply(doc, ns)


async def test_engine_change_updates_the_deployment_args(cluster: Cluster, operator: str) -> None:
    ns = "update"
    await apply_long_context(cluster, ns)
    dep = await cluster.wait_object("Deployment", ns, "qwen-long")
    assert contains_run(server_container(dep)["args"], ["--max-model-len", "32768"])

    await cluster.patch(KIND, ns, "qwen-long", {"spec": {"engine": {"maxModelLen": 16384},
                                                         "nodeSelector": {"gpu": "h200"}}})

    def updated(d: dict[str, Any]) -> bool:
        return contains_run(server_container(d)["args"], ["--max-model-len", "16384"])
    dep = await cluster.wait_object("Deployment", ns, "qwen-long", updated, "args with --max-model-len 16384")
    args = server_container(dep)["args"]
    assert "32768" not in args
    assert contains_run(args, ["--max-num-seqs", "16"]), "the other flags stay"
    assert dep["spec"]["template"]["spec"]["nodeSelector"] == {"gpu": "h200"}

    # A field removed from the spec is removed from the Deployment too.
    await cluster.patch(KIND, ns, "qwen-long", {"spec": {"nodeSelector": None}})
    await cluster.wait_object("Deployment", ns, "qwen-long",
                              lambda d: "nodeSelector" not in d["spec"]["template"]["spec"],
                              "nodeSelector removed")


async def test_kubectl_scale_through_the_scale_subresource(cluster: Cluster, operator: str) -> None:
    ns = "scale"
    await apply_long_context(cluster, ns)
    await cluster.wait_object("Deployment", ns, "qwen-long")
    # `kubectl scale mdep/qwen-long --replicas=3` patches the scale subresource.
    await cluster.patch(KIND, ns, "qwen-long", {"spec": {"replicas": 3}}, sub="scale")
    await cluster.wait_object("Deployment", ns, "qwen-long", lambda d: d["spec"]["replicas"] == 3,
                              "Deployment scaled to 3")
    await cluster.wait_object(KIND, ns, "qwen-long",
                              lambda o: (o.get("status") or {}).get("desiredReplicas") == 3, "desiredReplicas 3")


async def test_delete_removes_the_children(cluster: Cluster, operator: str) -> None:
    ns = "delete"
    await apply_long_context(cluster, ns)
    for kind in ("Deployment", "Service", "PodDisruptionBudget"):
        await cluster.wait_object(kind, ns, "qwen-long")
    # The operator holds a finalizer, so the delete waits for its cleanup.
    await cluster.wait_object(KIND, ns, "qwen-long", lambda o: bool(o["metadata"].get("finalizers")),
                              "the operator's finalizer")
    assert await cluster.delete(KIND, ns, "qwen-long")

    async def all_gone() -> bool:
        for kind in (KIND, "Deployment", "Service", "PodDisruptionBudget"):
            if await cluster.get(kind, ns, "qwen-long") is not None:
                return False
        return True
    await cluster.wait_for(all_gone, "the CR and its Deployment, Service and PDB to be gone")


@pytest.mark.parametrize("name,spec_changes,field", [
    ("bad-gmu", {"engine": {"gpuMemoryUtilization": 1.5}}, "spec.engine.gpuMemoryUtilization"),
    ("no-model", {"model": None}, "spec.model"),
    ("min-over-max", {"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 2}},
     "spec.autoscaling.minReplicas"),
])
async def test_invalid_cr_is_degraded_with_the_field_named(cluster: Cluster, operator: str, name: str,
                                                           spec_changes: dict[str, Any], field: str) -> None:
    ns = "invalid"
    doc = next(d for d in load_example("short-qa.yaml") if d["kind"] == KIND)
    doc["metadata"]["name"] = name
    for key, value in spec_changes.items():
        if value is None:
            doc["spec"].pop(key)
        else:
            doc["spec"][key] = value
    await cluster.apply(doc, ns)

    md = await cluster.wait_condition(ns, name, "Degraded", "True")
    degraded = next(c for c in md["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec"
    assert degraded["message"].startswith(field + ": "), degraded["message"]

    async def warning() -> list[dict[str, Any]]:
        return [e for e in await cluster.events(ns, name)
                if e["type"] == "Warning" and e["reason"] == "InvalidSpec"]
    (event,) = await cluster.wait_for(warning, f"an InvalidSpec Event for {name}")
    assert field in event["message"]
    assert event["involvedObject"]["kind"] == KIND
    assert await cluster.get("Deployment", ns, name) is None, "nothing is deployed from a bad spec"


async def test_fixing_an_invalid_cr_recovers(cluster: Cluster, operator: str) -> None:
    ns = "recover"
    doc = next(d for d in load_example("short-qa.yaml") if d["kind"] == KIND)
    doc["spec"]["engine"]["gpuMemoryUtilization"] = 1.5
    doc["metadata"]["generation"] = 1
    await cluster.apply(doc, ns)
    await cluster.wait_condition(ns, "qwen-short", "Degraded", "True")

    await cluster.patch(KIND, ns, "qwen-short", {"metadata": {"generation": 2},
                                                 "spec": {"engine": {"gpuMemoryUtilization": 0.9}}})
    dep = await cluster.wait_object("Deployment", ns, "qwen-short")
    assert contains_run(server_container(dep)["args"], ["--gpu-memory-utilization", "0.9"])
    md = await cluster.wait_condition(ns, "qwen-short", "Degraded", "False")
    assert md["status"]["observedGeneration"] == 2
