"""Prefix affinity and bounded load through the real gateway in front of three real
`pagefleet serve` backends (issue 13, must-hold 1 and 2)."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import re

import httpx
import pytest

from tests.gateway.helpers import GatewayThread, models_yaml

WORDS = ("model token cache block batch queue request server memory prefix chunk decode "
         "prefill latency throughput kernel attention layer head vector matrix sample "
         "greedy paged pool hash scheduler runner engine stream reply client user system "
         "assistant hello world question answer long short fast slow first last next red "
         "green blue one two three four five six seven eight nine ten data time deploy "
         "scale replica pod node cluster service metric alert limit budget policy").split()


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def conversation_workload(seed: int, n_systems: int = 6, per_system: int = 4):
    """Six long system prompts, four user questions each, in a shuffled order."""
    rng = random.Random(seed)
    systems = [f"You are assistant {seed}-{i}. " + text(rng, 140) for i in range(n_systems)]
    reqs = [(s, text(rng, 8)) for s in range(n_systems) for _ in range(per_system)]
    rng.shuffle(reqs)
    return systems, reqs


def chat(system: str, question: str, **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "system", "content": system},
                                          {"role": "user", "content": question}],
            "max_tokens": 4, "temperature": 0, **kw}


@pytest.fixture(scope="module")
def short3(backends, tmp_path_factory):
    return [backends[f"short-{i}"] for i in range(3)]


def gateway_for(short3, tmp_path, gw_model, **settings) -> GatewayThread:
    f = models_yaml(tmp_path / "models.yaml", [{
        "name": "tiny", "tokenizer": str(gw_model),
        "pools": [{"name": "short", "max_model_len": 256,
                   "endpoints": [{"name": b.name, "url": b.url} for b in short3]}]}])
    gw = GatewayThread(f, **settings).start()
    gw.wait_ready_endpoints("tiny", 3)
    return gw


def run_workload(gw: GatewayThread, short3, systems, reqs) -> tuple[float, dict[int, set[str]]]:
    """Send the requests one by one; (prompt tokens the fleet computed, system -> backends)."""
    before = sum(b.computed_tokens() for b in short3)
    where: dict[int, set[str]] = {}
    with httpx.Client(base_url=gw.url, timeout=120) as c:
        for s, q in reqs:
            r = c.post("/v1/chat/completions", json=chat(systems[s], q))
            assert r.status_code == 200, r.text
            where.setdefault(s, set()).add(r.headers["x-pagefleet-endpoint"])
    return sum(b.computed_tokens() for b in short3) - before, where


def test_prefix_affinity_computes_at_most_half_of_round_robin(short3, tmp_path, gw_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gw_model))
    rr_systems, rr_reqs = conversation_workload(seed=1)
    px_systems, px_reqs = conversation_workload(seed=2)
    for systems in (rr_systems, px_systems):
        for s in systems:            # long, yet every request fits the 256-token pool
            prompt = tok.apply_chat_template([{"role": "system", "content": s},
                                              {"role": "user", "content": text(random.Random(0), 8)}],
                                             tokenize=False, add_generation_prompt=True)
            n = len(tok.encode(prompt, add_special_tokens=False))
            assert 120 <= n <= 250, n

    rr = gateway_for(short3, tmp_path, gw_model, routing="round-robin")
    try:
        rr_computed, rr_where = run_workload(rr, short3, rr_systems, rr_reqs)
    finally:
        rr.stop()
    px = gateway_for(short3, tmp_path, gw_model, routing="prefix")
    try:
        px_computed, px_where = run_workload(px, short3, px_systems, px_reqs)
    finally:
        px.stop()

    # The baseline really scatters conversations; the gateway keeps each on one backend,
    # two system prompts per backend (what each KV pool holds).
    assert sum(len(v) for v in rr_where.values()) > len(rr_where) + 3
    assert all(len(v) == 1 for v in px_where.values()), px_where
    per_backend = {}
    for s, v in px_where.items():
        per_backend.setdefault(next(iter(v)), []).append(s)
    assert sorted(len(v) for v in per_backend.values()) == [2, 2, 2], per_backend
    print(f"computed prompt tokens: gateway {px_computed:.0f}, round-robin {rr_computed:.0f}")
    assert px_computed <= 0.5 * rr_computed, (px_computed, rr_computed)


DECISION = re.compile(r"request (\S+): chat model='tiny' .* -> short/(\S+) \((\w+), (\d+) "
                      r"blocks cached, load ([\d.]+) of ([\d.]+) over (\d+)\)")


def test_hot_prefix_spreads_once_its_backend_passes_the_bound(short3, tmp_path, gw_model,
                                                              caplog):
    eps = 0.25
    gw = gateway_for(short3, tmp_path, gw_model, routing="prefix", load_epsilon=eps)
    rng = random.Random(5)
    hot = "You are the hot assistant. " + text(rng, 100)
    try:
        with httpx.Client(base_url=gw.url, timeout=120) as c:
            home = c.post("/v1/chat/completions", json=chat(hot, "warm up")).headers[
                "x-pagefleet-endpoint"]
        caplog.set_level(logging.INFO, logger="pagefleet.gateway")
        caplog.clear()

        async def burst():
            async with httpx.AsyncClient(base_url=gw.url, timeout=300,
                                         limits=httpx.Limits(max_connections=64)) as c:
                async def one(i):
                    body = chat(hot, f"question {i} " + text(rng, 4), max_tokens=48,
                                ignore_eos=True)
                    r = await c.post("/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    return r.headers["x-pagefleet-endpoint"]
                return await asyncio.gather(*[one(i) for i in range(15)])

        got = asyncio.run(asyncio.wait_for(burst(), 300))
    finally:
        gw.stop()
    decisions = [DECISION.search(r.getMessage()) for r in caplog.records]
    decisions = [d for d in decisions if d]
    assert len(decisions) == 15
    for d in decisions:
        load, total, n = float(d.group(5)), float(d.group(6)), int(d.group(7))
        assert n == 3
        avg_after = (total + 1) / n
        # Bounded load: the pick leaves its backend within ceil((1 + eps) * average).
        assert load + 1 <= math.ceil((1 + eps) * avg_after - 1e-9) <= (1 + eps) * avg_after + 1
        if d.group(3) == "prefix":
            assert int(d.group(4)) >= 4
    # The hot prefix stayed on its home while that was within the bound, then spread.
    assert decisions[0].group(2) == home and decisions[0].group(3) == "prefix"
    assert len(set(got)) == 3
    assert got.count(home) >= max(got.count(b) for b in set(got) - {home}) - 1
