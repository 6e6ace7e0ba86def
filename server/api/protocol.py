"""OpenAI/vLLM request models, and the builders of response bodies.

Field names and defaults follow vLLM's server so that existing clients work unchanged.
Unknown fields are ignored (the OpenAI SDKs send fields such as `store` or `metadata`
that mean nothing here); the OpenAI and vLLM fields this server cannot honour are
declared and refused (`UNHONOURED_FIELDS`). Sampling fields that the request leaves unset (None) take the
model's generation_config.json value, then vLLM's default: exactly where vLLM's server
applies `generation_config` defaults.

Response bodies are plain dicts built by small functions rather than pydantic models:
they are built once per streamed token, and their shape is checked by the official
`openai` client in the tests.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagefleet.server.engine.sampling_params import (LOGIT_BIAS_MAX, MAX_ALLOWED_TOKEN_IDS,
                                                     SamplingParams)

# vLLM's defaults for fields the request and generation_config.json both leave unset.
VLLM_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                          "repetition_penalty": 1.0}


# Bounds checked at the edge, one table (issue: no request can take a replica down).
# Static ones live in the field types below; the engine-dependent ones (vocab size,
# context length, --max-logprobs, the queue) are checked in serving.py from the limits
# the engine reports. Every violation is a 400 naming the field.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_STOP_STRINGS = 128            # stop strings per request
MAX_STOP_STRING_CHARS = 4096      # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_MESSAGES = 65536
MAX_N = 128                       # choices per request (n, best_of)
MAX_LOGIT_BIAS = 1024             # logit_bias entries (staged on every step of the request)

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class _Base(BaseModel):
    # NaN and infinity are never valid sampling values.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Base):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Base):
    model: str | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: Int64 | None = None
    stop: str | list[str] | None = None     # checked by _stop_strings
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: Count = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    # token id (a string, as JSON keys are) -> bias in [-100, 100]; ids are checked
    # against the vocabulary in serving.py.
    logit_bias: dict[Annotated[str, Field(pattern=r"^[0-9]{1,12}$")],
                     Annotated[float, Field(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX)]] | None = \
        Field(None, max_length=MAX_LOGIT_BIAS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: Int64 = 0
    request_id: str | None = Field(None, max_length=256)
    user: str | None = None            # accepted and ignored, as vLLM does
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    prompt_logprobs: Count | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    # Structured outputs: checked at the edge by structured_outputs.py, which also
    # takes vLLM's older guided_* names (never silently ignored).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None          # vLLM <= 0.11's top-level name: refused (a 400)
    # vLLM's: sampling keeps only these tokens (ids checked against the vocabulary by the
    # engine's limits).
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1,
                                                    max_length=MAX_ALLOWED_TOKEN_IDS)
    # vLLM sampling fields this server cannot honour: declared so that setting one is a
    # 400 naming it (UNHONOURED_FIELDS), never a 200 that ignores it.
    bad_words: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    spaces_between_special_tokens: Any = None
    logits_processors: Any = None
    cache_salt: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        """One message for every bad stop (a union's per-member errors name pydantic's
        internals). vLLM refuses an empty stop string too: it would end every request."""
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        for s in stops:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} "
                                 "characters")
        return v

    def structured_fields(self) -> dict:
        return {k: getattr(self, k) for k in STRUCTURED_FIELDS}


STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar", "guided_decoding_backend",
                     "guided_whitespace_pattern", "structural_tag")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Count | None = 16
    echo: bool = False
    logprobs: Count | None = None
    suffix: str | None = None
    prompt_embeds: Any = None


class ChatMessage(_Base):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_where_required(self) -> "ChatMessage":
        # OpenAI: only an assistant message may leave its content out (it may carry
        # tool_calls instead).
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required for a message with role {self.role!r}")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Count | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = True
    # Passed to the chat template (as vLLM passes it), and a 400 when the model's
    # template does not read it: it could not change the output.
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    # vLLM's: false leaves the reasoning (reasoning_content / reasoning) out of the
    # response, streamed or not.
    include_reasoning: bool = True
    # vLLM's: a Jinja template used instead of the model's for this request (a 400
    # unless the server runs with --trust-request-chat-template, as in vLLM), and
    # documents handed to the template (RAG templates read `documents`).
    chat_template: str | None = None
    documents: list[dict[str, Any]] | None = None
    # OpenAI fields this server cannot honour: declared so that a request setting one
    # is a 400 naming it (UNHONOURED_FIELDS), not a 200 that ignores it.
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    verbosity: Any = None
    echo: Any = None


# field -> (values that change nothing and pass, why any other value is refused). A
# field left out or null always passes. One table for both endpoints; a field a request
# model does not declare is never set.
UNHONOURED_FIELDS: dict[str, tuple[tuple, str]] = {
    "modalities": ((["text"], []), "only text output is supported"),
    "audio": ((), "audio output is not supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "web_search_options": ((), "web search is not supported"),
    "functions": ((), "the legacy functions field is not supported; send tools"),
    "function_call": ((), "the legacy function_call field is not supported; send tool_choice"),
    "verbosity": ((), "verbosity is not supported"),
    "bad_words": ((), "bad_words is not supported; use logit_bias"),
    "use_beam_search": ((False,), "beam search is not supported"),
    "length_penalty": ((1, 1.0), "length_penalty applies to beam search, which is not "
                                 "supported"),
    "spaces_between_special_tokens": ((True,), "special tokens are always joined with "
                                               "spaces between them"),
    "logits_processors": ((), "custom logits processors are not supported"),
    "cache_salt": ((), "cache_salt is not supported: prefix-cache isolation between "
                       "tenants needs separate deployments"),
    "vllm_xargs": ((), "vllm_xargs is not supported"),
    "kv_transfer_params": ((), "KV transfer (disaggregated prefill) is not supported"),
    "prompt_embeds": ((), "prompt embeddings are not supported"),
}


# Chat only: /v1/completions honours its own `echo`.
UNHONOURED_CHAT_FIELDS: dict[str, tuple[tuple, str]] = {
    "echo": ((False,), "echo (prepending the last message) is not supported on chat; "
                       "/v1/completions has echo"),
}


def unhonoured_field(req: BaseModel) -> tuple[str, str] | None:
    """(field, why) of the first field the request sets that this server cannot honour."""
    table = UNHONOURED_FIELDS
    if isinstance(req, ChatCompletionRequest):
        table = {**table, **UNHONOURED_CHAT_FIELDS}
    for name, (passes, why) in table.items():
        value = getattr(req, name, None)
        if value is not None and not any(value == ok for ok in passes):
            return name, why
    return None


class TokenizeRequest(_Base):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None        # as on chat (--trust-request-chat-template)
    # as on chat, so messages count here what chat would prompt with (RAG templates read
    # `documents`; a template that does not read reasoning_effort makes it a 400)
    documents: list[dict[str, Any]] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[TokenId]


def sampling_params(req: _SamplingFields, defaults: dict, *, max_tokens: int | None,
                    logprobs: int | None) -> SamplingParams:
    """Request fields -> SamplingParams (raises SamplingParamsError naming the field)."""
    def pick(name: str) -> Any:
        value = getattr(req, name)
        if value is not None:
            return value
        return defaults.get(name, VLLM_SAMPLING_DEFAULTS[name])

    return SamplingParams(
        n=1, temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"),
        min_p=pick("min_p"), repetition_penalty=pick("repetition_penalty"),
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
        stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs,
        logit_bias={int(t): v for t, v in req.logit_bias.items()} if req.logit_bias else None,
        allowed_token_ids=req.allowed_token_ids,
        skip_special_tokens=req.skip_special_tokens, output_kind="delta")


# -- response bodies --------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, created: int, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": use}


def completion_choice(index: int, text: str, finish_reason: str | None,
                      stop_reason: Any = None) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def _chunk(kind: str, rid: str, model: str, created: int, choices: list[dict],
           use: dict | None) -> dict:
    body = {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body


def completion_chunk(rid: str, model: str, created: int, choices: list[dict],
                     use: dict | None = None) -> dict:
    return _chunk("text_completion", rid, model, created, choices, use)


def chat_body(rid: str, model: str, created: int, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": use}


def chat_choice(index: int, text: str, finish_reason: str | None, stop_reason: Any,
                logprobs: dict | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_chunk(rid: str, model: str, created: int, choices: list[dict],
               use: dict | None = None) -> dict:
    return _chunk("chat.completion.chunk", rid, model, created, choices, use)


def chat_delta_choice(index: int, delta: dict, finish_reason: str | None = None,
                      stop_reason: Any = None, logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs,
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def model_card(name: str, root: str, max_model_len: int, created: int | None = None) -> dict:
    return {"id": name, "object": "model", "created": created or int(time.time()),
            "owned_by": "pagefleet", "root": root, "parent": None,
            "max_model_len": max_model_len, "permission": []}


FinishReason = Literal["stop", "length", "abort"]
