"""Sampling filters and penalties against direct computations on fixed logits."""

from __future__ import annotations

import math

import pytest
import torch

from pagefleet.server.engine.protocol import CoreSamplingParams
from pagefleet.server.engine.request import Request
from pagefleet.server.engine.sampler import (Sampler, apply_penalties, apply_top_k_top_p_min_p,
                                             top_k_candidates)
from pagefleet.server.engine.sampling_params import SamplingParams, SamplingParamsError
from pagefleet.server.engine.staging import Staging
from tests.server.helpers import watch_scalar_index_writes


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


class Harness:
    """Drives the sampler as the engine core does: slots, staging, sample, resolve."""

    def __init__(self, vocab: int, rows: int = 8) -> None:
        self.sampler = Sampler(vocab, torch.device("cpu"), rows, seed=0)
        self.last = torch.zeros(rows, dtype=torch.long)
        self.free = list(range(rows - 1, -1, -1))

    def req(self, rid: str, params: CoreSamplingParams, seed: int | None = None,
            prompt=(1, 2, 3), eos=()) -> Request:
        r = Request(rid, list(prompt), params, eos_token_ids=eos)
        if seed is not None:
            r.generator = torch.Generator().manual_seed(seed)
        return r

    def __call__(self, logits: torch.Tensor, reqs: list[Request]):
        new = [r for r in reqs if r.slot < 0]
        for r in new:
            r.slot = self.free.pop()
            self.sampler.slot_taken(r)
        st = Staging(torch.device("cpu"))
        st.begin()
        step = self.sampler.stage(st, reqs, new)
        st.commit()
        return self.sampler.sample(logits, step, st, self.last).resolve()

    def release(self, r: Request) -> None:
        self.sampler.slot_released(r)
        self.free.append(r.slot)
        r.slot = -1


def P(**kw) -> CoreSamplingParams:
    return CoreSamplingParams(max_tokens=16, **kw)


def test_seeded_sampling_is_independent_of_batch():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    p = P(temperature=0.9, top_p=0.95)
    h1 = Harness(50)
    x = h1.req("x", p, seed=42)
    seq_alone = [h1(logits[2:3], [x]).token_ids[0] for _ in range(20)]
    h2 = Harness(50)
    x2 = h2.req("x", p, seed=42)
    others = [h2.req(f"o{i}", P(temperature=1.3, top_k=5), seed=i) for i in range(3)] + \
        [h2.req(f"u{i}", P(temperature=0.7, top_k=20, repetition_penalty=1.1)) for i in range(2)]
    seq_batched = []
    for _ in range(20):
        batch = others[:2] + [x2] + others[2:]
        seq_batched.append(h2(logits, batch).token_ids[2])
    assert seq_alone == seq_batched
    assert len(set(seq_alone)) > 1   # it really samples


@pytest.mark.parametrize("params", [P(temperature=1.0), P(temperature=1.0, top_k=3),
                                    P(temperature=1.0, top_p=0.7)])
def test_sampling_follows_the_distribution(params):
    h = Harness(4)
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    if params.top_k > 0:                  # top-3: the 0.1 token is out
        probs = torch.tensor([0.0, 0.2, 0.3, 0.4]) / 0.9
    if params.top_p < 1:                  # 0.4 + 0.3 reaches 0.7
        probs = torch.tensor([0.0, 0.0, 0.3, 0.4]) / 0.7
    r = h.req("x", params, seed=3)
    counts = [0] * 4
    for _ in range(3000):
        counts[h(logits, [r]).token_ids[0]] += 1
    for c, p in zip(counts, probs.tolist()):
        assert abs(c / 3000 - p) < 0.03


def test_greedy_and_logprobs():
    h = Harness(10)
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(1))
    reqs = [h.req("a", P(temperature=0, logprobs=3)), h.req("b", P(temperature=0))]
    res = h(logits, reqs)
    assert res.token_ids == logits.argmax(-1).tolist()
    lp = torch.log_softmax(logits[0], -1)
    top = lp.topk(3)
    got = res.logprobs[0]
    assert got.token_ids[0][0] == res.token_ids[0] and got.ranks == [1]
    assert set(got.token_ids[0][1:]) == set(top.indices.tolist())
    for t, v in zip(got.token_ids[0], got.logprobs[0]):
        assert v == pytest.approx(lp[t].item(), abs=1e-6)
    assert res.logprobs[1] is None


def test_penalties_follow_the_outputs_on_the_device():
    """Output-token counts live on the device and grow with each sampled token; a
    slot taken over by another request starts clean."""
    h = Harness(6)
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0, 0.0, 0.0]])
    r = h.req("a", P(temperature=0, frequency_penalty=2.0), prompt=(3,))
    assert h(logits, [r]).token_ids == [0]
    r.all_token_ids.append(0)
    assert h(logits, [r]).token_ids == [1]       # token 0 now penalised by 2.0
    h.release(r)
    r2 = h.req("b", P(temperature=0, frequency_penalty=2.0), prompt=(3,))
    assert h(logits, [r2]).token_ids == [0]      # the slot's counts were reset
    rep = h.req("c", P(temperature=0, repetition_penalty=2.0), prompt=(0,))
    assert h(logits, [rep]).token_ids == [1]     # 5.0 / 2 < 4.9: the prompt token loses


def test_min_tokens_masks_eos_and_stop_tokens():
    h = Harness(5)
    logits = torch.tensor([[0.0, 0.0, 10.0, 9.0, 0.0]])
    r = h.req("a", P(temperature=0, min_tokens=2, stop_token_ids=(3,)), prompt=(1,), eos=(2,))
    assert h(logits, [r]).token_ids[0] not in (2, 3)
    assert logits[0, 2] == 10.0   # the caller's logits are not modified
    r.all_token_ids += [4, 4]
    assert h(logits, [r]).token_ids == [2]


