"""extraArgs that `pagefleet serve` would refuse at startup are an invalid spec.

They pass the server's parser, so only the server's own validation (cli.build_configs,
no model and no GPU) sees them; without it the pods crash-loop instead of the
ModelDeployment being reported InvalidSpec with nothing deployed."""

from __future__ import annotations

from typing import Any

import pytest

from pagefleet.operator import controller, crd
from pagefleet.operator.spec import SpecError
from tests.operator.harness import Cluster


def _body(spec: dict[str, Any], name: str = "m") -> dict[str, Any]:
    return {"apiVersion": crd.API_VERSION, "kind": crd.KIND,
            "metadata": {"name": name, "namespace": "ns", "uid": "u1", "generation": 1}, "spec": spec}


@pytest.mark.parametrize(("extra", "gpus", "flag"), [
    (["--pipeline-parallel-size", "2"], 1, "--pipeline-parallel-size"),
    (["--distributed-executor-backend", "uni"], 2, "--distributed-executor-backend"),
    (["--tensor-parallel-size", "16"], 0, "--tensor-parallel-size"),
    (["--shutdown-timeout", "-5"], 1, "--shutdown-timeout"),
    (["--max-logprobs", "-1"], 1, "--max-logprobs"),
    (["--gpu-memory-utilization", "2"], 1, "--gpu-memory-utilization"),
    (["--queue-timeout", "0"], 1, "--queue-timeout"),
    # vLLM flags the server refuses with a reason: the reason reaches the status.
    (["--download-dir", "/d"], 1, "--download-dir: not supported: Hub models go to the Hugging Face cache"),
    (["--tokenizer-mode", "slow"], 1, "--tokenizer-mode slow: not supported"),
    (["--enable-prefix-caching=maybe"], 1, "--enable-prefix-caching: expected true or false"),
])
def test_args_the_server_refuses_are_invalid(extra: list[str], gpus: int, flag: str) -> None:
    body = _body({"model": "x", "resources": {"gpus": gpus}, "engine": {"extraArgs": extra}})
    with pytest.raises(SpecError) as e:
        controller.resolve(body, controller.Settings())
    assert e.value.field == "spec.engine.extraArgs"
    assert flag in e.value.rule


@pytest.mark.parametrize("spec", [
    {"model": "x"},
    {"model": "x", "resources": {"gpus": 4}, "engine": {"extraArgs": ["--tensor-parallel-size", "4"]}},
    {"model": "x", "engine": {"gpuMemoryUtilization": 0.8, "extraArgs": ["--queue-timeout", "30"]}},
    # vLLM launch-line spellings the server takes (ignored flags, older boolean values,
    # k suffixes) are no invalid spec.
    {"model": "x", "engine": {"extraArgs": ["--max-parallel-loading-workers", "4", "--use-v2-block-manager",
                                            "--enable-chunked-prefill", "False", "--max-model-len", "32k",
                                            "--max-num-batched-tokens", "32k"]}},
])
def test_args_the_server_accepts_pass(spec: dict[str, Any]) -> None:
    controller.resolve(_body(spec), controller.Settings())


@pytest.mark.asyncio(loop_scope="session")
async def test_reconcile_reports_invalid_spec_and_deploys_nothing(cluster: Cluster) -> None:
    ns = "bad-args"
    cr = await cluster.apply({"apiVersion": crd.API_VERSION, "kind": crd.KIND, "metadata": {"name": "m"},
                              "spec": {"model": "x", "engine": {"extraArgs": ["--queue-timeout", "0"]}}}, ns)
    await controller.reconcile(cluster.kube, cr, controller.State(), controller.Settings(), fresh=True)
    assert await cluster.get("Deployment", ns, "m") is None
    body = await cluster.get(crd.KIND, ns, "m")
    assert body is not None
    stalled = next(c for c in body["status"]["conditions"] if c["type"] == "Stalled")
    assert stalled["status"] == "True" and stalled["reason"] == "InvalidSpec"
    assert "--queue-timeout" in stalled["message"]


def test_the_check_runs_in_the_operator_image_without_torch() -> None:
    """The operator image has no torch, numpy or tokenizers (Dockerfile): the server's
    config check it now calls must import without them."""
    import subprocess
    import sys

    code = ("import sys\n"
            "for m in ('torch', 'triton', 'numpy', 'transformers', 'tokenizers', 'xgrammar',"
            " 'fastapi', 'uvicorn', 'msgspec'):\n"
            "    sys.modules[m] = None\n"
            "from pagefleet.operator import controller, crd\n"
            "from pagefleet.operator.spec import SpecError\n"
            "body = {'apiVersion': crd.API_VERSION, 'kind': crd.KIND, 'metadata': {'name': 'm',"
            " 'namespace': 'ns', 'uid': 'u', 'generation': 1}, 'spec': {'model': 'x',"
            " 'engine': {'extraArgs': ['--queue-timeout', '0']}}}\n"
            "try:\n"
            "    controller.resolve(body, controller.Settings())\n"
            "except SpecError as e:\n"
            "    print('refused', e.field)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "refused spec.engine.extraArgs"
