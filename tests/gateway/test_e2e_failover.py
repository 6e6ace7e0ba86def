"""A backend killed mid-run (issue 13, must-hold 3): requests that had not started
streaming are retried on another replica and succeed; the dead one leaves the pool
after 3 failed checks, and rejoins once restarted."""

from __future__ import annotations

import asyncio
import random

import httpx

from tests.gateway.helpers import GatewayThread, gw_metric, models_yaml, wait_for

WORDS = "model token cache block batch queue request server memory prefix chunk".split()


def test_killed_backend_leaves_the_pool_without_failing_requests_and_rejoins(
        backends, tmp_path, gw_model):
    pool = [backends["short-0"], backends["short-1"], backends["short-2"]]
    spare = backends["short-2"]
    f = models_yaml(tmp_path / "m.yaml", [{
        "name": "tiny", "tokenizer": str(gw_model),
        "pools": [{"name": "p", "endpoints": [{"name": b.name, "url": b.url} for b in pool]}]}])
    gw = GatewayThread(f, health_interval=0.2, unhealthy_threshold=3).start()
    gw.wait_ready_endpoints("tiny", 3)

    def gm(name: str, **labels) -> float:
        return gw_metric(gw.metrics(), name, model_name="tiny", **labels)

    async def scenario():
        results: list[httpx.Response] = []
        stop = asyncio.Event()
        rng = random.Random(3)
        async with httpx.AsyncClient(base_url=gw.url, timeout=300) as c:
            async def worker():
                while not stop.is_set():
                    prompt = " ".join(rng.choice(WORDS) for _ in range(40))
                    results.append(await c.post("/v1/completions", json={
                        "model": "tiny", "prompt": prompt, "max_tokens": 24,
                        "ignore_eos": True, "temperature": 0}))

            async def until(cond, what):
                for _ in range(3000):
                    if await asyncio.to_thread(cond):
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError(f"timed out waiting for {what}")

            workers = [asyncio.ensure_future(worker()) for _ in range(4)]
            await until(lambda: gm("pagefleet_gateway_requests_in_flight",
                                   endpoint="short-2") >= 1, "a request in flight on short-2")
            spare.kill()
            await until(lambda: gm("pagefleet_gateway_endpoint_ready", endpoint="short-2") == 0,
                        "short-2 out of the pool")
            n_after_kill = len(results)
            await until(lambda: len(results) >= n_after_kill + 8, "traffic on the others")
            spare.start()
            await asyncio.to_thread(spare.wait_ready)
            await until(lambda: gm("pagefleet_gateway_endpoint_ready", endpoint="short-2") == 1,
                        "short-2 back in the pool")
            mark = len(results)
            await until(lambda: any(r.headers.get("x-pagefleet-endpoint") == "short-2"
                                    for r in results[mark:]), "traffic on short-2 again")
            stop.set()
            await asyncio.gather(*workers)
            # A stream started after the failure goes through as well.
            async with c.stream("POST", "/v1/completions", json={
                    "model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}) as r:
                streamed = (r.status_code, await r.aread())
        return results, streamed

    try:
        results, (code, raw) = asyncio.run(asyncio.wait_for(scenario(), 600))
        assert [r.status_code for r in results if r.status_code != 200] == [], \
            [r.text for r in results if r.status_code != 200][:3]
        assert all(r.json()["usage"]["completion_tokens"] == 24 for r in results)
        assert code == 200 and raw.rstrip().endswith(b"data: [DONE]") and b'"error"' not in raw
        # The request in flight on the killed backend was retried elsewhere.
        assert gm("pagefleet_gateway_upstream_retries_total", pool="p") >= 1
    finally:
        gw.stop()
        if spare.proc is None or spare.proc.poll() is not None:
            spare.start().wait_ready()
        wait_for(lambda: httpx.get(spare.url + "/health", timeout=5).status_code == 200, 120,
                 what="short-2 up")
