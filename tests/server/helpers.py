"""Reference computations for engine tests (HF transformers, plain loops)."""

from __future__ import annotations

import random

import torch


def hf_greedy(model_dir, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    """Plain greedy loop over the HF model's own forward (KV cache on, EOS ignored)."""
    from transformers import AutoModelForCausalLM

    import inspect

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    # transformers renamed past_key_values to cache (5.x); use whichever this one takes.
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    outs = []
    with torch.inference_mode():
        for ids, n in zip(prompts, max_new):
            out = model(input_ids=torch.tensor([ids]), use_cache=True)
            past, gen = getattr(out, "cache", None) or out.past_key_values, []
            tok = int(out.logits[0, -1].argmax())
            gen.append(tok)
            while len(gen) < n:
                out = model(input_ids=torch.tensor([[tok]]), use_cache=True, **{cache_kw: past})
                past = getattr(out, "cache", None) or out.past_key_values
                tok = int(out.logits[0, -1].argmax())
                gen.append(tok)
            outs.append(gen)
    return outs


def random_prompts(seed: int, lengths: list[int], vocab: int, reserved: int = 3) -> list[list[int]]:
    """Random token-id prompts (special ids below `reserved` left out)."""
    rng = random.Random(seed)
    return [[rng.randrange(reserved, vocab) for _ in range(n)] for n in lengths]


def assert_diverse(ref: list[list[int]]) -> None:
    """The reference must be able to catch attention bugs: outputs vary within a
    sequence and differ between prompts."""
    for seq in ref:
        if len(seq) >= 16:
            assert len(set(seq)) >= 4, f"degenerate reference output {seq[:20]}"
    distinct = {tuple(s[:8]) for s in ref}
    assert len(distinct) >= len(ref) - 1, "reference outputs do not depend on the prompt"
    assert sum(len(set(s)) for s in ref) >= 3 * len(ref)


def watch_scalar_index_writes(monkeypatch) -> list[str]:
    """Record every `t[index_tensors] = python_value` from now on (the list fills in).

    On a CUDA tensor that write builds a CPU value tensor that index_put_ copies from
    pageable memory: a stream sync inside the step (BENCHMARKS.md, 2026-12-02). A CPU run
    cannot see the sync, so step-path tests check for the pattern itself."""
    seen: list[str] = []
    real = torch.Tensor.__setitem__

    def setitem(self, index, value):
        parts = index if isinstance(index, tuple) else (index,)
        if isinstance(value, (bool, int, float)) and any(isinstance(p, torch.Tensor) for p in parts):
            seen.append(f"{tuple(self.shape)}[...] = {value!r}")
        return real(self, index, value)

    monkeypatch.setattr(torch.Tensor, "__setitem__", setitem)
    return seen
