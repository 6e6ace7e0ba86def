"""Batched sampling with persistent device state: penalties, temperature, top-k /
top-p / min-p, seeds, logprobs.

Each running request owns a row slot. Its sampling parameters live in a device
tensor row, written once when it gets the slot; its prompt-token mask and output-token
counts (for the penalties) live on the device too and are updated there from the
sampled tokens. So a step's host work is one list of slots and a few flags; nothing on
the step path copies pageable memory to the device or reads a device value back,
greedy or not.

Random rows draw with the exponential race (argmax of p / E, E ~ Exp(1)): one batched
draw for unseeded rows, and for a seeded request a draw over the whole vocabulary
from its own generator, so a seeded request gets the same tokens whatever else is in
the batch. With top-k set (Qwen's and Llama's generation configs all set it) the
candidates are the top-k values alone: no sort of the vocabulary.

The filter functions are public and pure so tests can check them against a direct
computation on fixed logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagefleet.server.engine.protocol import Logprobs
from pagefleet.server.engine.request import Request
from pagefleet.server.engine.staging import Staging

# Param columns of the per-slot device row.
_TEMP, _TOP_P, _TOP_K, _MIN_P, _REP, _FREQ, _PRES, _GREEDY = range(8)
_NUM_COLS = 8
TOPK_PATH_MAX = 1024   # top-k up to this takes the top-k path (no full sort)


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties. logits `[B, V]`; prompt_mask `[B, V]` bool; output_counts `[B, V]`.

    Repetition (HF/CTRL style) applies to tokens seen in prompt or output: positive
    logits are divided by it, negative ones multiplied. Frequency and presence (OpenAI
    style) apply to output tokens only. Neutral values (1, 0, 0) leave a row exactly
    unchanged, so rows without penalties can share the batch.
    """
    counts = output_counts.to(logits.dtype)
    seen_out = output_counts > 0
    seen = prompt_mask | seen_out
    rep = repetition.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - frequency.unsqueeze(1) * counts
    logits = logits - presence.unsqueeze(1) * seen_out.to(logits.dtype)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask filtered tokens to -inf over the whole vocabulary (the sort path).
    top_k `[B]` (<= 0: off), top_p, min_p `[B]`.

    Order as vLLM: top-k, then top-p on what is left (the smallest set whose mass
    reaches p, always keeping the most likely token), then min-p relative to the
    most likely token's probability.
    """
    vocab = logits.shape[1]
    k = torch.where(top_k <= 0, torch.full_like(top_k, vocab), top_k.clamp(max=vocab))
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    filtered = _filter_sorted(sorted_logits, k, top_p, min_p)
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_idx, filtered)


def _filter_sorted(sorted_logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """top-k / top-p / min-p on logits sorted in descending order along dim 1."""
    width = sorted_logits.shape[1]
    ranks = torch.arange(width, device=sorted_logits.device).unsqueeze(0)
    remove = ranks >= k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    remove = remove | (mass_before >= top_p.unsqueeze(1))
    remove = remove | (probs < min_p.unsqueeze(1) * probs[:, :1])
    remove[:, 0] = False
    return sorted_logits.masked_fill(remove, float("-inf"))


def top_k_candidates(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor, k_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k path: (candidate logits `[B, k_max]` with filtered ones at -inf, their
    token ids). Every row's top_k must be in 1..k_max."""
    vals, idx = logits.topk(k_max, dim=-1)   # sorted, descending
    return _filter_sorted(vals, top_k, top_p, min_p), idx


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[Logprobs | None]


class PendingSample:
    """Sampled tokens still on the device, with their copy to the host under way.

    `tokens` stays on the device; the next step's forward reads its pending input ids
    from the runner's `last_tokens`. `resolve()` waits for this step's copy alone,
    not for whatever was queued on the device after it.
    """

    def __init__(self, tokens_host: torch.Tensor, n: int, logprob_parts: tuple | None,
                 want: list[int], device: torch.device) -> None:
        self._host = tokens_host
        self._n = n
        self._lp = logprob_parts
        self._want = want
        self._event = None
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    def resolve(self) -> SampleResult:
        if self._event is not None:
            self._event.synchronize()
        tokens = self._host[:self._n].tolist()
        logprobs: list[Logprobs | None] = [None] * self._n
        if self._want:
            top_vals, top_ids, chosen, ranks, n_top = self._lp
            vals, ids, ch, rk = top_vals.tolist(), top_ids.tolist(), chosen.tolist(), ranks.tolist()
            for j, i in enumerate(self._want):
                n = n_top[j]
                logprobs[i] = Logprobs([[tokens[i]] + ids[j][:n]], [[ch[j]] + vals[j][:n]], [rk[j]])
        return SampleResult(tokens, logprobs)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass
