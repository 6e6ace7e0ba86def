"""Per-request sampling settings, with vLLM's names, defaults and meanings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagefleet.server.engine.protocol import CoreSamplingParams


LOGIT_BIAS_MAX = 100.0     # OpenAI's bound on a logit_bias value
MAX_N = 128                  # sequences per prompt (the HTTP server's bound too)
MAX_ALLOWED_TOKEN_IDS = 1024   # allowed_token_ids entries (staged on every step, as logit_bias)


class SamplingParamsError(ValueError):
    """A sampling field is out of range; `param` names it (for a 400 naming the field)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                 # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16     # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None     # top-N logprobs per generated token
    prompt_logprobs: int | None = None   # top-N logprobs per prompt token
    # token id -> value added to its logit before penalties, temperature and filters
    # (OpenAI's logit_bias; -100 bans a token, +100 all but forces it).
    logit_bias: dict[int, float] | None = None
    # vLLM's allowed_token_ids: sampling keeps only these tokens (the mask comes first,
    # as vLLM applies it; EOS only when listed).
    allowed_token_ids: list[int] | None = None
    # Structured output: a GrammarSpec's (kind, text, syntax, any_whitespace), enforced
    # after `reasoning_end_token_id` when that is set. With `reasoning_start_token_id`
    # set too, the output starts outside the reasoning: the first token may be that one
    # (then the grammar waits for the end token) or one the grammar allows (it holds
    # from there).
    grammar: tuple | None = None
    reasoning_end_token_id: int | None = None
    reasoning_start_token_id: int | None = None
    skip_special_tokens: bool = True
    # What each output carries: "cumulative" (everything so far), "delta" (what is new
    # since the last output; the server streams these) or "final" (one output, at the
    # end; the offline LLM).
    output_kind: str = "cumulative"
    stop_strings: tuple[str, ...] = field(init=False, default=())
    # Derived once, read every step by the sampler.
    greedy: bool = field(init=False, default=False)
    has_penalties: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        self.stop_strings = tuple(s for s in stop if s)
        self.validate()
        self.greedy = self.temperature < 1e-5
        self.has_penalties = bool(self.repetition_penalty != 1 or self.frequency_penalty
                                  or self.presence_penalty)

    def validate(self) -> None:
        def need(cond: bool, param: str, msg: str) -> None:
            if not cond:
                raise SamplingParamsError(param, msg)

        need(isinstance(self.n, int) and 1 <= self.n <= MAX_N, "n",
             f"must be in [1, {MAX_N}], got {self.n}")
        need(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        need(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        need(self.top_k == -1 or self.top_k >= 0, "top_k", f"must be -1 (off) or >= 0, got {self.top_k}")
        need(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        need(-2 <= self.presence_penalty <= 2, "presence_penalty",
             f"must be in [-2, 2], got {self.presence_penalty}")
        need(-2 <= self.frequency_penalty <= 2, "frequency_penalty",
             f"must be in [-2, 2], got {self.frequency_penalty}")
        need(self.repetition_penalty > 0, "repetition_penalty",
             f"must be > 0, got {self.repetition_penalty}")
        need(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
             f"must be >= 1, got {self.max_tokens}")
        need(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        need(self.logprobs is None or self.logprobs >= 0, "logprobs",
             f"must be >= 0, got {self.logprobs}")
        need(self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
             f"must be >= 0, got {self.prompt_logprobs}")
        need(all(isinstance(s, str) for s in self.stop_strings), "stop", "must be strings")
        need(self.stop_token_ids is None or all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids", "must be non-negative integers")
        need(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        need(not self.logit_bias or all(
            isinstance(t, int) and t >= 0 and -LOGIT_BIAS_MAX <= v <= LOGIT_BIAS_MAX
            for t, v in self.logit_bias.items()), "logit_bias",
            f"keys must be token ids and values in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]")
        need(self.allowed_token_ids is None or (
            0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS
            and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)),
            "allowed_token_ids", f"must be 1 to {MAX_ALLOWED_TOKEN_IDS} token ids")
        need(self.output_kind in ("cumulative", "delta", "final"), "output_kind",
             "must be cumulative, delta or final")

    def core_params(self, max_tokens: int) -> "CoreSamplingParams":
        """The fields the engine core acts on, with max_tokens resolved."""
        from pagefleet.server.engine.protocol import CoreSamplingParams

        return CoreSamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k if self.top_k > 0 else -1, min_p=self.min_p, seed=self.seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            logprobs=self.logprobs, prompt_logprobs=self.prompt_logprobs,
            logit_bias_ids=tuple(self.logit_bias or ()),
            logit_bias_values=tuple(float(v) for v in (self.logit_bias or {}).values()),
            allowed_token_ids=tuple(sorted(set(self.allowed_token_ids or ()))),
            grammar=tuple(self.grammar) if self.grammar is not None else None,
            reasoning_end_token_id=self.reasoning_end_token_id,
            reasoning_start_token_id=self.reasoning_start_token_id)
