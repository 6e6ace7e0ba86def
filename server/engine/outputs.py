"""What the engine hands back: cumulative per-request outputs (vLLM's shapes)."""

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


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
