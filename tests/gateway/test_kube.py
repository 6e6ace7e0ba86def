"""Kubernetes discovery: the pure mapping of ModelDeployments and pods onto the fleet,
and the real gateway watching the kmock API emulator, routing to real backends that
the emulated pods point at (their podIP 127.0.0.1, their container port the backend's)."""

from __future__ import annotations

import asyncio
import base64
import uuid

import httpx
import kmock
import pytest
import pytest_asyncio
import yaml

from pagefleet.server.gateway.kube import (
    POD_LABEL,
    fleet_from_objects,
    pod_port,
    pod_ready,
    secret_ref,
    secret_value,
)
from tests.gateway.helpers import GatewayThread, RecordingProxy, gw_metric

NS = "gw"


def mdep(name: str, served: str = "tiny", **spec) -> dict:
    return {"apiVersion": "pagefleet.dev/v1alpha1", "kind": "ModelDeployment",
            "metadata": {"name": name, "namespace": NS, "uid": str(uuid.uuid4())},
            "spec": {"model": "/models/tiny", "servedModelName": served, **spec}}


def pod(name: str, owner: str, port: int, ready: bool = True, **meta) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "uid": str(uuid.uuid4()),
                         "labels": {POD_LABEL: owner}, **meta},
            "spec": {"containers": [{"name": "server", "ports": [
                {"name": "http", "containerPort": port}]}]},
            "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [
                {"type": "Ready", "status": "True" if ready else "False"}]}}


# -- pure ---------------------------------------------------------------------------------------
def test_fleet_from_objects_groups_pools_by_served_name():
    objs = [mdep("short", engine={"maxModelLen": 256, "maxNumSeqs": 8, "blockSize": 32},
                 gateway={"weight": 90}),
            mdep("canary", engine={"maxModelLen": 256, "schedulingPolicy": "priority"},
                 gateway={"weight": 10, "tokenizer": "/tok"}),
            mdep("long", engine={"maxModelLen": 1024}),
            mdep("other", served="x", autoscaling={"enabled": True, "minReplicas": 0})]
    pods = [pod("short-a", "short", 8000), pod("short-b", "short", 8001, ready=False),
            pod("short-c", "short", 8002, deletionTimestamp="2026-01-01T00:00:00Z"),
            pod("long-a", "long", 9000), pod("stray", "nobody", 1)]
    f = fleet_from_objects(objs, pods)
    tiny, x = f.model("tiny"), f.model("x")
    assert [p.name for p in tiny.pools] == ["canary", "long", "short"]
    short = next(p for p in tiny.pools if p.name == "short")
    assert [e.url for e in short.endpoints] == ["http://127.0.0.1:8000"]
    assert (short.max_model_len, short.max_inflight, short.block_size, short.weight) == (256, 8, 32, 90.0)
    canary = next(p for p in tiny.pools if p.name == "canary")
    assert canary.scheduling_policy == "priority" and canary.tokenizer == "/tok"
    assert short.tokenizer == "/models/tiny" and not tiny.scale_from_zero
    assert x.scale_from_zero and x.pools[0].endpoints == ()
    assert fleet_from_objects(objs, pods, all_namespaces=True).model("x").pools[0].name == "gw/other"


def test_pod_readiness_and_port():
    assert pod_ready(pod("a", "m", 1)) and not pod_ready(pod("a", "m", 1, ready=False))
    p = pod("a", "m", 1234)
    assert pod_port(p) == 1234
    p["spec"]["containers"][0]["ports"] = []
    assert pod_port(p) == 8000
    p["status"].pop("podIP")
    assert not pod_ready(p)


# -- against the emulator ------------------------------------------------------------------------
@pytest_asyncio.fixture(loop_scope="session")
async def emulator(tmp_path):
    emu = kmock.KubernetesEmulator()
    async with emu, kmock.Server(emu):
        emu.resources.load_bundled()
        emu.resources["pagefleet.dev/v1alpha1/modeldeployments"] = kmock.ResourceInfo(
            kind="ModelDeployment", singular="modeldeployment", namespaced=True,
            shortnames={"mdep"}, verbs={"create", "delete", "get", "list", "patch", "watch"},
            subresources={"status", "scale"})
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": str(emu.url)}}],
            "users": [{"name": "kmock", "user": {}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}]}))
        yield emu, kubeconfig


async def kube(method: str, url: str, path: str, obj: dict | None = None) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
        r = await c.request(method, path, json=obj, headers=headers)
        assert r.status_code < 300, r.text
        return r


