"""parse_spec: defaults from the CRD schema, and errors that name field and rule."""

from __future__ import annotations

from typing import Any

import pytest

from pagefleet.operator.spec import DEFAULT_IMAGE, AutoscalingSpec, SpecError, parse_spec


def cr(spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "m", "namespace": "ns", "uid": "u"}, "spec": spec}


def test_defaults_match_the_crd() -> None:
    s = parse_spec(cr({"model": "org/model", "autoscaling": {"enabled": True}}))
    assert (s.served_model_name, s.image, s.replicas, s.resources.gpus) == ("org/model", DEFAULT_IMAGE, 1, 1)
    assert s.autoscaling == AutoscalingSpec(enabled=True, min_replicas=1, max_replicas=4,
                                            metric="concurrency", target=256,
                                            scale_up_stabilization_seconds=0,
                                            scale_down_stabilization_seconds=300, interval_seconds=15)
    assert s.engine == {} and s.extra_args == ()
    assert s.generation is None, "an emulator without generation is fine"
    assert parse_spec(cr({"model": "m"})).autoscaling.enabled is False
    assert parse_spec(cr({"model": "m"}), default_image="reg/img:1").image == "reg/img:1"


def test_zero_values_are_kept_not_defaulted() -> None:
    s = parse_spec(cr({"model": "m", "replicas": 0, "resources": {"gpus": 0},
                       "autoscaling": {"scaleDownStabilizationSeconds": 0}}))
    assert (s.replicas, s.resources.gpus, s.autoscaling.scale_down_stabilization_seconds) == (0, 0, 0)


