"""What callers get back: per-request outputs in vLLM's shapes.

An output is cumulative (everything so far), a delta (only what is new since the
last output of that request; the server streams these, so no step copies a whole
output) or final, as the request's `SamplingParams.output_kind` asks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None         # "stop" | "length" | "abort"
    stop_reason: int | str | None = None     # the stop string or stop token that ended it
    # Per generated token: {token_id: logprob} of the top-N plus the sampled token.
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None  # of the sampled tokens (when logprobs asked)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Each prompt token's rank in its distribution (1 = most likely; None for the first),
    # aligned with prompt_logprobs: the token may lie outside the top-N it comes with.
    prompt_logprob_ranks: list[int | None] | None = None
