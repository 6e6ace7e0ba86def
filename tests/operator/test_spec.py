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
    ({"model": "m", "replicas": -1}, "spec.replicas", "must be >= 0"),
    ({"model": "m", "autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "spec.autoscaling.minReplicas",
     "must be <= maxReplicas"),
    ({"model": "m", "autoscaling": {"minReplicas": 0}}, "spec.autoscaling.minReplicas", "must be >= 1"),
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
