"""Batched sampling: penalties, temperature, top-k / top-p / min-p, seeds, logprobs.

Each step turns the logits of the requests that produce a token into token ids.
Greedy rows take the argmax of the penalised logits. Random rows draw with the
exponential-race trick (argmax of p / E, E ~ Exp(1)), with E drawn from the request's
own generator: a seeded request gets the same tokens whatever else is in the batch.

The filter functions are public and pure so tests can check them against a direct
computation on fixed logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagefleet.server.engine.request import Request


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties. logits `[B, V]`; prompt_mask `[B, V]` bool; output_counts `[B, V]`.

    Repetition (HF/CTRL style) applies to tokens seen in prompt or output: positive
    logits are divided by it, negative ones multiplied. Frequency and presence (OpenAI
    style) apply to output tokens only.
    """
    seen = prompt_mask | (output_counts > 0)
    rep = repetition.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency.unsqueeze(1) * output_counts
    logits = logits - presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask filtered tokens to -inf. top_k `[B]` (<= 0: off), top_p, min_p `[B]`.

    Order as vLLM: top-k, then top-p on what is left (the smallest set whose mass
    reaches p, always keeping the most likely token), then min-p relative to the
    most likely token's probability.
    """
    vocab = logits.shape[1]
    k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    remove = ranks >= k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    remove = remove | (mass_before >= top_p.unsqueeze(1))
    remove[:, 0] = False
    filtered = sorted_logits.masked_fill(remove, float("-inf"))
    out = torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, filtered)
    if bool((min_p > 0).any()):
        p = out.softmax(dim=-1)
        threshold = min_p.unsqueeze(1) * p.max(dim=-1, keepdim=True).values
        out = out.masked_fill(p < threshold, float("-inf"))
    return out


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Start a device->host copy without waiting for it (pinned memory on CUDA)."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class PendingSample:
    """Sampled tokens still on the device, with their copy to the host under way.

    `tokens` stays on the device so that the next step's forward can read its input
    ids from it before the host has seen them (async scheduling); `resolve()` waits for
    the copy alone, not for whatever was queued on the device after it.
    """

    def __init__(self, tokens: torch.Tensor, logprob_parts: tuple | None,
                 want: list[int], n_top: list[int]) -> None:
        self.tokens = tokens
        self._host = [_to_host(tokens)] + [_to_host(t) for t in (logprob_parts or ())]
        self._want, self._n_top = want, n_top
        self._event = None
        if tokens.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    def resolve(self) -> SampleResult:
        if self._event is not None:
            self._event.synchronize()
        token_list = self._host[0].tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(token_list)
        if self._want:
            top_vals, top_ids, chosen = (t.tolist() for t in self._host[1:])
            for j, i in enumerate(self._want):
                n = self._n_top[j]
                entry = dict(zip(top_ids[j][:n], top_vals[j][:n]))
                entry[token_list[i]] = chosen[j]
                logprobs[i] = entry
        return SampleResult(token_list, logprobs)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device

    def _penalty_inputs(self, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        b, v = len(reqs), self.vocab_size
        prompt_mask = torch.zeros(b, v, dtype=torch.bool, device=self.device)
        counts = torch.zeros(b, v, dtype=torch.float32, device=self.device)
        for i, r in enumerate(reqs):
            if r.prompt_token_ids:
                ids = torch.tensor(r.prompt_token_ids, device=self.device).clamp(max=v - 1)
                prompt_mask[i, ids] = True
            if r.output_token_ids:
                ids = torch.tensor(r.output_token_ids, device=self.device).clamp(max=v - 1)
                counts[i].index_add_(0, ids, torch.ones(len(ids), device=self.device))
        return prompt_mask, counts

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SampleResult:
        return self.sample(logits, reqs).resolve()

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> PendingSample:
        """Queue the sampling of one token per row; reads each request's state now."""
        raw = logits = logits.float()   # raw stays untouched, for logprobs
        dev = self.device
        greedy_rows, random_rows, want, min_rows = [], [], [], []
        penalties = False
        for i, r in enumerate(reqs):       # one pass over the batch: it is on the hot path
            p = r.params
            (greedy_rows if p.greedy else random_rows).append(i)
            penalties = penalties or p.has_penalties
            if p.logprobs is not None:
                want.append(i)
            if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
                min_rows.append(i)
        if not (random_rows or penalties or min_rows or want):
            return PendingSample(logits.argmax(dim=-1), None, [], [])
        params = [r.params for r in reqs]

        def col(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        if penalties:
            prompt_mask, counts = self._penalty_inputs(reqs)
            logits = apply_penalties(logits, prompt_mask, counts,
                                     col([p.repetition_penalty for p in params]),
                                     col([p.frequency_penalty for p in params]),
                                     col([p.presence_penalty for p in params]))
        if min_rows:
            # min_tokens: EOS and stop tokens are not allowed yet.
            if logits is raw:
                logits = raw.clone()
            for i in min_rows:
                r = reqs[i]
                banned = list(r.params.stop_token_ids or [])
                if not r.params.ignore_eos:
                    banned += list(r.eos_token_ids)
                banned = [t for t in banned if t < self.vocab_size]
                if banned:
                    logits[i, banned] = float("-inf")

        if not random_rows:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = torch.empty(len(reqs), dtype=torch.long, device=dev)
            if greedy_rows:
                g = torch.tensor(greedy_rows, device=dev)
                tokens[g] = logits[g].argmax(dim=-1)
            r_idx = torch.tensor(random_rows, device=dev)
            rp = [params[i] for i in random_rows]
            scaled = logits[r_idx] / col([p.temperature for p in rp]).unsqueeze(1)
            if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in rp):
                scaled = apply_top_k_top_p_min_p(
                    scaled, col([p.top_k for p in rp], torch.long),
                    col([p.top_p for p in rp]), col([p.min_p for p in rp]))
            probs = scaled.softmax(dim=-1)
            noise = torch.stack([
                torch.empty(self.vocab_size, device=dev).exponential_(generator=reqs[i].generator)
                for i in random_rows])
            tokens[r_idx] = (probs / noise).argmax(dim=-1)

        if not want:
            return PendingSample(tokens, None, [], [])
        w = torch.tensor(want, device=dev)
        lp = torch.log_softmax(raw[w], dim=-1)
        n_top = [params[i].logprobs for i in want]
        top_vals, top_ids = lp.topk(max(max(n_top), 1), dim=-1)
        chosen = lp.gather(1, tokens[w].unsqueeze(1)).squeeze(1)
        return PendingSample(tokens, (top_vals, top_ids, chosen), want, n_top)
