"""Sampling filters and penalties against direct computations on fixed logits."""

from __future__ import annotations

import math

import pytest
import torch

from pagefleet.server.engine.request import Request
from pagefleet.server.engine.sampler import Sampler, apply_penalties, apply_top_k_top_p_min_p
from pagefleet.server.engine.sampling_params import SamplingParams, SamplingParamsError


def direct_filter(row: list[float], k: int, p: float, min_p: float) -> set[int]:
    """Tokens that survive, computed the slow obvious way."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    keep = order[:k] if k > 0 else order
    z = sum(math.exp(row[i]) for i in keep)
    probs = {i: math.exp(row[i]) / z for i in keep}
    kept, mass = [], 0.0
    for i in keep:
        if mass >= p and kept:
            break
        kept.append(i)
        mass += probs[i]
    z2 = sum(math.exp(row[i]) for i in kept)
    top = max(math.exp(row[i]) / z2 for i in kept)
    return {i for i in kept if math.exp(row[i]) / z2 >= min_p * top}


@pytest.mark.parametrize("k,p,min_p", [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.5, 0.0),
                                       (10, 0.8, 0.0), (0, 1.0, 0.3), (8, 0.9, 0.1),
                                       (1, 1.0, 0.0), (0, 0.01, 0.0)])
def test_top_k_top_p_min_p_match_direct_computation(k, p, min_p):
    g = torch.Generator().manual_seed(k * 100 + int(p * 10) + int(min_p * 10))
    logits = torch.randn(4, 40, generator=g) * 3
    out = apply_top_k_top_p_min_p(logits, torch.tensor([k] * 4), torch.tensor([p] * 4),
                                  torch.tensor([min_p] * 4))
    for b in range(4):
        survivors = {i for i in range(40) if out[b, i] != float("-inf")}
        assert survivors == direct_filter(logits[b].tolist(), k, p, min_p)
        kept = torch.tensor(sorted(survivors))
        assert torch.equal(out[b, kept], logits[b, kept])


def test_penalties_match_direct_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    prompt = [0, 1]
    output = [3, 3, 4]
    rep, freq, pres = 1.5, 0.3, 0.7
    expected = logits.clone()
    for t in set(prompt + output):
        v = expected[0, t]
        expected[0, t] = v / rep if v > 0 else v * rep
    for t in set(output):
        expected[0, t] -= freq * output.count(t) + pres
    mask = torch.zeros(1, 6, dtype=torch.bool)
    mask[0, prompt] = True
    counts = torch.zeros(1, 6)
    for t in output:
        counts[0, t] += 1
    got = apply_penalties(logits, mask, counts, torch.tensor([rep]), torch.tensor([freq]),
                          torch.tensor([pres]))
    assert torch.allclose(got, expected)


def _req(rid: str, params: SamplingParams, seed: int, prompt=(1, 2, 3)) -> Request:
    return Request(rid, list(prompt), params, generator=torch.Generator().manual_seed(seed))


def test_seeded_sampling_is_independent_of_batch():
    sampler = Sampler(50, torch.device("cpu"))
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=0.9, top_p=0.95)
    alone = [sampler(logits[2:3], [_req("x", p, seed=42)]).token_ids[0] for _ in range(1)]
    x = _req("x", p, seed=42)
    seq_alone = [sampler(logits[2:3], [x]).token_ids[0] for _ in range(20)]
    x2 = _req("x", p, seed=42)
    others = [_req(f"o{i}", SamplingParams(temperature=1.3, top_k=5), seed=i) for i in range(5)]
    seq_batched = []
    for _ in range(20):
        batch = others[:2] + [x2] + others[2:]
        seq_batched.append(sampler(logits, batch).token_ids[2])
    assert seq_alone == seq_batched and seq_alone[0] == alone[0]
    assert len(set(seq_alone)) > 1   # it really samples


def test_sampling_follows_the_distribution():
    sampler = Sampler(4, torch.device("cpu"))
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    r = _req("x", SamplingParams(temperature=1.0), seed=3)
    counts = [0] * 4
    for _ in range(4000):
        counts[sampler(logits, [r]).token_ids[0]] += 1
    for c, p in zip(counts, [0.1, 0.2, 0.3, 0.4]):
        assert abs(c / 4000 - p) < 0.03


def test_greedy_and_logprobs():
    sampler = Sampler(10, torch.device("cpu"))
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(1))
    reqs = [_req("a", SamplingParams(temperature=0, logprobs=3), 0),
            _req("b", SamplingParams(temperature=0), 0)]
    res = sampler(logits, reqs)
    assert res.token_ids == logits.argmax(-1).tolist()
    lp = torch.log_softmax(logits[0], -1)
    top = lp.topk(3)
    assert set(res.logprobs[0]) == set(top.indices.tolist())
    for t, v in res.logprobs[0].items():
        assert v == pytest.approx(lp[t].item(), abs=1e-6)
    assert res.logprobs[1] is None


def test_min_tokens_masks_eos_and_stop_tokens():
    sampler = Sampler(5, torch.device("cpu"))
    logits = torch.tensor([[0.0, 0.0, 10.0, 9.0, 0.0]])
    r = Request("a", [1], SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3]),
                eos_token_ids=(2,))
    assert sampler(logits, [r]).token_ids[0] not in (2, 3)
    assert logits[0, 2] == 10.0   # the caller's logits are not modified
    r.output_token_ids = [4, 4]
    assert sampler(logits, [r]).token_ids == [2]


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 0), ("top_p", 1.5),
                                         ("top_k", -3), ("min_p", 2), ("max_tokens", 0),
                                         ("presence_penalty", 3), ("repetition_penalty", 0),
                                         ("logprobs", 50), ("n", 2)])
def test_bad_params_name_the_field(field, value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field