MD_PATH = f"/apis/pagefleet.dev/v1alpha1/namespaces/{NS}/modeldeployments"
POD_PATH = f"/api/v1/namespaces/{NS}/pods"


async def until(cond, what: str, timeout: float = 60):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        v = await asyncio.to_thread(cond)
        if v:
            return v
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.asyncio(loop_scope="session")
async def test_gateway_follows_modeldeployments_and_pods(emulator, backends, tmp_path,
                                                         monkeypatch, gw_model):
    emu, kubeconfig = emulator
    url = str(emu.url)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    short, long_ = backends["short-0"], backends["long-0"]
    await kube("POST", url, MD_PATH, mdep("tiny-short", engine={"maxModelLen": 256},
                                          gateway={"tokenizer": str(gw_model)}))
    await kube("POST", url, POD_PATH, pod("tiny-short-0", "tiny-short", short.port))
    gw = GatewayThread(tmp_path / "unused.yaml", discovery="kubernetes", namespace=NS)
    await asyncio.to_thread(gw.start)         # the emulator answers on this event loop

    def ready(pool: str) -> float:
        try:
            return gw_metric(gw.metrics(), "pagefleet_gateway_pool_ready_endpoints",
                             model_name="tiny", pool=pool)
        except KeyError:
            return 0

    def post(body: dict) -> httpx.Response:
        return httpx.post(gw.url + "/v1/completions", json={"model": "tiny", **body}, timeout=120)

    try:
        await until(lambda: ready("tiny-short") == 1, "the listed pod's endpoint")
        r = await asyncio.to_thread(post, {"prompt": "hello", "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-pagefleet-endpoint"] == "tiny-short-0"

        # A long pool appears (watched), with a pod that is not ready yet.
        await kube("POST", url, MD_PATH, mdep("tiny-long", engine={"maxModelLen": 1024},
                                              gateway={"tokenizer": str(gw_model)}))
        await kube("POST", url, POD_PATH, pod("tiny-long-0", "tiny-long", long_.port, ready=False))
        await until(lambda: "tiny-long" in gw.metrics(), "the new pool")
        assert ready("tiny-long") == 0
        await kube("PATCH", url, f"{POD_PATH}/tiny-long-0", {"status": {"conditions": [
            {"type": "Ready", "status": "True"}]}})
        await until(lambda: ready("tiny-long") == 1, "the pod turning ready")
        long_prompt = " ".join(["model token cache"] * 150)
        r = await asyncio.to_thread(post, {"prompt": long_prompt, "max_tokens": 4})
        assert r.status_code == 200 and r.headers["x-pagefleet-endpoint"] == "tiny-long-0"
        r = await asyncio.to_thread(post, {"prompt": "short one", "max_tokens": 4})
        assert r.headers["x-pagefleet-endpoint"] == "tiny-short-0"

        # The short pod goes away: short requests wait for it (scale-from-zero hold) ...
        await kube("DELETE", url, f"{POD_PATH}/tiny-short-0")
        await until(lambda: ready("tiny-short") == 0, "the deleted pod gone")
        held = asyncio.ensure_future(asyncio.to_thread(post, {"prompt": "hi", "max_tokens": 2}))
        await until(lambda: gw_metric(gw.metrics(), "pagefleet_gateway_pool_requests_waiting",
                                      model_name="tiny", pool="tiny-short") == 1, "a held request")
        # ... and are served when a new pod is ready.
        await kube("POST", url, POD_PATH, pod("tiny-short-1", "tiny-short", short.port))
        r = await held
        assert r.status_code == 200 and r.headers["x-pagefleet-endpoint"] == "tiny-short-1"
    finally:
        await asyncio.to_thread(gw.stop)


def test_fleet_reads_queue_timeout_and_pool_keys():
    objs = [mdep("a", gateway={"queueTimeoutSeconds": 90}, apiKeySecretRef={"name": "s"}),
            mdep("b", gateway={"queueTimeoutSeconds": 600}),
            mdep("c", served="free"),
            mdep("d", served="unreadable", apiKeySecretRef={"name": "gone", "key": "k"})]
    keys = {(NS, "s", "api-key"): "sk-a"}
    f = fleet_from_objects(objs, [], keys=keys)
    tiny = f.model("tiny")
    assert tiny.queue_timeout == 600.0, "the largest of the model's pools"
    assert {p.name: p.api_key for p in tiny.pools} == {"a": "sk-a", "b": None}
    assert tiny.require_pool_key
    assert f.model("free").queue_timeout is None and not f.model("free").require_pool_key
    # A Secret that could not be read: no key, so the client's header goes through.
    assert not f.model("unreadable").require_pool_key
    assert secret_ref(objs[3]) == (NS, "gone", "k") and secret_ref(objs[2]) is None
    assert secret_value({"data": {"api-key": base64.b64encode(b"sk-x\n").decode()}}, "api-key") == "sk-x"
    assert secret_value({"stringData": {"k": "v"}}, "k") == "v"
    assert secret_value({"data": {"k": "!!notbase64"}}, "k") is None
    assert secret_value({"data": {}}, "k") is None


@pytest.mark.asyncio(loop_scope="session")
async def test_gateway_uses_the_api_key_secrets(emulator, backends, tmp_path, monkeypatch, gw_model):
    """apiKeySecretRef in Kubernetes mode: the gateway reads the Secret, sends its key to
    the pool's servers, takes only clients that present it (401 before any queueing),
    follows a rotated key, and passes the client's header through when it cannot read
    the Secret."""
    emu, kubeconfig = emulator
    url = str(emu.url)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    proxy = RecordingProxy(backends["short-1"].port).start()
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "pool-key", "namespace": NS},
              "data": {"api-key": base64.b64encode(b"sk-pool").decode()}}
    await kube("POST", url, f"/api/v1/namespaces/{NS}/secrets", secret)
    await kube("POST", url, MD_PATH, mdep("keyed", served="keyed", apiKeySecretRef={"name": "pool-key"},
                                          gateway={"tokenizer": str(gw_model)}))
    await kube("POST", url, MD_PATH, mdep("nokey", served="nokey", apiKeySecretRef={"name": "missing"},
                                          gateway={"tokenizer": str(gw_model)}))
    await kube("POST", url, POD_PATH, pod("keyed-0", "keyed", proxy.port))
    await kube("POST", url, POD_PATH, pod("nokey-0", "nokey", proxy.port))
    gw = GatewayThread(tmp_path / "unused.yaml", discovery="kubernetes", namespace=NS)
    gw.gateway.discovery.secret_refresh = 0.2
    await asyncio.to_thread(gw.start)

    def post(model: str, key: str | None, marker: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(gw.url + "/v1/completions", headers=headers, timeout=120,
                          json={"model": model, "prompt": f"hello {marker}", "max_tokens": 2})

    def upstream_auth(marker: str) -> str | None:
        # A kept-alive connection carries several requests: find the one with the marker.
        for rec in list(proxy.connections):
            sent = bytes(rec["request"])
            at = sent.find(marker.encode())
            if at >= 0:
                start = sent.rfind(b"POST ", 0, at)
                head = sent[start:].split(b"\r\n\r\n")[0].decode().lower().splitlines()
                return next((h.split(":", 1)[1].strip() for h in head if h.startswith("authorization:")), None)
        raise KeyError(marker)

    try:
        gw.wait_ready_endpoints("keyed", 1)
        assert gw_metric(gw.metrics(), "pagefleet_gateway_discovery_info", discovery="kubernetes",
                         namespace=NS) == 1
        for key in (None, "sk-wrong"):
            r = await asyncio.to_thread(post, "keyed", key, "m-refused")
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
        with pytest.raises(KeyError):
            upstream_auth("m-refused")      # refused at the gateway, never sent on
        r = await asyncio.to_thread(post, "keyed", "sk-pool", "m-one")
        assert r.status_code == 200, r.text
        assert upstream_auth("m-one") == "bearer sk-pool"

        # The key is rotated in the Secret: the gateway follows without a restart.
        await kube("PATCH", url, f"/api/v1/namespaces/{NS}/secrets/pool-key",
                   {"data": {"api-key": base64.b64encode(b"sk-rotated").decode()}})

        def rotated() -> bool:
            return post("keyed", "sk-rotated", "m-probe").status_code == 200
        await until(rotated, "the rotated key to be accepted")
        r = await asyncio.to_thread(post, "keyed", "sk-rotated", "m-two")
        assert r.status_code == 200 and upstream_auth("m-two") == "bearer sk-rotated"
        assert (await asyncio.to_thread(post, "keyed", "sk-pool", "m-old")).status_code == 401

        # Its Secret does not exist: the client's header reaches the server unchanged.
        gw.wait_ready_endpoints("nokey", 1)
        r = await asyncio.to_thread(post, "nokey", "sk-client", "m-three")
        assert r.status_code == 200 and upstream_auth("m-three") == "bearer sk-client"
    finally:
        await asyncio.to_thread(gw.stop)
        proxy.stop()