INVALID = [
    ({}, "spec.model", "is required"),
    ({"model": ""}, "spec.model", "must not be empty"),
    ({"model": 7}, "spec.model", "must be a string"),
    ({"model": "m", "engine": {"gpuMemoryUtilization": 1.5}}, "spec.engine.gpuMemoryUtilization",
     "must be > 0 and <= 1 (got 1.5)"),
    ({"model": "m", "engine": {"gpuMemoryUtilization": 0}}, "spec.engine.gpuMemoryUtilization", "must be > 0"),
    ({"model": "m", "engine": {"maxModelLen": 0}}, "spec.engine.maxModelLen", "must be >= 1"),
    ({"model": "m", "engine": {"maxNumSeqs": "many"}}, "spec.engine.maxNumSeqs", "must be an integer"),
    ({"model": "m", "engine": {"blockSize": 24}}, "spec.engine.blockSize", "must be one of 8, 16, 32, 64, 128"),
    ({"model": "m", "engine": {"schedulingPolicy": "lifo"}}, "spec.engine.schedulingPolicy", "must be one of"),
    ({"model": "m", "engine": {"enablePrefixCaching": "yes"}}, "spec.engine.enablePrefixCaching",
     "must be true or false"),
    ({"model": "m", "engine": {"extraArgs": ["--port", "9000"]}}, "spec.engine.extraArgs", "must not set --port"),
    ({"model": "m", "engine": {"extraArgs": ["--api-key=x"]}}, "spec.engine.extraArgs", "must not set --api-key"),
    # argparse would read these as --port / --served-model-name; the server's parser
    # (allow_abbrev=False) refuses them, and so does the operator, on the parsed result.
    ({"model": "m", "engine": {"extraArgs": ["--po", "9000"]}}, "spec.engine.extraArgs", "unrecognized arguments: --po"),
    ({"model": "m", "engine": {"extraArgs": ["--served-model", "x"]}}, "spec.engine.extraArgs", "unrecognized"),
    ({"model": "m", "engine": {"extraArgs": ["--config", "/etc/x.yaml"]}}, "spec.engine.extraArgs", "must not set --config"),
    ({"model": "m", "engine": {"extraArgs": ["other-model"]}}, "spec.engine.extraArgs", "positional"),
    ({"model": "m", "engine": {"extraArgs": ["--max-num-seqs", "many"]}}, "spec.engine.extraArgs", "invalid int"),
    ({"model": "m", "resources": {"gpus": 4}, "engine": {"extraArgs": ["--tensor-parallel-size", "2"]}},
     "spec.engine.extraArgs", "--tensor-parallel-size 2 must equal resources.gpus (4)"),
    ({"model": "m", "resources": {"gpus": 9}}, "spec.resources.gpus", "must be <= 8"),
    ({"model": "m", "engine": {"quantization": "int3"}}, "spec.engine.quantization", "must be one of fp8, awq"),
    ({"model": "m", "engine": {"shutdownTimeout": -1}}, "spec.engine.shutdownTimeout", "must be >= 0"),
    ({"model": "m", "tolerations": [{"key": "gpu", "tolerationSeconds": "long"}]},
     "spec.tolerations[0].tolerationSeconds", "must be an integer"),
    ({"model": "m", "affinity": {"nodeAfinity": {}}}, "spec.affinity.nodeAfinity", "is not a known field"),
    ({"model": "m", "topologySpreadConstraints": [{"maxSkew": 1}]}, "spec.topologySpreadConstraints[0].topologyKey",
     "is required"),
    ({"model": "m", "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"key": 3}}}]},
     "spec.env[0].valueFrom.secretKeyRef.key", "must be a string"),
    ({"model": "m", "volumes": [{"name": "host", "hostPath": {"path": "/"}}]}, "spec.volumes[0].hostPath",
     "is not a known field"),
    ({"model": "m", "volumes": [{"name": "tmp", "emptyDir": {}}]}, "spec.volumes[0].name", "the operator's volume"),
    ({"model": "m", "volumes": [{"name": "v", "emptyDir": {}}], "volumeMounts": [{"name": "w", "mountPath": "/w"}]},
     "spec.volumeMounts[0].name", "no volume named 'w'"),
    ({"model": "m", "volumes": [{"name": "v", "emptyDir": {}}], "volumeMounts": [{"name": "v", "mountPath": "/tmp"}]},
     "spec.volumeMounts[0].mountPath", "the operator mounts"),
    ({"model": "m", "podSecurityContext": {"runAsUser": "root"}}, "spec.podSecurityContext.runAsUser",
     "must be an integer"),
    ({"model": "m", "autoscaling": {"metric": "vllm:my_gauge"}}, "spec.autoscaling.target", "is required"),
    ({"model": "m", "autoscaling": {"target": 4, "targetWaitingRequests": 5}},
     "spec.autoscaling.targetWaitingRequests", "deprecated"),
    ({"model": "m", "oomRemediation": {"floor": 1.5}}, "spec.oomRemediation.floor", "must be > 0 and <= 1"),
    ({"model": "m", "disruption": {"maxUnavailable": 0}}, "spec.disruption.maxUnavailable", "must be >= 1"),
    ({"model": "m", "hfTokenSecretRef": {"key": "t"}}, "spec.hfTokenSecretRef.name", "is required"),
    ({"model": "m", "replicas": -1}, "spec.replicas", "must be >= 0"),
    ({"model": "m", "autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "spec.autoscaling.minReplicas",
     "must be <= maxReplicas"),
    ({"model": "m", "autoscaling": {"minReplicas": -1}}, "spec.autoscaling.minReplicas", "must be >= 0"),
    ({"model": "m", "autoscaling": {"scaleToZeroIdleSeconds": 0}}, "spec.autoscaling.scaleToZeroIdleSeconds",
     "must be >= 1"),
    ({"model": "m", "gateway": {"weight": -1}}, "spec.gateway.weight", "must be >= 0"),
    ({"model": "m", "gateway": {"queueTimeoutSeconds": 0}}, "spec.gateway.queueTimeoutSeconds", "must be > 0"),
    ({"model": "m", "gateway": {"inferencePool": {}}}, "spec.gateway.inferencePool.endpointPicker",
     "is required"),
    ({"model": "m", "gateway": {"inferencePool": {"endpointPicker": {"name": "epp", "port": 0}}}},
     "spec.gateway.inferencePool.endpointPicker.port", "must be >= 1"),
    ({"model": "m", "gateway": {"inferencePool": {"endpointPicker": {"name": "epp", "failureMode": "Maybe"}}}},
     "spec.gateway.inferencePool.endpointPicker.failureMode", "must be one of"),
    ({"model": "m", "autoscaling": {"targetWaitingRequests": 0}}, "spec.autoscaling.targetWaitingRequests",
     "must be > 0"),
    ({"model": "m", "autoscaling": {"intervalSeconds": 0}}, "spec.autoscaling.intervalSeconds", "must be >= 1"),
    ({"model": "m", "autoscaling": {"metric": "not a metric"}}, "spec.autoscaling.metric", "must match"),
    ({"model": "m", "resources": {"memory": "lots"}}, "spec.resources.memory", "quantity"),
    ({"model": "m", "resources": {"gpus": -1}}, "spec.resources.gpus", "must be >= 0"),
    ({"model": "m", "apiKeySecretRef": {}}, "spec.apiKeySecretRef.name", "is required"),
    ({"model": "m", "modelCache": {"claimName": "c", "mountPath": "relative"}}, "spec.modelCache.mountPath",
     "must match"),
    ({"model": "m", "env": [{"value": "x"}]}, "spec.env[0].name", "is required"),
    ({"model": "m", "nodeSelector": {"a": 1}}, "spec.nodeSelector", "must map strings to strings"),
]


@pytest.mark.parametrize("spec,field,rule", INVALID, ids=[f"{f}:{r}" for _, f, r in INVALID])
def test_invalid_specs_name_field_and_rule(spec: dict[str, Any], field: str, rule: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec(cr(spec))
    assert e.value.field == field
    assert rule in e.value.rule
    assert str(e.value).startswith(f"{field}: ")


def test_missing_or_non_object_spec() -> None:
    with pytest.raises(SpecError, match="^spec: is required"):
        parse_spec({"metadata": {"name": "m"}})
    with pytest.raises(SpecError, match="^spec: must be an object"):
        parse_spec(cr(["model"]))


def test_extra_args_the_server_accepts_pass() -> None:
    s = parse_spec(cr({"model": "m", "resources": {"gpus": 2}, "engine": {"extraArgs": [
        "--enforce-eager", "--seed=7", "--disable-log-requests", "--tensor-parallel-size", "2"]}}))
    assert s.extra_args[0] == "--enforce-eager"


@pytest.mark.parametrize("autoscaling,metric,target", [
    ({}, "concurrency", 256.0),                                       # the server's max-num-seqs
    ({"metric": "waiting"}, "waiting", 5.0),
    ({"metric": "kvCacheUsage"}, "kvCacheUsage", 0.8),
    ({"targetWaitingRequests": 3}, "waiting", 3.0),                    # the first release's field
    ({"metric": "vllm:num_requests_waiting", "targetWaitingRequests": 2}, "vllm:num_requests_waiting", 2.0),
    ({"metric": "vllm:my_gauge", "target": 7}, "vllm:my_gauge", 7.0),
])
def test_autoscaling_metric_and_target(autoscaling: dict[str, Any], metric: str, target: float) -> None:
    a = parse_spec(cr({"model": "m", "autoscaling": {"enabled": True, **autoscaling}})).autoscaling
    assert (a.metric, a.target) == (metric, target)


def test_concurrency_target_follows_max_num_seqs() -> None:
    assert parse_spec(cr({"model": "m", "engine": {"maxNumSeqs": 96}})).autoscaling.target == 96
    assert parse_spec(cr({"model": "m", "engine": {"maxNumSeqs": 96, "extraArgs": ["--max-num-seqs", "32"]}})
                      ).autoscaling.target == 32, "extraArgs come last, so they win"


def test_spec_hash_ignores_what_only_sizes_the_fleet() -> None:
    base = parse_spec(cr({"model": "m", "replicas": 1})).spec_hash
    assert parse_spec(cr({"model": "m", "replicas": 5, "autoscaling": {"enabled": True}})).spec_hash == base
    assert parse_spec(cr({"model": "m", "engine": {"maxModelLen": 8}})).spec_hash != base


@pytest.mark.parametrize("rollout,surge,unavailable", [
    ({}, None, None),                                          # unset: resources.py decides
    ({"maxSurge": 0, "maxUnavailable": 1}, 0, 1),              # a full GPU pool
    ({"maxSurge": "25%", "maxUnavailable": "100%"}, "25%", "100%"),
    ({"maxSurge": "150%"}, "150%", None),                      # a surge may exceed 100%
    ({"maxUnavailable": 0}, None, 0),                          # one zero is fine
    ({"maxSurge": "0%", "maxUnavailable": 2}, "0%", 2),
])
def test_rollout_is_kept_as_kubernetes_int_or_string(rollout: dict[str, Any], surge: Any, unavailable: Any) -> None:
    r = parse_spec(cr({"model": "m", "rollout": rollout})).rollout
    assert (r.max_surge, r.max_unavailable) == (surge, unavailable)


@pytest.mark.parametrize("rollout,field,rule", [
    ({"maxSurge": 0, "maxUnavailable": 0}, "spec.rollout", "must not both be 0"),
    ({"maxSurge": "0%", "maxUnavailable": 0}, "spec.rollout", "must not both be 0"),
    ({"maxSurge": 0, "maxUnavailable": "0%"}, "spec.rollout", "must not both be 0"),
    ({"maxSurge": -1}, "spec.rollout.maxSurge", "must be >= 0"),
    ({"maxSurge": "1"}, "spec.rollout.maxSurge", "percentage"),      # a string must be a percentage
    ({"maxSurge": "01%"}, "spec.rollout.maxSurge", "percentage"),
    ({"maxSurge": "5%\n"}, "spec.rollout.maxSurge", "percentage"),
    ({"maxSurge": True}, "spec.rollout.maxSurge", "percentage"),
    ({"maxSurge": 1.5}, "spec.rollout.maxSurge", "percentage"),
    ({"maxUnavailable": "101%"}, "spec.rollout.maxUnavailable", "percentage"),
    ({"maxUnavailable": "x%"}, "spec.rollout.maxUnavailable", "percentage"),
])
def test_invalid_rollout_names_the_field(rollout: dict[str, Any], field: str, rule: str) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec(cr({"model": "m", "rollout": rollout}))
    assert e.value.field == field and rule in e.value.rule


def test_startup_timeout_defaults_to_30_minutes_and_is_bounded() -> None:
    assert parse_spec(cr({"model": "m"})).startup_timeout_seconds == 1800
    assert parse_spec(cr({"model": "m", "startupTimeoutSeconds": 7200})).startup_timeout_seconds == 7200
    for bad, rule in ((59, "must be >= 60"), (4 * 3600 + 1, "must be <= 14400"), ("1h", "must be an integer")):
        with pytest.raises(SpecError) as e:
            parse_spec(cr({"model": "m", "startupTimeoutSeconds": bad}))
        assert e.value.field == "spec.startupTimeoutSeconds" and rule in e.value.rule


def test_spec_hash_ignores_the_rollout_strategy_but_not_the_startup_budget() -> None:
    """The rollout strategy is the Deployment's, not the pods': changing it must not
    change the template hash (which would re-render the template and roll every pod).
    The startup budget is the pods' startup probe, so it must."""
    base = parse_spec(cr({"model": "m"})).spec_hash
    assert parse_spec(cr({"model": "m", "rollout": {"maxSurge": 0, "maxUnavailable": "50%"}})).spec_hash == base
    assert parse_spec(cr({"model": "m", "startupTimeoutSeconds": 7200})).spec_hash != base
