"""While one client sends a 10 MB prompt, how long do others wait? (issue 10)

Starts `pagefleet serve` on a tiny model (CPU is enough: the point is the event loop,
not the model), opens a long stream, then posts a ~10 MB completion prompt and, while
it is being processed, polls /health; reports the stream's largest inter-chunk gap and
/health's slowest answer during the big request, and the big request's own time.

    python benchmarks/hostile_bench.py [--mb 10] [--out result.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx


async def scenario(url: str, mb: float) -> dict:
    big = {"prompt": "hello world the model " * int(mb * 1e6 / 22), "max_tokens": 4}
    gaps, health = [], []
    async with httpx.AsyncClient(timeout=600) as c:
        async with c.stream("POST", url + "/v1/completions", json={
                "prompt": "hello", "max_tokens": 2000, "ignore_eos": True,
                "stream": True}) as r:
            lines = r.aiter_lines()
            while not (await lines.__anext__()).startswith("data: "):
                pass
            t0 = time.perf_counter()
            heavy = asyncio.create_task(c.post(url + "/v1/completions", json=big))

            async def poll_health():
                while not heavy.done():
                    t = time.perf_counter()
                    await c.get(url + "/health")
                    health.append(time.perf_counter() - t)
                    await asyncio.sleep(0.05)

            async def watch_stream():
                last = time.perf_counter()
                while not heavy.done():
                    line = await lines.__anext__()
                    if line.startswith("data: "):
                        now = time.perf_counter()
                        gaps.append(now - last)
                        last = now
            await asyncio.gather(poll_health(), watch_stream(), heavy)
            took = time.perf_counter() - t0
    resp = heavy.result()
    return {"body_mb": len(json.dumps(big)) / 1e6, "big_request_s": took,
            "big_status": resp.status_code, "stream_max_gap_s": max(gaps or [0]),
            "stream_chunks_during": len(gaps), "health_max_s": max(health or [0]),
            "health_polls": len(health)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=10)
    ap.add_argument("--out")
    args = ap.parse_args()
    from pagefleet.server.testing import build_tiny_model
    model = build_tiny_model(tempfile.mkdtemp(), "qwen3")
    port = 8765
    exe = os.path.join(os.path.dirname(sys.executable), "pagefleet")
    proc = subprocess.Popen([exe, "serve", str(model), "--port", str(port), "--host",
                             "127.0.0.1", "--max-model-len", "2048"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        res = asyncio.run(scenario(url, args.mb))
    finally:
        proc.terminate()
        proc.wait(30)
    res["cpus"] = os.cpu_count()
    res["loadavg_1m"] = os.getloadavg()[0]
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
