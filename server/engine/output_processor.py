"""Turns the core's per-step deltas into text outputs: the API process's side.

For each request: incremental detokenization, stop strings (a match truncates the
text, finishes the request here, and asks the core to abort it so no more tokens are
computed for it), logprobs in vLLM's `{token_id: logprob}` shape, and outputs of the
kind the request asked for (delta, cumulative, final). Text that could still turn out
to be the start of a stop string is held back, so streamed text never has to be
taken back.

Work per step is proportional to the new tokens: no step copies a whole output.
"""

from __future__ import annotations

from pagefleet.server.engine.detokenizer import IncrementalDetokenizer, find_stop
from pagefleet.server.engine.outputs import CompletionOutput, RequestOutput
from pagefleet.server.engine.protocol import CoreOutput, Logprobs
from pagefleet.server.engine.sampling_params import SamplingParams


def logprob_dicts(lp: Logprobs) -> list[dict[int, float]]:
    """Core logprobs -> one `{token_id: logprob}` per token (the token and its top-N)."""
    return [dict(zip(ids, vals)) for ids, vals in zip(lp.token_ids, lp.logprobs)]


class RequestState:
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "params", "detok", "token_ids",
                 "logprobs", "cumulative_logprob", "emitted_text", "emitted_tokens",
                 "emitted_logprobs", "hold", "finish_reason", "stop_reason",
                 "num_cached_tokens", "longest_stop", "prompt_logprobs", "prompt_ranks",
                 "prompt_lp_sent")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, detok) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.detok = detok
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.emitted_text = 0
        self.emitted_tokens = 0
        self.emitted_logprobs = 0
        stops = params.stop_strings
        self.longest_stop = max((len(s) for s in stops), default=0)
        self.hold = max(self.longest_stop - 1, 0)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        # Position 0 has no logprob (nothing before it), as in vLLM.
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.prompt_ranks: list[int | None] = [None]   # each prompt token's rank, aligned
        self.prompt_lp_sent = False

    @property
    def text(self) -> str:
        return self.detok.text


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.states: dict[str, RequestState] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams) -> RequestState:
        detok = self.detokenizer.start(prompt_token_ids, params.skip_special_tokens)
        st = RequestState(request_id, prompt, prompt_token_ids, params, detok)
        self.states[request_id] = st
        return st

    def remove(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Outputs to hand out, and the ids whose generation a stop string ended (the
        caller aborts them in the core)."""
        results: list[RequestOutput] = []
        aborts: list[str] = []
        states = self.states
        for o in outputs:
            st = states.get(o.request_id)
            if st is None:
                continue   # already finished here (stop string) or unknown
            if o.num_cached_tokens >= 0:
                st.num_cached_tokens = o.num_cached_tokens
            if o.prompt_logprobs is not None and st.prompt_logprobs is not None:
                st.prompt_logprobs.extend(logprob_dicts(o.prompt_logprobs))
                st.prompt_ranks.extend(o.prompt_logprobs.ranks)
            if not o.new_token_ids and o.finish_reason is None:
                continue   # a prompt chunk's logprobs: they go out with the first token
            if self._update(st, o) and o.finish_reason is None:
                aborts.append(st.request_id)
            out = self._output(st)
            if out is not None:
                results.append(out)
            if st.finish_reason is not None:
                del states[st.request_id]
        return results, aborts

    def _update(self, st: RequestState, o: CoreOutput) -> bool:
        """Apply one delta; True if a stop string finished the request here."""
        st.token_ids.extend(o.new_token_ids)
        if o.new_logprobs is not None and st.logprobs is not None:
            st.logprobs.extend(logprob_dicts(o.new_logprobs))
            st.cumulative_logprob += sum(v[0] for v in o.new_logprobs.logprobs)
        p = st.params
        detok, step = st.detok, self.detokenizer.step
        before = len(detok.text)
        new = o.new_token_ids
        if o.finish_reason == "stop" and new and not p.include_stop_str_in_output:
            # The core stops only on a token (EOS, a stop token id, a grammar's end): its
            # text is not part of the output unless asked for, as in vLLM. It stays in
            # token_ids, logprobs and usage.
            new = new[:-1]
        for t in new:
            step(detok, t)
        if o.finish_reason is not None:
            self.detokenizer.finish(detok)   # flush a character the output ended inside
        if p.stop_strings and len(st.token_ids) >= p.min_tokens:
            hit = find_stop(detok.text, p.stop_strings, before - st.longest_stop + 1)
            if hit is not None:
                idx, stop = hit
                detok.text = detok.text[:idx + (len(stop) if p.include_stop_str_in_output else 0)]
                st.finish_reason, st.stop_reason = "stop", stop
                return True
        if o.finish_reason is not None:
            st.finish_reason, st.stop_reason = o.finish_reason, o.stop_reason
        return False

    def _output(self, st: RequestState) -> RequestOutput | None:
        kind = st.params.output_kind
        finished = st.finish_reason is not None
        if kind == "final" and not finished:
            return None
        text = st.text
        visible = len(text) if finished else max(len(text) - st.hold, st.emitted_text)
        if kind == "delta":
            out_text = text[st.emitted_text:visible]
            out_ids = st.token_ids[st.emitted_tokens:]
            lps = st.logprobs[st.emitted_logprobs:] if st.logprobs is not None else None
        else:
            out_text = text[:visible]
            out_ids = list(st.token_ids)
            lps = list(st.logprobs) if st.logprobs is not None else None
        st.emitted_text = visible
        st.emitted_tokens = len(st.token_ids)
        st.emitted_logprobs = len(st.logprobs) if st.logprobs is not None else 0
        completion = CompletionOutput(
            index=0, text=out_text, token_ids=out_ids,
            finish_reason=st.finish_reason, stop_reason=st.stop_reason, logprobs=lps,
            cumulative_logprob=st.cumulative_logprob if st.logprobs is not None else None)
        prompt_lps = prompt_ranks = None
        if st.prompt_logprobs is not None and (kind != "delta" or not st.prompt_lp_sent):
            prompt_lps, prompt_ranks, st.prompt_lp_sent = st.prompt_logprobs, st.prompt_ranks, True
        return RequestOutput(request_id=st.request_id, prompt=st.prompt,
                             prompt_token_ids=st.prompt_token_ids, outputs=[completion],
                             finished=finished, num_cached_tokens=st.num_cached_tokens,
                             prompt_logprobs=prompt_lps, prompt_logprob_ranks=prompt_ranks)

    def finish(self, request_id: str, reason: str) -> RequestOutput | None:
        """End a request here (abort, error); returns its last output."""
        st = self.states.pop(request_id, None)
        if st is None:
            return None
        st.finish_reason = reason
        return self._output(st)
