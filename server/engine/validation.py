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
    def __init__(self, prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
        completion = max_tokens or 0
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + completion} tokens ({prompt_len} in the messages, "
            f"{completion} in the completion). Please reduce the length of the messages or "
            "completion.", param="messages")
        self.prompt_len, self.max_tokens, self.max_model_len = prompt_len, max_tokens, max_model_len


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
    """vLLM's context-length rule: the prompt leaves room for at least one token and,
    when max_tokens is set, for all of them."""
    if prompt_len >= max_model_len or (
            max_tokens is not None and prompt_len + max_tokens > max_model_len):
        raise PromptTooLongError(prompt_len, max_tokens, max_model_len)


def check_prompt_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    if not ids:
        raise RequestRejected("the prompt is empty", param)
    for t in ids:
        if type(t) is not int or not 0 <= t < vocab_size:
            raise RequestRejected(f"token id {t!r} is out of range [0, {vocab_size})", param)


class EngineLimits:
    """What the edge must know about the engine to validate a request."""

    def __init__(self, max_model_len: int, vocab_size: int, num_blocks: int,
                 block_size: int) -> None:
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.num_blocks = num_blocks
        self.block_size = block_size

    def core_request(self, request_id: str, ids: list[int], params: SamplingParams, *,
                     priority: int = 0, arrival_time: float = 0.0,
                     prefix_leader: str | None = None) -> CoreRequest:
        """Validate and build the core's request (max_tokens resolved)."""
        check_prompt_ids(ids, self.vocab_size)
        check_context(len(ids), params.max_tokens, self.max_model_len)
        if params.stop_token_ids and any(t >= self.vocab_size for t in params.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", f"ids must be < {self.vocab_size}")
        max_tokens = params.max_tokens or (self.max_model_len - len(ids))
        capacity = self.num_blocks * self.block_size
        if len(ids) + max_tokens > capacity:
            raise RequestRejected(
                f"the request needs up to {len(ids) + max_tokens} tokens of KV cache but the "
                f"whole cache holds {capacity}; lower max_tokens", "max_tokens")
        return CoreRequest(request_id, list(ids), params.core_params(max_tokens),
                           priority=priority, arrival_time=arrival_time,
                           prefix_leader=prefix_leader)
