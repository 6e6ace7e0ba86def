"""Request checks made once, at the edge, before anything reaches the engine core.

The API process and the offline `LLMEngine` both call these; the core then trusts
what it gets (it still isolates a request that fails inside it).
"""

from __future__ import annotations

from pagefleet.server.engine.protocol import CoreRequest
from pagefleet.server.engine.sampling_params import SamplingParams, SamplingParamsError


class RequestRejected(ValueError):
    """A request that can never run as asked; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(RequestRejected):
    """vLLM's wording: with max_tokens set, what was requested in all; without it, the
    prompt alone (it leaves no room for a token)."""

    def __init__(self, prompt_len: int, max_tokens: int | None, max_model_len: int,
                 param: str = "messages") -> None:
        if max_tokens:
            message = (f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, you requested {prompt_len + max_tokens} tokens ({prompt_len} "
                       f"in the messages, {max_tokens} in the completion). Please reduce the "
                       "length of the messages or completion.")
        else:
            message = (f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, your request has {prompt_len} input tokens. Please reduce "
                       "the length of the input messages.")
        super().__init__(message, param=param)
        self.prompt_len, self.max_tokens, self.max_model_len = prompt_len, max_tokens, max_model_len


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int,
                  param: str = "messages") -> None:
    """vLLM's context-length rule: the prompt leaves room for at least one token and,
    when max_tokens is set, for all of them. `param`: the request field the prompt came
    in (`messages` for chat, `prompt` for completions)."""
    if prompt_len >= max_model_len or (
            max_tokens is not None and prompt_len + max_tokens > max_model_len):
        raise PromptTooLongError(prompt_len, max_tokens, max_model_len, param)


def check_prompt_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    """Token ids in range: two C-speed passes (min/max) even for million-token prompts."""
    if not ids:
        raise RequestRejected("the prompt is empty", param)
    try:
        lo, hi = min(ids), max(ids)
        ok = isinstance(lo, int) and isinstance(hi, int) and lo >= 0 and hi < vocab_size
    except TypeError:
        ok = False
    if not ok or any(type(t) is not int for t in ids[:1]):
        bad = next((t for t in ids if type(t) is not int or not 0 <= t < vocab_size), ids[0])
        raise RequestRejected(f"token id {bad!r} is out of range [0, {vocab_size})", param)


class EngineLimits:
    """What the edge must know about the engine to validate a request."""

    def __init__(self, max_model_len: int, vocab_size: int, num_blocks: int,
                 block_size: int, max_logprobs: int = 20) -> None:
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_logprobs = max_logprobs

    def check_params(self, params: SamplingParams) -> None:
        """The sampling fields whose bounds depend on the engine."""
        v = self.vocab_size
        if params.n != 1:
            # One engine request is one sequence: LLM.generate and the HTTP server expand
            # n into n requests; an engine caller passing n > 1 would get one silently.
            raise SamplingParamsError("n", f"an engine request is one sequence; expand n "
                                      f"({params.n}) into requests (LLM.generate does)")
        if params.top_k > v:
            raise SamplingParamsError("top_k", f"must be -1 (off) or in [1, {v}] (the "
                                      f"vocabulary size), got {params.top_k}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is not None and n > self.max_logprobs:
                raise SamplingParamsError(name, f"must be at most {self.max_logprobs} "
                                          f"(--max-logprobs), got {n}")
        if params.stop_token_ids and any(t >= v for t in params.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", f"ids must be < {v}")
        if params.logit_bias and any(t >= v for t in params.logit_bias):
            raise SamplingParamsError("logit_bias", f"token ids must be < {v}")
        if params.allowed_token_ids and any(t >= v for t in params.allowed_token_ids):
            raise SamplingParamsError("allowed_token_ids", f"token ids must be < {v}")
        if params.min_tokens > self.max_model_len:
            raise SamplingParamsError("min_tokens", f"must be at most the context length "
                                      f"{self.max_model_len}, got {params.min_tokens}")

    def core_request(self, request_id: str, ids: list[int], params: SamplingParams, *,
                     priority: int = 0, arrival_time: float = 0.0,
                     prefix_leader: str | None = None) -> CoreRequest:
        """Validate and build the core's request (max_tokens resolved)."""
        check_prompt_ids(ids, self.vocab_size)
        check_context(len(ids), params.max_tokens, self.max_model_len)
        self.check_params(params)
        max_tokens = params.max_tokens or (self.max_model_len - len(ids))
        capacity = self.num_blocks * self.block_size
        if len(ids) + max_tokens > capacity:
            raise RequestRejected(
                f"the request needs up to {len(ids) + max_tokens} tokens of KV cache but the "
                f"whole cache holds {capacity}; lower max_tokens", "max_tokens")
        return CoreRequest(request_id, list(ids), params.core_params(max_tokens),
                           priority=priority, arrival_time=arrival_time,
                           prefix_leader=prefix_leader)
