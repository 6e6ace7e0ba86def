"""OpenAI/vLLM request models, and the builders of response bodies.

Field names and defaults follow vLLM's server so that existing clients work unchanged.
Unknown fields are ignored (the OpenAI SDKs send fields such as `store` or `metadata`
that mean nothing here). Sampling fields that the request leaves unset (None) take the
model's generation_config.json value, then vLLM's default: exactly where vLLM's server
applies `generation_config` defaults.

Response bodies are plain dicts built by small functions rather than pydantic models:
they are built once per streamed token, and their shape is checked by the official
`openai` client in the tests.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagefleet.server.engine.sampling_params import SamplingParams

# vLLM's defaults for fields the request and generation_config.json both leave unset.
VLLM_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                          "repetition_penalty": 1.0}


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Base):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Base):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    request_id: str | None = None
    user: str | None = None            # accepted and ignored, as vLLM does


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(_Base):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Base):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]


def sampling_params(req: _SamplingFields, defaults: dict, *, max_tokens: int | None,
                    logprobs: int | None) -> SamplingParams:
    """Request fields -> SamplingParams (raises SamplingParamsError naming the field)."""
    def pick(name: str) -> Any:
        value = getattr(req, name)
        if value is not None:
            return value
        return defaults.get(name, VLLM_SAMPLING_DEFAULTS[name])

    return SamplingParams(
        n=req.n, temperature=pick("temperature"), top_p=pick("top_p"), top_k=pick("top_k"),
        min_p=pick("min_p"), repetition_penalty=pick("repetition_penalty"),
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
        stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs,
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
