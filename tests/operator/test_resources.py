"""Table tests of the pure renderer: spec -> Deployment, Service, PDB."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest

from pagefleet.operator import resources
from pagefleet.operator.spec import SpecError, parse_spec
from pagefleet.server.cli import build_configs
from pagefleet.server.config import ServerConfig

UID = "0b0e7c54-5a4e-4c8e-9a59-1d7f8f0f5e11"


def cr(spec: dict[str, Any], name: str = "qwen", uid: str | None = UID) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ml"}
    if uid:
        meta["uid"] = uid
    return {"apiVersion": "pagefleet.dev/v1alpha1", "kind": "ModelDeployment", "metadata": meta,
            "spec": {"model": "Qwen/Qwen2.5-7B-Instruct", **spec}}


def render(spec: dict[str, Any], replicas: int = 1, **kw: Any) -> dict[str, Any]:
    return resources.deployment(parse_spec(cr(spec, **kw)), replicas)


def container(dep: dict[str, Any]) -> dict[str, Any]:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def env_of(dep: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in container(dep)["env"]}


FULL_ENGINE = {"maxModelLen": 32768, "gpuMemoryUtilization": 0.85, "maxNumSeqs": 16,
               "maxNumBatchedTokens": 8192, "blockSize": 32, "enablePrefixCaching": False,
               "enableChunkedPrefill": True, "kvCacheDtype": "fp8", "dtype": "bfloat16",
               "schedulingPolicy": "priority", "shortPromptTokens": 512}


def test_args_start_with_model_and_listener() -> None:
    args = container(render({"servedModelName": "qwen2.5-7b"}))["args"]
    assert args == ["Qwen/Qwen2.5-7B-Instruct", "--served-model-name", "qwen2.5-7b",
                    "--host", "0.0.0.0", "--port", "8000"]


def test_served_model_name_defaults_to_model() -> None:
    args = container(render({}))["args"]
    assert args[1:3] == ["--served-model-name", "Qwen/Qwen2.5-7B-Instruct"]


def test_every_engine_field_is_rendered_with_the_server_flag() -> None:
    args = container(render({"engine": {**FULL_ENGINE, "extraArgs": ["--enforce-eager", "--seed", "7"]}}))["args"]
    assert args[7:] == ["--max-model-len", "32768", "--gpu-memory-utilization", "0.85",
                        "--max-num-seqs", "16", "--max-num-batched-tokens", "8192", "--block-size", "32",
                        "--no-enable-prefix-caching", "--enable-chunked-prefill", "--kv-cache-dtype", "fp8",
                        "--dtype", "bfloat16", "--scheduling-policy", "priority",
                        "--short-prompt-tokens", "512", "--enforce-eager", "--seed", "7"]


def test_rendered_args_parse_back_into_the_same_server_config() -> None:
    """The contract with `pagefleet serve`: its own parser reads our args back."""
    args = container(render({"servedModelName": "q", "engine": {**FULL_ENGINE, "extraArgs": ["--enforce-eager"]}}))["args"]
    engine, server, _ = build_configs(args)
    assert (engine.model, server.served_model_name, server.host, server.port) == (
        "Qwen/Qwen2.5-7B-Instruct", ["q"], "0.0.0.0", resources.PORT)
    assert (engine.max_model_len, engine.gpu_memory_utilization, engine.max_num_seqs,
            engine.max_num_batched_tokens, engine.block_size, engine.enable_prefix_caching,
            engine.enable_chunked_prefill, engine.kv_cache_dtype, engine.dtype,
            engine.scheduling_policy, engine.short_prompt_tokens, engine.enforce_eager) == (
        32768, 0.85, 16, 8192, 32, False, True, "fp8", "bfloat16", "priority", 512, True)


def test_unset_engine_fields_keep_server_defaults() -> None:
    args = container(render({"engine": {"maxNumSeqs": 96}}))["args"]
    assert "--max-model-len" not in args and "--gpu-memory-utilization" not in args
    engine, _, _ = build_configs(args)
    assert engine.max_num_seqs == 96 and engine.gpu_memory_utilization == 0.9


@pytest.mark.parametrize("gpus,cpu,memory,requests,limits", [
    (1, None, None, {"nvidia.com/gpu": "1", "ephemeral-storage": "50Gi"}, {"nvidia.com/gpu": "1"}),
    (2, "8", "48Gi", {"nvidia.com/gpu": "2", "cpu": "8", "memory": "48Gi", "ephemeral-storage": "50Gi"},
     {"nvidia.com/gpu": "2", "memory": "48Gi"}),
    (0, "4", "16Gi", {"cpu": "4", "memory": "16Gi", "ephemeral-storage": "50Gi"}, {"memory": "16Gi"}),
])
def test_resources(gpus: int, cpu: str | None, memory: str | None, requests: dict[str, str],
                   limits: dict[str, str]) -> None:
    spec = {"resources": {"gpus": gpus, **({"cpu": cpu} if cpu else {}), **({"memory": memory} if memory else {})}}
    res = container(render(spec))["resources"]
    assert res.get("requests") == requests
    assert res.get("limits") == limits


def test_gpu_default_and_toleration() -> None:
    dep = render({})
    assert container(dep)["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
        dep["spec"]["template"]["spec"]["tolerations"]
    assert "tolerations" not in render({"resources": {"gpus": 0}})["spec"]["template"]["spec"]
    own = [{"key": "nvidia.com/gpu", "operator": "Equal", "value": "h200", "effect": "NoSchedule"}]
    assert render({"tolerations": own})["spec"]["template"]["spec"]["tolerations"] == own


def test_shm_is_a_memory_empty_dir() -> None:
    dep = render({"resources": {"shmSize": "8Gi"}})
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container(dep)["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in \
        render({})["spec"]["template"]["spec"]["volumes"]


def test_model_cache_pvc_mounts_where_hf_home_points() -> None:
    dep = render({"modelCache": {"claimName": "hf-cache", "mountPath": "/cache/hf"}})
    pod = dep["spec"]["template"]["spec"]
    # readOnly false is not written: the API server drops it (omitempty), see test_drift.
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "hf-cache"}} in pod["volumes"]
    mount = next(m for m in container(dep)["volumeMounts"] if m["name"] == "model-cache")
    assert mount == {"name": "model-cache", "mountPath": "/cache/hf"}
    ro = render({"modelCache": {"claimName": "hf-cache", "readOnly": True}})
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "hf-cache", "readOnly": True}} \
        in ro["spec"]["template"]["spec"]["volumes"]
    assert next(m for m in container(ro)["volumeMounts"] if m["name"] == "model-cache")["readOnly"] is True
    assert env_of(dep)["HF_HOME"] == {"name": "HF_HOME", "value": "/cache/hf"}
    assert "ephemeral-storage" not in container(dep)["resources"]["requests"], "the PVC holds the weights"
    # Default mount path; without a cache, a sized emptyDir at the image's HF_HOME.
    assert env_of(render({"modelCache": {"claimName": "c"}}))["HF_HOME"]["value"] == "/models/hf-cache"
    bare = render({"resources": {"ephemeralStorage": "80Gi"}})
    assert env_of(bare)["HF_HOME"]["value"] == "/models/hf-cache"
    vols = {v["name"]: v for v in bare["spec"]["template"]["spec"]["volumes"]}
    assert list(vols) == ["dshm", "tmp", "model-cache"]
    assert vols["model-cache"] == {"name": "model-cache", "emptyDir": {"sizeLimit": "80Gi"}}
    assert container(bare)["resources"]["requests"]["ephemeral-storage"] == "80Gi"


def test_api_key_comes_from_the_secret_never_from_args() -> None:
    dep = render({"apiKeySecretRef": {"name": "qwen-key"}})
    assert env_of(dep)["PAGEFLEET_API_KEY"] == {
        "name": "PAGEFLEET_API_KEY", "valueFrom": {"secretKeyRef": {"name": "qwen-key", "key": "api-key"}}}
    assert "--api-key" not in container(dep)["args"]
    assert "PAGEFLEET_API_KEY" not in env_of(render({}))


def test_user_env_is_appended_but_cannot_replace_managed_vars() -> None:
    dep = render({"apiKeySecretRef": {"name": "k", "key": "token"},
                  "env": [{"name": "HF_HUB_OFFLINE", "value": "1"},
                          {"name": "PAGEFLEET_API_KEY", "value": "leaked"}]})
    env = env_of(dep)
    assert env["HF_HUB_OFFLINE"] == {"name": "HF_HUB_OFFLINE", "value": "1"}
    assert env["PAGEFLEET_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "k", "key": "token"}


def test_probes_are_on_health_and_sized_for_slow_loads() -> None:
    c = container(render({}))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60, "a model load may take many minutes"
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 60, "a busy server is not restarted quickly"
    assert live["timeoutSeconds"] >= 5
    assert c["readinessProbe"]["periodSeconds"] <= live["periodSeconds"]


def test_draining_prestop_and_grace_period() -> None:
    dep = render({})
    c = container(dep)
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert sleep > 0
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    shutdown = ServerConfig().shutdown_timeout
    assert grace > sleep + shutdown, "preStop plus the server's shutdown timeout fit in the grace period"


def test_rollout_never_reduces_capacity() -> None:
    spec = render({})["spec"]
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    assert spec["progressDeadlineSeconds"] >= 30 * 60


@pytest.mark.parametrize("startup,failures,deadline", [
    (None, 180, 1800 + 600),          # unset: 30 minutes, as before the field existed
    (60, 6, 60 + 600),
    (7200, 720, 7200 + 600),          # a cold 70B+ download on a slow link
    (14400, 1440, 14400 + 600),
    (125, 13, 130 + 600),             # rounded up to the probe period: never less than asked
])
def test_startup_timeout_sizes_the_startup_probe_and_the_progress_deadline(
        startup: int | None, failures: int, deadline: int) -> None:
    dep = render({} if startup is None else {"startupTimeoutSeconds": startup})
    probe = container(dep)["startupProbe"]
    assert (probe["periodSeconds"], probe["failureThreshold"]) == (10, failures)
    assert probe["periodSeconds"] * probe["failureThreshold"] >= (startup or 1800)
    # A rollout waits for a new pod's whole startup budget: the deadline must cover it,
    # or a slow but healthy load is reported Stalled (ProgressDeadlineExceeded).
    assert dep["spec"]["progressDeadlineSeconds"] == deadline


def test_startup_timeout_is_the_servers_readiness_deadline_too() -> None:
    """A load longer than 30 minutes must not fail inside the server while the pod's
    budget allows it: the server gets --startup-timeout, and only when the field is
    set (unchanged args keep existing fleets from rolling)."""
    def args(spec: dict[str, Any]) -> list[str]:
        return resources.server_args(parse_spec(cr(spec)))
    assert "--startup-timeout" not in args({})
    got = args({"startupTimeoutSeconds": 7200})
    assert got[got.index("--startup-timeout") + 1] == "7200"
    assert build_configs(got)[0].startup_timeout == 7200
    own = args({"startupTimeoutSeconds": 7200,
                "engine": {"extraArgs": ["--startup-timeout", "9000"]}})
    assert own.count("--startup-timeout") == 1 and own[own.index("--startup-timeout") + 1] == "9000"


def test_labels_selectors_and_ports_line_up() -> None:
    s = parse_spec(cr({}))
    dep, svc, pdb = resources.deployment(s, 2), resources.service(s), resources.pod_disruption_budget(s, 2)
    selector = dep["spec"]["selector"]["matchLabels"]
    template_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= template_labels.items()
    assert svc["spec"]["selector"] == selector == pdb["spec"]["selector"]["matchLabels"]
    assert selector == {"pagefleet.dev/model-deployment": "qwen", "app.kubernetes.io/component": "server"}
    assert resources.selector_string("qwen") == \
        "app.kubernetes.io/component=server,pagefleet.dev/model-deployment=qwen"
    assert dep["spec"]["replicas"] == 2
    assert container(dep)["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["maxUnavailable"] == 1
    for obj in (dep, svc, pdb):
        assert obj["metadata"]["name"] == "qwen" and obj["metadata"]["namespace"] == "ml"
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "pagefleet-operator"
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert (ann["prometheus.io/port"], ann["prometheus.io/path"]) == ("8000", "/metrics")


def test_owner_references() -> None:
    s = parse_spec(cr({}))
    for obj in (resources.deployment(s, 1), resources.service(s), resources.pod_disruption_budget(s, 1)):
        assert obj["metadata"]["ownerReferences"] == [{
            "apiVersion": "pagefleet.dev/v1alpha1", "kind": "ModelDeployment", "name": "qwen",
            "uid": UID, "controller": True, "blockOwnerDeletion": True}]
    assert "ownerReferences" not in render({}, uid=None)["metadata"], "no uid, no (invalid) reference"


def test_scheduling_fields_pass_through() -> None:
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}]}}}
    pod = render({"nodeSelector": {"pool": "gpu"}, "affinity": affinity,
                  "priorityClassName": "inference"})["spec"]["template"]["spec"]
    assert (pod["nodeSelector"], pod["affinity"], pod["priorityClassName"]) == ({"pool": "gpu"}, affinity, "inference")
    bare = render({})["spec"]["template"]["spec"]
    assert not {"nodeSelector", "affinity", "priorityClassName"} & bare.keys()


@pytest.mark.parametrize("spec,live,expected", [
    ({"replicas": 3}, None, 3),
    ({"replicas": 3}, 5, 3),                                             # spec.replicas rules
    ({"replicas": 3, "autoscaling": {"enabled": True, "minReplicas": 2}}, None, 2),
    ({"replicas": 3, "autoscaling": {"enabled": True, "maxReplicas": 6}}, 5, 5),  # keep the autoscaler's
    ({"autoscaling": {"enabled": True, "maxReplicas": 2}}, 5, 2),        # new bounds clamp it
    ({"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 3}}, 1, 2),
    ({"replicas": 0}, 2, 0),
])
def test_initial_replicas(spec: dict[str, Any], live: int | None, expected: int) -> None:
    assert resources.initial_replicas(parse_spec(cr(spec)), live) == expected


def test_merge_patch_removes_only_what_we_applied_before() -> None:
    previous = {"spec": {"a": 1, "b": {"c": 2, "d": 3}, "gone": True}}
    desired = {"spec": {"a": 2, "b": {"c": 2}, "new": [1]}}
    assert resources.merge_patch(previous, desired) == {
        "spec": {"a": 2, "b": {"c": 2, "d": None}, "new": [1], "gone": None}}
    assert resources.merge_patch(None, desired) == desired


def test_apply_patch_drops_a_removed_node_selector() -> None:
    s1 = parse_spec(cr({"nodeSelector": {"pool": "gpu"}}))
    live = resources.with_last_applied(resources.deployment(s1, 1))
    live["spec"]["template"]["spec"]["schedulerName"] = "default-scheduler"  # set by the API server
    s2 = parse_spec(cr({}))
    patch = resources.apply_patch(live, resources.deployment(s2, 1))
    pod_patch = patch["spec"]["template"]["spec"]
    assert pod_patch["nodeSelector"] is None
    assert "schedulerName" not in pod_patch, "fields we never set are left alone"
    # Applying the patch the RFC 7386 way gives the desired template.
    merged = _apply_merge_patch(copy.deepcopy(live), patch)
    assert "nodeSelector" not in merged["spec"]["template"]["spec"]
    assert merged["spec"]["template"]["spec"]["containers"] == resources.deployment(s2, 1)["spec"]["template"]["spec"]["containers"]


def _apply_merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return patch
    target = target if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        else:
            target[k] = _apply_merge_patch(target.get(k), v)
    return target


# ------------------------------------------------------------- issue 12 / 14 / 15

def test_server_pods_meet_pod_security_restricted_by_default() -> None:
    from tests.deploy.podsecurity import restricted_violations

    dep = render({})
    pod = dep["spec"]["template"]["spec"]
    assert restricted_violations(pod) == []
    assert pod["automountServiceAccountToken"] is False, "the server needs no API token"
    c = container(dep)
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert env_of(dep)["HOME"]["value"] == "/tmp", "caches go to the /tmp emptyDir"
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    # Overrides merge key by key.
    own = render({"podSecurityContext": {"runAsUser": 2000, "fsGroup": 3000},
                  "securityContext": {"readOnlyRootFilesystem": False},
                  "automountServiceAccountToken": True, "serviceAccountName": "reader"})
    psc = own["spec"]["template"]["spec"]["securityContext"]
    assert (psc["runAsUser"], psc["fsGroup"], psc["runAsNonRoot"]) == (2000, 3000, True)
    assert container(own)["securityContext"]["readOnlyRootFilesystem"] is False
    assert container(own)["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert own["spec"]["template"]["spec"]["serviceAccountName"] == "reader"
    assert own["spec"]["template"]["spec"]["automountServiceAccountToken"] is True


def test_child_names_are_valid_service_names() -> None:
    """`qwen2.5-7b` is a valid ModelDeployment name but not a Service name."""
    s = parse_spec(cr({}, name="qwen2.5-7b"))
    dep, svc, pdb = resources.deployment(s, 1), resources.service(s), resources.pod_disruption_budget(s, 1)
    for obj in (dep, svc, pdb):
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", obj["metadata"]["name"]) and len(obj["metadata"]["name"]) <= 63
        assert obj["metadata"]["ownerReferences"][0]["name"] == "qwen2.5-7b"
    assert svc["metadata"]["name"].startswith("qwen2-5-7b-")
    assert resources.endpoint(s) == f"http://{svc['metadata']['name']}.ml.svc:8000/v1"
    assert parse_spec(cr({}, name="qwen2-5-7b")).child_name == "qwen2-5-7b", "no collision with the lookalike"
    assert parse_spec(cr({}, name="qwen")).child_name == "qwen", "valid names are kept"


@pytest.mark.parametrize("engine,grace", [
    ({}, 10 + 30 + 5),
    ({"shutdownTimeout": 120}, 10 + 120 + 5),
    ({"extraArgs": ["--shutdown-timeout", "300"]}, 10 + 300 + 5),
    ({"shutdownTimeout": 60, "extraArgs": ["--shutdown-timeout=90.5"]}, 10 + 91 + 5),  # last one wins
])
def test_grace_period_follows_the_effective_shutdown_timeout(engine: dict[str, Any], grace: int) -> None:
    dep = render({"engine": engine})
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == grace


def test_tensor_parallel_from_the_gpu_count() -> None:
    from pagefleet.server.cli import serve_parser

    dep = render({"resources": {"gpus": 4}})
    args = container(dep)["args"]
    assert vars(serve_parser().parse_args(args))["tensor_parallel_size"] == 4
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}, "NCCL's shared memory"
    assert "--tensor-parallel-size" not in container(render({}))["args"], "1 GPU: the server's default"
    given = container(render({"resources": {"gpus": 2}, "engine": {"extraArgs": ["--tensor-parallel-size=2"]}}))["args"]
    assert given.count("--tensor-parallel-size=2") == 1 and "--tensor-parallel-size" not in given


def test_quantization_is_rendered() -> None:
    from pagefleet.server.cli import serve_parser

    args = container(render({"engine": {"quantization": "awq"}}))["args"]
    assert vars(serve_parser().parse_args(args))["quantization"] == "awq"


def test_pod_knobs() -> None:
    dep = render({
        "imagePullSecrets": [{"name": "regcred"}], "runtimeClassName": "nvidia",
        "podMetadata": {"labels": {"kueue.x-k8s.io/queue-name": "gpu", "pagefleet.dev/model-deployment": "evil"},
                        "annotations": {"sidecar.istio.io/inject": "false"}},
        "hfTokenSecretRef": {"name": "hf"},
        "volumes": [{"name": "chat", "configMap": {"name": "templates"}}],
        "volumeMounts": [{"name": "chat", "mountPath": "/etc/chat", "readOnly": True}],
        "topologySpreadConstraints": [],
    })
    t = dep["spec"]["template"]
    assert t["spec"]["imagePullSecrets"] == [{"name": "regcred"}] and t["spec"]["runtimeClassName"] == "nvidia"
    assert t["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu"
    assert t["metadata"]["labels"]["pagefleet.dev/model-deployment"] == "qwen", "the selector label is the operator's"
    assert t["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    assert env_of(dep)["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert {"name": "chat", "configMap": {"name": "templates"}} in t["spec"]["volumes"]
    assert {"name": "chat", "mountPath": "/etc/chat", "readOnly": True} in container(dep)["volumeMounts"]
    assert "topologySpreadConstraints" not in t["spec"], "[] turns the default spread off"
    (spread,) = render({})["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["whenUnsatisfiable"] == "ScheduleAnyway"
    assert spread["labelSelector"]["matchLabels"] == resources.selector_labels("qwen")


@pytest.mark.parametrize("modes,strategy", [
    (["ReadWriteMany"], {"maxUnavailable": 0, "maxSurge": 1}),
    (["ReadOnlyMany"], {"maxUnavailable": 0, "maxSurge": 1}),
    (["ReadWriteOnce"], {"maxUnavailable": 1, "maxSurge": 0}),
    (["ReadWriteOncePod"], {"maxUnavailable": 1, "maxSurge": 0}),
    (None, {"maxUnavailable": 1, "maxSurge": 0}),          # PVC unreadable: the safe choice
])
def test_rollout_strategy_follows_the_cache_access_mode(modes: list[str] | None, strategy: dict[str, int]) -> None:
    s = parse_spec(cr({"modelCache": {"claimName": "c"}}))
    assert resources.deployment(s, 2, modes)["spec"]["strategy"]["rollingUpdate"] == strategy


RWX, RWO, UNKNOWN = ["ReadWriteMany"], ["ReadWriteOnce"], None


@pytest.mark.parametrize("rollout,cache,modes,expected", [
    # No model cache PVC: the user's values; an unset one takes its default.
    ({"maxSurge": 0, "maxUnavailable": 1}, False, RWX, {"maxSurge": 0, "maxUnavailable": 1}),
    ({"maxSurge": "25%", "maxUnavailable": "50%"}, False, RWX, {"maxSurge": "25%", "maxUnavailable": "50%"}),
    ({"maxSurge": 0}, False, RWX, {"maxSurge": 0, "maxUnavailable": 1}),       # 0/0 would never roll
    ({"maxSurge": "0%"}, False, RWX, {"maxSurge": "0%", "maxUnavailable": 1}),
    ({"maxSurge": 2}, False, RWX, {"maxSurge": 2, "maxUnavailable": 0}),
    ({"maxUnavailable": 1}, False, RWX, {"maxSurge": 1, "maxUnavailable": 1}),
    ({"maxUnavailable": 0}, False, RWX, {"maxSurge": 1, "maxUnavailable": 0}),
    # A cache PVC several nodes mount: the same as without one.
    ({"maxSurge": "50%"}, True, RWX, {"maxSurge": "50%", "maxUnavailable": 0}),
    ({"maxUnavailable": 2}, True, RWX, {"maxSurge": 1, "maxUnavailable": 2}),
    # Single-node PVC: never a surge; maxUnavailable may go higher than 1.
    ({"maxUnavailable": 2}, True, RWO, {"maxSurge": 0, "maxUnavailable": 2}),
    ({"maxUnavailable": "50%"}, True, ["ReadWriteOncePod"], {"maxSurge": 0, "maxUnavailable": "50%"}),
    ({"maxSurge": 0, "maxUnavailable": 3}, True, RWO, {"maxSurge": 0, "maxUnavailable": 3}),
    ({"maxSurge": "0%"}, True, RWO, {"maxSurge": "0%", "maxUnavailable": 1}),
    # PVC unreadable: unset values keep the safe default, set ones are taken as given.
    ({}, True, UNKNOWN, {"maxSurge": 0, "maxUnavailable": 1}),
    ({"maxUnavailable": 2}, True, UNKNOWN, {"maxSurge": 0, "maxUnavailable": 2}),
    ({"maxSurge": 1}, True, UNKNOWN, {"maxSurge": 1, "maxUnavailable": 0}),
    ({"maxUnavailable": 0}, True, UNKNOWN, {"maxSurge": 1, "maxUnavailable": 0}),
])
def test_spec_rollout_sets_the_strategy(rollout: dict[str, Any], cache: bool, modes: list[str] | None,
                                        expected: dict[str, Any]) -> None:
    s = parse_spec(cr({"rollout": rollout, **({"modelCache": {"claimName": "c"}} if cache else {})}))
    strategy = resources.deployment(s, 4, modes)["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {
        "maxUnavailable": expected["maxUnavailable"], "maxSurge": expected["maxSurge"]}}


@pytest.mark.parametrize("rollout,modes,field,words", [
    ({"maxSurge": 1}, ["ReadWriteOnce"], "spec.rollout.maxSurge", "must be 0"),
    ({"maxSurge": "10%", "maxUnavailable": 1}, ["ReadWriteOncePod"], "spec.rollout.maxSurge", "must be 0"),
    ({"maxUnavailable": 0}, ["ReadWriteOnce"], "spec.rollout.maxUnavailable", "must be at least 1"),
    ({"maxUnavailable": "0%"}, ["ReadWriteOnce"], "spec.rollout.maxUnavailable", "must be at least 1"),
])
def test_a_surge_with_a_single_node_cache_is_refused(rollout: dict[str, Any], modes: list[str],
                                                     field: str, words: str) -> None:
    """A surge pod on another node can never mount a ReadWriteOnce PVC, so such a
    rollout would stall for good: the spec is refused (InvalidSpec) instead, naming the
    claim and what to do."""
    s = parse_spec(cr({"rollout": rollout, "modelCache": {"claimName": "weights"}}))
    with pytest.raises(SpecError) as e:
        resources.deployment(s, 2, modes)
    assert e.value.field == field and words in e.value.rule
    assert "PVC weights is " + modes[0] in e.value.rule and "cannot surge" in e.value.rule


def test_a_strategy_change_keeps_the_template_and_its_hash() -> None:
    """Changing spec.rollout changes the Deployment's strategy and nothing else: same
    template hash, same pod template, so Kubernetes starts no rollout (no pod restarts)
    and the operator's frozen template still applies."""
    before = parse_spec(cr({"replicas": 3}))
    after = parse_spec(cr({"replicas": 3, "rollout": {"maxSurge": 0, "maxUnavailable": "34%"}}))
    old, new = resources.deployment(before, 3), resources.deployment(after, 3)
    assert after.spec_hash == before.spec_hash
    hashes = (new["metadata"]["annotations"][resources.TEMPLATE_HASH],
              old["metadata"]["annotations"][resources.TEMPLATE_HASH])
    assert hashes[0] == hashes[1]
    assert new["spec"]["template"] == old["spec"]["template"]
    assert new["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": "34%", "maxSurge": 0}
    assert {k: v for k, v in new["spec"].items() if k != "strategy"} == {
        k: v for k, v in old["spec"].items() if k != "strategy"}
    # The live Deployment no longer holds what is wanted: the operator patches it, and
    # the patch leaves the template as it was applied.
    live = resources.with_last_applied(old)
    assert not resources.in_sync(live, new)
    patch = resources.apply_patch(live, new)
    assert patch["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": "34%", "maxSurge": 0}
    assert patch["spec"]["template"] == old["spec"]["template"]
    assert resources.frozen_template(live, after.spec_hash) == old["spec"]["template"]


