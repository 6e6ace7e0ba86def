"""The emulator's strategic merge patch (what `kubectl apply` sends for a changed
Deployment) gives the API server's result; no cluster needed."""

from __future__ import annotations

from e2e import smp

LIVE = {"metadata": {"name": "d", "annotations": {"a": "1", "b": "2"}},
        "spec": {"replicas": 1, "template": {"spec": {
            "containers": [{"name": "op", "image": "img:1", "args": ["--a"], "env": [
                {"name": "X", "value": "1"}, {"name": "Y", "value": "2"}]},
                {"name": "side", "image": "side:1"}],
            "tolerations": [{"key": "k"}]}}}}


def test_containers_merge_by_name_and_keep_their_other_fields() -> None:
    patch = {"metadata": {"annotations": {"b": None, "c": "3"}},
             "spec": {"template": {"spec": {
                 "$setElementOrder/containers": [{"name": "op"}, {"name": "side"}],
                 "containers": [{"name": "op", "args": ["--a", "--gateway-service=x/y"],
                                 "$setElementOrder/env": [{"name": "X"}, {"name": "Z"}],
                                 "env": [{"name": "Z", "value": "3"}, {"name": "Y", "$patch": "delete"}]}],
                 "tolerations": [{"key": "other"}]}}}}
    out = smp.apply(LIVE, patch)
    op, side = out["spec"]["template"]["spec"]["containers"]
    assert op == {"name": "op", "image": "img:1", "args": ["--a", "--gateway-service=x/y"],
                  "env": [{"name": "X", "value": "1"}, {"name": "Z", "value": "3"}]}
    assert side == {"name": "side", "image": "side:1"}
    assert out["spec"]["template"]["spec"]["tolerations"] == [{"key": "other"}], "no merge key: replaced"
    assert out["metadata"]["annotations"] == {"a": "1", "c": "3"}
    assert out["spec"]["replicas"] == 1
    # As a JSON merge patch (what kmock applies), with deletions as nulls.
    mp = smp.merge_patch(LIVE, out)
    assert mp["metadata"] == {"annotations": {"b": None, "c": "3"}}
    assert "replicas" not in mp["spec"]
    assert mp["spec"]["template"]["spec"]["containers"][0]["image"] == "img:1", "lists are sent whole"
