"""The OpenAI Responses API request (`POST /v1/responses`), and what of it is refused.

Field names and meanings follow OpenAI's reference and vLLM's `ResponsesRequest`. The
request is served by mapping it onto a chat request (`responses_input.py`); this module
only declares its shape and the fields this server cannot honour. A field that would
change the result and cannot be honoured is a 400 naming it (`refused_field`), never a
200 that ignores it. Fields that cannot change the output (`user`,
`safety_identifier`, `prompt_cache_key`, `stream_options`) are accepted and not used;
`metadata` is echoed back. vLLM's sampling extras (`SAMPLING_PASSTHROUGH`: penalties,
`top_k`, `min_p`, `stop`, ...) are honoured through the chat request; chat's own names
(`max_tokens`, `messages`, `response_format`, `n`, `logprobs`) are 400s that name this
API's field. Other unknown fields are ignored, as on the chat endpoint.

There is no response store: `store` left out or `false` is served (OpenAI's default
is true, but clients send nothing unless it is set, and nothing is kept here); an
explicit `store: true`, `previous_response_id`, `conversation` and `background` need a
store and are refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from pagefleet.server.api.protocol import Count, Int64, _Base

Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class ResponsesRequest(_Base):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Count | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: Int64 | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = \
        Field(None, max_length=16)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    priority: Int64 = 0                 # vLLM's (--scheduling-policy priority)
    service_tier: str | None = None
    # Declared so that setting one is a 400 naming it (REFUSED_FIELDS).
    previous_response_id: Any = None
    store: Any = None
    background: Any = None
    include: Any = None
    conversation: Any = None
    truncation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    context_management: Any = None
    # Chat's names for what this API names otherwise, or has not (REFUSED_FIELDS)
    max_tokens: Any = None
    max_completion_tokens: Any = None
    messages: Any = None
    response_format: Any = None
    n: Any = None
    logprobs: Any = None
    # vLLM's sampling extras: not in OpenAI's Responses API, but vLLM's ResponsesRequest
    # takes the penalties, and a client sending one means it; each goes to the chat
    # request as it is (checked there, errors naming the same field).
    frequency_penalty: Any = None
    presence_penalty: Any = None
    top_k: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    ignore_eos: Any = None
    min_tokens: Any = None
    logit_bias: Any = None
    include_stop_str_in_output: Any = None


# Sampling fields passed to the chat request unchanged (declared above).
SAMPLING_PASSTHROUGH = ("frequency_penalty", "presence_penalty", "top_k", "min_p",
                        "repetition_penalty", "stop", "stop_token_ids", "ignore_eos",
                        "min_tokens", "logit_bias", "include_stop_str_in_output")


# field -> (values that change nothing and pass, why any other value is refused). A
# field left out or null always passes.
REFUSED_FIELDS: dict[str, tuple[tuple, str]] = {
    "previous_response_id": ((), "responses are not stored on this server, so there is no "
                                 "previous response to continue; send the whole "
                                 "conversation as input items"),
    "store": ((False,), "responses are not stored on this server; leave store out or set "
                        "it to false"),
    "background": ((False,), "background responses are not supported (they need a "
                             "response store)"),
    "include": (([],), "no extra output data (encrypted reasoning, logprobs, tool "
                       "results) can be included"),
    "conversation": ((), "conversations are not stored on this server; send the whole "
                         "conversation as input items"),
    "truncation": (("disabled",), "only truncation 'disabled' is supported: an input "
                                  "longer than the context is a 400"),
    "prompt": ((), "stored prompt templates are not supported; send instructions and "
                   "input"),
    "max_tool_calls": ((), "max_tool_calls is not supported; parallel_tool_calls false "
                           "allows one call"),
    "top_logprobs": ((0,), "logprobs are not returned by /v1/responses; use "
                           "/v1/chat/completions"),
    "context_management": ((), "server-side context compaction is not supported"),
    "service_tier": (("auto", "default"), "service tiers are not supported"),
    "max_tokens": ((), "a /v1/chat/completions field; /v1/responses takes max_output_tokens"),
    "max_completion_tokens": ((), "a /v1/chat/completions field; /v1/responses takes "
                                  "max_output_tokens"),
    "messages": ((), "a /v1/chat/completions field; /v1/responses takes input (and "
                     "instructions)"),
    "response_format": ((), "a /v1/chat/completions field; /v1/responses takes text.format"),
    "n": ((1,), "a response has one output; use /v1/chat/completions for n > 1"),
    "logprobs": ((False,), "logprobs are not returned by /v1/responses; use "
                           "/v1/chat/completions"),
}


def refused_field(req: ResponsesRequest) -> tuple[str, str] | None:
    """(field, why) of the first field the request sets that cannot be honoured."""
    for name, (passes, why) in REFUSED_FIELDS.items():
        value = getattr(req, name)
        if value is not None and not any(value == ok for ok in passes):
            return name, why
    return None


# Tool types OpenAI runs on its side: none of them exists here.
BUILTIN_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter",
                 "computer_use", "computer_use_preview", "mcp", "image_generation",
                 "local_shell", "shell", "apply_patch", "custom")
