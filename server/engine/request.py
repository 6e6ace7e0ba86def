"""Request state as the engine core sees it: token ids, progress, sampling fields.

`num_computed_tokens` is the only progress counter: a prefill chunk, a decode and a
recompute after preemption all just advance it towards `num_tokens`.

With async scheduling a step is scheduled before the previous step's tokens are read
back: `num_pending` counts the token a launched step is still sampling for this
request (0 or 1). `num_tokens` includes it, so the scheduler plans the next decode
from it; the runner reads that input id on the device.
"""

from __future__ import annotations

import enum
import itertools

from pagefleet.server.engine.protocol import CoreSamplingParams

_arrival_order = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    __slots__ = ("request_id", "all_token_ids", "num_prompt_tokens", "params", "priority",
                 "arrival_time", "arrival_seq", "eos_token_ids", "status",
                 "num_computed_tokens", "num_cached_tokens", "num_preemptions", "num_pending",
                 "max_tokens", "finish_reason", "stop_reason", "slot", "ever_scheduled",
                 "queue_gen", "prefix_leader", "prompt_logprobs_next", "generator",
                 "sample_row", "structured")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: CoreSamplingParams,
                 *, priority: int = 0, arrival_time: float = 0.0,
                 eos_token_ids: tuple[int, ...] = (), max_tokens: int | None = None,
                 prefix_leader: str | None = None) -> None:
        self.request_id = request_id
        self.all_token_ids = list(prompt_token_ids)     # prompt, then output tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.arrival_time = arrival_time
        self.arrival_seq = next(_arrival_order)   # breaks ties between equal arrival times
        self.eos_token_ids = eos_token_ids
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0          # prefix-cache hit on first scheduling
        self.num_preemptions = 0
        self.num_pending = 0
        self.max_tokens = params.max_tokens if max_tokens is None else max_tokens
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        self.slot = -1                      # row of the sampler's persistent state
        self.ever_scheduled = False
        self.queue_gen = 0                  # invalidates stale waiting-queue entries
        self.prefix_leader = prefix_leader
        # The first prompt position whose logprob was not staged yet (position 0 has
        # none). A prompt recomputed after preemption skips the positions before it,
        # so each prompt logprob is reported once.
        self.prompt_logprobs_next = 1
        self.generator = None               # torch.Generator of a seeded request
        self.sample_row = -1                # its row among the last launched step's samples
        self.structured = None              # StructuredState of a request with a grammar

    @property
    def num_tokens(self) -> int:
        """Known tokens plus the one a launched step is still sampling."""
        return len(self.all_token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def sort_key(self, policy: str) -> tuple:
        """Smaller runs first: arrival for fcfs, (priority, arrival) for priority."""
        if policy == "priority":
            return (self.priority, self.arrival_time, self.arrival_seq)
        return (self.arrival_time, self.arrival_seq)

    def will_finish_on_length(self, max_model_len: int) -> bool:
        """Its known + pending tokens already reach max_tokens or the context limit."""
        return (self.num_output_tokens + self.num_pending >= self.max_tokens
                or self.num_tokens >= max_model_len)
