"""Request state as the scheduler and engine see it."""

from __future__ import annotations

import enum
import itertools
import time

import torch

from pagefleet.server.engine.outputs import RequestMetrics
from pagefleet.server.engine.sampling_params import SamplingParams


_arrival_order = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Token ids (prompt + output), how many have KV in the cache, and sampling state.

    `num_computed_tokens` is the only progress counter: a prefill chunk, a decode and a
    recompute after preemption all just advance it towards `num_tokens`.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 *, prompt: str | None = None, priority: int = 0,
                 arrival_time: float | None = None, eos_token_ids: tuple[int, ...] = (),
                 generator: torch.Generator | None = None, stream: bool = True) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.arrival_seq = next(_arrival_order)   # breaks ties between equal arrival times
        self.eos_token_ids = eos_token_ids
        self.generator = generator
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0          # prefix-cache hit on first scheduling
        self.num_preemptions = 0
        self.stream = stream                # emit an output every step, not only at the end
        self.max_tokens = params.max_tokens
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.metrics = RequestMetrics(arrival_time=time.time())

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def sort_key(self, policy: str) -> tuple:
        """Smaller runs first: arrival for fcfs, (priority, arrival) for priority."""
        if policy == "priority":
            return (self.priority, self.arrival_time, self.arrival_seq)
        return (self.arrival_time, self.arrival_seq)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