class SamplerStep:
    """What `stage()` decided for one step (host facts + staging handles)."""

    num_rows: int
    fast_greedy: bool
    slots: int | None = None
    param_updates: tuple[int, int] | None = None      # (slots handle, values handle)
    mask_updates: int | None = None                    # [2, n] (slot, prompt token)
    count_updates: int | None = None                   # [2, n] (slot, output token)
    reset_slots: int | None = None
    bans: int | None = None                            # [2, n] (row, token)
    bias: tuple[int, int] | None = None                # [2, n] (row, token), [n] values
    allowed: tuple[int, int] | None = None             # [2, n] (row, token), [r] its rows
    any_random: bool = False
    any_greedy: bool = False
    any_penalties: bool = False
    filter_path: str = ""                              # "", "topk" or "sort"
    k_max: int = 0
    seeded: list[tuple[int, torch.Generator]] = field(default_factory=list)
    want: list[int] = field(default_factory=list)
    want_rows: int | None = None
    n_top: list[int] = field(default_factory=list)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, max_rows: int,
                 seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.max_rows = max_rows
        self.params = torch.zeros(max_rows, _NUM_COLS, dtype=torch.float32, device=device)
        self.prompt_mask = torch.zeros(max_rows, vocab_size, dtype=torch.bool, device=device)
        self.out_counts = torch.zeros(max_rows, vocab_size, dtype=torch.int32, device=device)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # Device scalars for the indexed writes: `t[rows, cols] = True` with a Python
        # value makes a CPU tensor that index_put_ copies to the device from pageable
        # memory, which waits for the stream (one whole step, measured on the H200).
        self._true = torch.ones((), dtype=torch.bool, device=device)
        self._neg_inf = torch.full((), float("-inf"), device=device)
        pin = device.type == "cuda"
        self._tokens_host = [torch.zeros(max_rows, dtype=torch.long, pin_memory=pin)
                             for _ in range(2)]
        self._which = 0
        # Slot-holders by feature, so an all-greedy batch needs no per-row work.
        self.num_random = self.num_penalties = self.num_filters = 0
        self.num_logprobs = self.num_min_tokens = self.num_bias = self.num_allowed = 0

    # -- slots ----------------------------------------------------------------------
    def _count(self, req: Request, delta: int) -> None:
        p = req.params
        random = not p.greedy
        self.num_random += delta * random
        self.num_penalties += delta * p.has_penalties
        self.num_filters += delta * (random and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0))
        self.num_logprobs += delta * (p.logprobs is not None)
        self.num_min_tokens += delta * (p.min_tokens > 0)
        self.num_bias += delta * bool(p.logit_bias_ids)
        self.num_allowed += delta * bool(p.allowed_token_ids)

    def slot_taken(self, req: Request) -> None:
        self._count(req, 1)

    def slot_released(self, req: Request) -> None:
        self._count(req, -1)

    # -- per step ---------------------------------------------------------------------
    def stage(self, staging: Staging, reqs: list[Request], new: list[Request]) -> SamplerStep:
        """Host work for one step's sampling: `reqs` sample (in row order), `new` got
        their slot this step (their parameter rows and penalty state are written)."""
        st = SamplerStep(num_rows=len(reqs), fast_greedy=False)
        if new:
            rows = []
            for r in new:
                p = r.params
                greedy = p.greedy
                rows.append([1.0 if greedy else p.temperature, p.top_p,
                             float(p.top_k if p.top_k > 0 else 0), p.min_p,
                             p.repetition_penalty, p.frequency_penalty, p.presence_penalty,
                             1.0 if greedy else 0.0])
            st.param_updates = (staging.put("i64", [r.slot for r in new]),
                                staging.put("f32", rows, len(new), _NUM_COLS))
            pen = [r for r in new if r.params.has_penalties]
            if pen:
                st.reset_slots = staging.put("i64", [r.slot for r in pen])
                m_slot, m_tok, c_slot, c_tok = [], [], [], []
                for r in pen:
                    prompt = r.all_token_ids[:r.num_prompt_tokens]
                    m_slot.extend([r.slot] * len(prompt))
                    m_tok.extend(prompt)
                    out = r.all_token_ids[r.num_prompt_tokens:]   # after a preemption
                    c_slot.extend([r.slot] * len(out))
                    c_tok.extend(out)
                st.mask_updates = staging.put("i64", [m_slot, m_tok], 2, len(m_tok))
                if c_tok:
                    st.count_updates = staging.put("i64", [c_slot, c_tok], 2, len(c_tok))
        if not reqs:
            return st
        if not (self.num_random or self.num_penalties or self.num_logprobs or self.num_min_tokens
                or self.num_bias or self.num_allowed):
            st.fast_greedy = True
            return st
        st.slots = staging.put("i64", [r.slot for r in reqs])
        st.any_random = self.num_random > 0
        st.any_greedy = not st.any_random or any(r.params.greedy for r in reqs)
        st.any_penalties = self.num_penalties > 0
        if self.num_filters:
            ks = [r.params.top_k for r in reqs if not r.params.greedy]
            if ks and all(0 < k <= TOPK_PATH_MAX for k in ks):
                st.filter_path, st.k_max = "topk", min(max(ks), self.vocab_size)
            elif ks:
                st.filter_path = "sort"
        ban_rows, ban_toks = [], []
        bias_rows: list[int] = []
        bias_toks: list[int] = []
        bias_vals: list[float] = []
        allow_rows: list[int] = []
        allow_pairs: tuple[list[int], list[int]] = ([], [])
        for i, r in enumerate(reqs):
            p = r.params
            if p.allowed_token_ids:
                allow_rows.append(i)
                allow_pairs[0].extend([i] * len(p.allowed_token_ids))
                allow_pairs[1].extend(p.allowed_token_ids)
            if p.logit_bias_ids:
                bias_rows.extend([i] * len(p.logit_bias_ids))
                bias_toks.extend(p.logit_bias_ids)
                bias_vals.extend(p.logit_bias_values)
            if r.generator is not None and not p.greedy:
                st.seeded.append((i, r.generator))
            if p.logprobs is not None:
                st.want.append(i)
                st.n_top.append(p.logprobs)
            if p.min_tokens and r.num_output_tokens + r.num_pending < p.min_tokens:
                banned = list(p.stop_token_ids)
                if not p.ignore_eos:
                    banned += r.eos_token_ids
                for t in banned:
                    if t < self.vocab_size:
                        ban_rows.append(i)
                        ban_toks.append(t)
        if ban_rows:
            st.bans = staging.put("i64", [ban_rows, ban_toks], 2, len(ban_rows))
        if bias_rows:
            st.bias = (staging.put("i64", [bias_rows, bias_toks], 2, len(bias_rows)),
                       staging.put("f32", bias_vals))
        if allow_rows:
            st.allowed = (staging.put("i64", list(allow_pairs), 2, len(allow_pairs[0])),
                          staging.put("i64", allow_rows))
        if st.want:
            st.want_rows = staging.put("i64", st.want)
        return st

    @torch.inference_mode()
    def apply_updates(self, st: SamplerStep, staging: Staging) -> None:
        """Write new slots' parameters and penalty state (queued on the device)."""
        if st.param_updates is not None:
            slots, vals = (staging.get(h) for h in st.param_updates)
            self.params.index_copy_(0, slots, vals)
        if st.reset_slots is not None:
            slots = staging.get(st.reset_slots)
            self.prompt_mask.index_fill_(0, slots, False)
            self.out_counts.index_fill_(0, slots, 0)
            upd = staging.get(st.mask_updates)
            self.prompt_mask.index_put_((upd[0], upd[1]), self._true)
            if st.count_updates is not None:
                upd = staging.get(st.count_updates)
                self.out_counts.index_put_((upd[0], upd[1]),
                                           torch.ones_like(upd[0], dtype=torch.int32),
                                           accumulate=True)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, st: SamplerStep, staging: Staging,
               last_tokens: torch.Tensor, grammar: tuple | None = None) -> PendingSample:
        """Queue the sampling of one token per row; the tokens also land in
        `last_tokens[:rows]` for the next step's pending decodes. `grammar` is a
        (bitmask, rows) pair from the structured-output requests: those rows keep only
        the tokens their grammar allows, before anything else. The logits are consumed
        (masked, penalised and scaled in place)."""
        self.apply_updates(st, staging)
        n = st.num_rows
        logits = logits.float()
        dev = self.device
        lp_rows = None
        if st.want:   # logprobs are of the raw model output (vLLM's default)
            lp_rows = logits.index_select(0, staging.get(st.want_rows))
        if grammar is not None:
            from pagefleet.server.engine.structured_output import apply

            apply(logits, grammar[0], grammar[1])
        if st.allowed is not None:   # vLLM's allowed_token_ids: only those stay
            pairs, rows = staging.get(st.allowed[0]), staging.get(st.allowed[1])
            keep = torch.ones_like(logits, dtype=torch.bool)
            keep.index_fill_(0, rows, False)
            keep.index_put_((pairs[0], pairs[1]), self._true)
            logits = logits.masked_fill(~keep, float("-inf"))
        if st.bias is not None:   # before penalties and temperature, as in vLLM
            if dev.type != "cuda":
                logits = logits.clone()
            where, vals = staging.get(st.bias[0]), staging.get(st.bias[1])
            logits.index_put_((where[0], where[1]), vals, accumulate=True)
        if st.fast_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            slots = staging.get(st.slots)
            p = self.params.index_select(0, slots)
            work = logits
            if st.any_penalties or st.any_random:
                work = self._prologue(logits, slots, p, st.any_penalties)
            if st.bans is not None:
                if work is logits and dev.type != "cuda":
                    work = logits.clone()
                bans = staging.get(st.bans)
                work.index_put_((bans[0], bans[1]), self._neg_inf)
            if st.any_random:
                tokens = self._random(work, p, st)
                if st.any_greedy:
                    tokens = torch.where(p[:, _GREEDY] > 0, work.argmax(dim=-1), tokens)
            else:
                tokens = work.argmax(dim=-1)
            if st.any_penalties:
                self.out_counts.index_put_((slots, tokens),
                                           torch.ones_like(tokens, dtype=torch.int32),
                                           accumulate=True)
        last_tokens[:n].copy_(tokens)
        self._which ^= 1
        host = self._tokens_host[self._which]
        if dev.type == "cuda":
            host[:n].copy_(tokens, non_blocking=True)
        else:
            host[:n] = tokens
        parts = None
        if lp_rows is not None:
            lp = torch.log_softmax(lp_rows, dim=-1)
            k = max(max(st.n_top), 1)
            top_vals, top_ids = lp.topk(min(k, self.vocab_size), dim=-1)
            chosen = lp.gather(1, tokens.index_select(0, staging.get(st.want_rows)).unsqueeze(1))
            ranks = (lp > chosen).sum(dim=-1) + 1
            parts = (_to_host(top_vals), _to_host(top_ids), _to_host(chosen.squeeze(1)),
                     _to_host(ranks), st.n_top)
        return PendingSample(host, n, parts, st.want, dev)

    def _prologue(self, logits: torch.Tensor, slots: torch.Tensor, p: torch.Tensor,
                  penalties: bool) -> torch.Tensor:
        """Penalties (where any row has them) and temperature, in one pass on CUDA."""
        if self.device.type == "cuda":
            from pagefleet.server.ops.triton_sampling import penalize_and_scale

            return penalize_and_scale(logits, self.prompt_mask, self.out_counts, slots,
                                      self.params, (_TEMP, _REP, _FREQ, _PRES), penalties)
        if penalties:
            logits = apply_penalties(logits, self.prompt_mask.index_select(0, slots),
                                     self.out_counts.index_select(0, slots),
                                     p[:, _REP], p[:, _FREQ], p[:, _PRES])
        return logits / p[:, _TEMP].unsqueeze(1)

    def _random(self, scaled: torch.Tensor, p: torch.Tensor, st: SamplerStep) -> torch.Tensor:
        """Sample from logits already divided by the temperature."""
        if st.filter_path == "topk":
            k = torch.where(p[:, _TOP_K] > 0, p[:, _TOP_K], float(st.k_max)).long()
            cand, idx = top_k_candidates(scaled, k, p[:, _TOP_P], p[:, _MIN_P], st.k_max)
            probs = cand.softmax(dim=-1)
            noise = torch.empty_like(probs).exponential_(generator=self.generator)
            for i, gen in st.seeded:   # a seeded row's draw covers the whole vocabulary
                full = torch.empty(self.vocab_size, device=self.device).exponential_(generator=gen)
                noise[i] = full.index_select(0, idx[i])
            return idx.gather(1, (probs / noise).argmax(dim=-1, keepdim=True)).squeeze(1)
        if st.filter_path == "sort":
            scaled = apply_top_k_top_p_min_p(scaled, p[:, _TOP_K].long(), p[:, _TOP_P],
                                             p[:, _MIN_P])
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, gen in st.seeded:
            noise[i].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)
