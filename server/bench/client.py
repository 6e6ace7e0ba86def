"""One streamed request against an OpenAI-compatible endpoint, timed like vLLM's bench.

TTFT is the time to the first chunk that carries generated text, ITL the gaps between
later text chunks, E2EL the time to `[DONE]`. Token counts come from the server's
`usage` (the request asks for `stream_options.include_usage`).
"""

from __future__ import annotations

import json
import time

import httpx

from pagefleet.server.bench.report import RequestResult


def request_body(endpoint: str, model: str, prompt: str, output_len: int,
                 ignore_eos: bool) -> dict:
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "temperature": 0.0, "ignore_eos": ignore_eos}
    if endpoint.endswith("/chat/completions"):
        body.update(messages=[{"role": "user", "content": prompt}],
                    max_completion_tokens=output_len)
    else:
        body.update(prompt=prompt, max_tokens=output_len)
    return body


def _chunk_text(chunk: dict) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        if "text" in choice:
            text += choice.get("text") or ""
        else:
            text += (choice.get("delta") or {}).get("content") or ""
    return text


async def send(client: httpx.AsyncClient, url: str, body: dict,
               headers: dict[str, str]) -> RequestResult:
    res = RequestResult(start=time.perf_counter())
    start = res.start
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                raw = await resp.aread()
                res.error = f"HTTP {resp.status_code}: {raw[:200].decode(errors='replace')}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    res.latency = time.perf_counter() - start
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream error: {chunk['error'].get('message', '')}"
                    return res
                now = time.perf_counter()
                if _chunk_text(chunk):
                    chunks += 1
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.prompt_len = chunk["usage"].get("prompt_tokens", 0)
                    res.output_tokens = chunk["usage"].get("completion_tokens", 0)
        if not res.latency:
            res.error = "stream ended without [DONE]"
            return res
        if not res.output_tokens:
            res.output_tokens = chunks
        if last is None:          # no text at all (e.g. only special tokens)
            res.ttft = res.latency
        res.success = True
    except (httpx.HTTPError, OSError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res