@pytest.mark.parametrize("spec,replicas,budget", [
    ({}, 1, {"minAvailable": 1}),                       # a drain never takes the only replica
    ({}, 0, {"minAvailable": 1}),
    ({}, 2, {"maxUnavailable": 1}),
    ({"disruption": {"maxUnavailable": 2}}, 4, {"maxUnavailable": 2}),
    ({"disruption": {"evictLastReplica": True}}, 1, {"maxUnavailable": 1}),   # the opt-in
])
def test_pdb_never_takes_a_single_replica_offline_without_opt_in(spec: dict[str, Any], replicas: int,
                                                                  budget: dict[str, int]) -> None:
    pdb = resources.pod_disruption_budget(parse_spec(cr(spec)), replicas)
    assert {k: v for k, v in pdb["spec"].items() if k != "selector"} == budget


def test_oom_override_is_rendered_last() -> None:
    import dataclasses

    from pagefleet.server.cli import serve_parser

    s = parse_spec(cr({"engine": {"gpuMemoryUtilization": 0.9, "extraArgs": ["--gpu-memory-utilization", "0.95"]}}))
    s = dataclasses.replace(s, gpu_memory_utilization_override=0.85)
    args = container(resources.deployment(s, 1))["args"]
    assert vars(serve_parser().parse_args(args))["gpu_memory_utilization"] == 0.85


def test_in_sync_and_frozen_template() -> None:
    s = parse_spec(cr({}))
    desired = resources.deployment(s, 2)
    live = resources.with_last_applied(desired)
    live["spec"]["template"]["spec"]["schedulerName"] = "default-scheduler"   # API server defaults
    live["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
    live["status"] = {"replicas": 2}
    assert resources.in_sync(live, desired)
    edited = copy.deepcopy(live)
    edited["spec"]["template"]["spec"]["containers"][0]["args"].append("--enforce-eager")
    assert not resources.in_sync(edited, desired), "a hand edit is drift"
    # The template applied for this spec hash is re-used as applied (an operator
    # upgrade with new defaults does not roll the pods).
    frozen = resources.frozen_template(live, s.spec_hash)
    assert frozen == desired["spec"]["template"]
    assert resources.frozen_template(live, "another-spec") is None