def test_logit_bias_forces_bans_and_comes_before_penalties():
    """OpenAI's logit_bias, applied where vLLM applies it: added to the raw logits,
    before penalties and temperature; rows without it are untouched."""
    h = Harness(6)
    logits = torch.tensor([[0.5, -0.9, -2.0, -3.0, -3.0, -3.0]] * 4)
    plain = h.req("plain", P(temperature=0), prompt=(0,))
    forced = h.req("forced", P(temperature=0, logit_bias_ids=(4,), logit_bias_values=(100.0,)))
    banned = h.req("banned", P(temperature=0, logit_bias_ids=(0, 2), logit_bias_values=(-100.0, -100.0)))
    # (0.5 - 1.0) * 2 = -1.0 < -0.9 picks token 1; the bias after the penalty
    # (0.5 / 2 - 1.0 = -0.75) would pick token 0.
    ordered = h.req("ordered", P(temperature=0, repetition_penalty=2.0, logit_bias_ids=(0,),
                                 logit_bias_values=(-1.0,)), prompt=(0,))
    res = h(logits, [plain, forced, banned, ordered])
    assert res.token_ids == [0, 4, 1, 1]
    assert logits[0, 4] == -3.0   # the caller's logits are not modified
    sampled = h.req("sampled", P(temperature=1.0, top_p=0.9, logit_bias_ids=(3,),
                                 logit_bias_values=(100.0,)), seed=7)
    assert {h(logits[:1], [sampled]).token_ids[0] for _ in range(20)} == {3}


def test_allowed_token_ids_keep_only_those_tokens():
    """vLLM's allowed_token_ids: every other token is out, greedy and sampled, with the
    bias and penalties applied among those left; rows without it are untouched."""
    h = Harness(6)
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]] * 3)
    plain = h.req("plain", P(temperature=0))
    narrow = h.req("narrow", P(temperature=0, allowed_token_ids=(3, 5)))
    biased = h.req("biased", P(temperature=0, allowed_token_ids=(3, 5), logit_bias_ids=(5,),
                               logit_bias_values=(10.0,)))
    assert h(logits, [plain, narrow, biased]).token_ids == [0, 3, 5]
    assert logits[0, 0] == 5.0    # the caller's logits are not modified
    sampled = h.req("sampled", P(temperature=1.0, allowed_token_ids=(1, 4)), seed=3)
    assert {h(logits[:1], [sampled]).token_ids[0] for _ in range(30)} == {1, 4}


def test_allowed_token_ids_bounds():
    for value in ([], [-1], list(range(1025))):
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(allowed_token_ids=value)
        assert e.value.param == "allowed_token_ids"
    assert SamplingParams(allowed_token_ids=[9, 2, 9]).core_params(4).allowed_token_ids == (2, 9)


def test_logit_bias_bounds():
    for bias in ({1: 101.0}, {-1: 1.0}, {1: float("nan")}):
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(logit_bias=bias)
        assert e.value.param == "logit_bias"
    core = SamplingParams(logit_bias={5: 2.5, 9: -100}).core_params(4)
    assert core.logit_bias_ids == (5, 9) and core.logit_bias_values == (2.5, -100.0)


@pytest.mark.parametrize("field,value", [("temperature", -1), ("top_p", 0), ("top_p", 1.5),
                                         ("top_k", -3), ("min_p", 2), ("max_tokens", 0),
                                         ("presence_penalty", 3), ("repetition_penalty", 0),
                                         ("logprobs", -1), ("n", 0), ("n", 129)])
def test_bad_params_name_the_field(field, value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


@pytest.mark.parametrize("k,p,min_p", [(5, 1.0, 0.0), (10, 0.8, 0.0), (8, 0.9, 0.1), (1, 1.0, 0.0)])
def test_top_k_path_keeps_the_same_tokens_as_the_sort_path(k, p, min_p):
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(4, 40, generator=g) * 3
    ks = torch.tensor([k, k, max(k // 2, 1), k])
    ps, ms = torch.tensor([p] * 4), torch.tensor([min_p] * 4)
    full = apply_top_k_top_p_min_p(logits, ks, ps, ms)
    cand, idx = top_k_candidates(logits, ks, ps, ms, k_max=k)
    for b in range(4):
        kept = {int(t) for t, v in zip(idx[b], cand[b]) if v != float("-inf")}
        assert kept == {i for i in range(40) if full[b, i] != float("-inf")}


def test_step_path_writes_no_python_scalar_through_an_index_tensor(monkeypatch):
    """`t[index_tensors] = python_value` on a CUDA tensor copies a CPU value tensor from
    pageable memory: a stream sync in the step (it made every step that admitted a
    penalised request synchronous on the H200, BENCHMARKS.md 2026-12-02). The CPU cannot
    see a sync, so this checks the pattern itself over a step that uses penalties,
    min_tokens bans, logit_bias, top-k/top-p and the sort path."""
    seen = watch_scalar_index_writes(monkeypatch)
    h = Harness(40)
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(5))
    reqs = [h.req("pen", P(temperature=0.7, top_k=5, top_p=0.8, repetition_penalty=1.1),
                  prompt=(1, 2, 3)),
            h.req("ban", P(temperature=0.8, min_tokens=3, stop_token_ids=(4,)), eos=(2,)),
            h.req("bias", P(temperature=0, logit_bias_ids=(7,), logit_bias_values=(5.0,))),
            h.req("sort", P(temperature=0.9, min_p=0.1, frequency_penalty=0.5), seed=1)]
    for _ in range(3):
        h(logits, reqs)
        for r in reqs:
            r.all_token_ids.append(9)
    assert seen == []
