"""What crosses the boundary between the API process and the engine core.

The core (scheduler, KV manager, runner, sampler) runs in its own process; the API
process owns tokenization, validation, chat templates, detokenization, stop strings
and response building. The messages are msgspec Structs (encoded with msgpack over
ZeroMQ in the server, passed as objects in-process for the offline `LLM`):

- in:  `CoreRequest` (token ids + the sampling fields the core needs, already
  validated at the edge) and `CoreAbort` (ids, and whether only a still-waiting request
  may be aborted: the queue timeout);
- out: one `CoreOutputs` per engine step, holding only deltas: each request's new
  token ids (and logprobs where asked), finish reasons, which requests were scheduled
  for the first time, preempted or scheduled again after a preemption, which failed on their own (isolated errors), and
  the engine's gauges and counters.

Nothing here depends on torch, so the API process never needs it.
"""

from __future__ import annotations

import msgspec


class CoreSamplingParams(msgspec.Struct, array_like=True, omit_defaults=True):
    """The sampling fields the core acts on. Stop strings and detokenization settings
    stay in the API process; `max_tokens` is already resolved to a number."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None          # top-N logprobs per generated token
    prompt_logprobs: int | None = None   # top-N logprobs per prompt token
    logit_bias_ids: tuple[int, ...] = ()        # logit_bias, as two parallel tuples
    logit_bias_values: tuple[float, ...] = ()
    allowed_token_ids: tuple[int, ...] = ()     # empty: every token
    # Structured output: (kind, text, syntax, any_whitespace) of a GrammarSpec, and the
    # token after which it is enforced (a reasoning model's `</think>`); with the start
    # token set, the first token decides (`StructuredState`).
    grammar: tuple[str, str, str, bool] | None = None
    reasoning_end_token_id: int | None = None
    reasoning_start_token_id: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return bool(self.repetition_penalty != 1.0 or self.frequency_penalty
                    or self.presence_penalty)


class CoreRequest(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    params: CoreSamplingParams
    priority: int = 0
    arrival_time: float = 0.0
    # Requests of one group (the choices of an `n > 1` request) share their prompt:
    # followers wait until the leader's prompt blocks are in the prefix cache.
    prefix_leader: str | None = None


class CoreAbort(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    request_ids: list[str]
    # Queue timeout of one HTTP request: `request_ids` are its open choices, aborted
    # together only if none of them was ever scheduled (else none is); the core answers
    # with a `failed` entry of kind "queue_timeout" for each one it did abort.
    only_if_waiting: bool = False


class Logprobs(msgspec.Struct, array_like=True):
    """Per token: `token_ids[i][0]` is the token itself, then the top-N; `logprobs[i]`
    aligned; `ranks[i]` the token's rank in the distribution (1 = most likely)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: Logprobs | None = None
    finish_reason: str | None = None      # "stop" | "length" | "abort"
    stop_reason: int | None = None        # the stop token id that ended it
    num_cached_tokens: int = -1           # prefix-cache hit, on the first output only
    prompt_logprobs: Logprobs | None = None


class CoreStats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    free_blocks: int
    total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int          # prompt tokens computed (cache hits excluded)
    generation_tokens: int
    num_steps: int
    step_tokens: int            # tokens scheduled in the last step


class CoreFailure(msgspec.Struct, array_like=True):
    request_id: str
    kind: str                   # "error" (isolated failure) | "queue_timeout"
    message: str


class CoreOutputs(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    outputs: list[CoreOutput] = []
    scheduled: list[str] = []   # scheduled for the first time (left the waiting queue)
    preempted: list[str] = []   # back in the waiting queue
    resumed: list[str] = []     # scheduled again after a preemption
    failed: list[CoreFailure] = []
    stats: CoreStats | None = None
    timestamp: float = 0.0

    def __bool__(self) -> bool:
        """Worth sending: something happened to a request, or a step ran (its size
        feeds vllm:iteration_tokens_total)."""
        return bool(self.outputs or self.scheduled or self.preempted or self.resumed or self.failed
                    or (self.stats is not None and self.stats.step_tokens))


class CoreReady(msgspec.Struct, tag=True, array_like=True):
    """Sent once by the core process when it is ready to serve."""

    max_model_len: int
    num_blocks: int
    block_size: int
    vocab_size: int
    eos_token_ids: list[int]
    device: str
    max_num_seqs: int
    max_num_batched_tokens: int
    memory_report: dict[str, float] = {}


class CoreError(msgspec.Struct, tag=True, array_like=True):
    """Sent by the core process before it exits: `kind` "config" (refused to start:
    a flag must change), "startup", "fatal" (the engine cannot go on) or "oom"."""

    kind: str
    message: str


class CoreUtility(msgspec.Struct, tag=True, array_like=True):
    """A call into the core for tests and introspection (`counters`, `check_whole`)."""

    call_id: int
    method: str


class CoreUtilityResult(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    result: dict = {}
    error: str | None = None


ToCore = CoreRequest | CoreAbort | CoreUtility
FromCore = CoreOutputs | CoreReady | CoreError | CoreUtilityResult
