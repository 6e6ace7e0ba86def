"""Response bodies of `/v1/responses`: the `response` object and its output items.

The chat path's result (reasoning, content, tool calls, finish reason, token counts)
becomes, in this order: a `reasoning` item (only with --reasoning-parser, when the
model reasoned), a `message` item with one `output_text` part, and one `function_call`
item per tool call. A response cut by the token limit (`max_output_tokens`, or the
context) is `status: "incomplete"` with `incomplete_details.reason:
"max_output_tokens"`, as OpenAI reports it. The request's settings are echoed as OpenAI
echoes them (the effective sampling values, after the model's defaults).
"""

from __future__ import annotations

import secrets
import string

from pagefleet.server.api.responses_protocol import ResponsesRequest

_ALNUM = string.ascii_letters + string.digits


def new_id(prefix: str) -> str:
    return f"{prefix}_" + "".join(secrets.choice(_ALNUM) for _ in range(32))


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else [],
            "status": status}


def output_text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [output_text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(reasoning: str | None, content: str | None, calls: list[dict],
                 incomplete: bool) -> list[dict]:
    """A finished chat message -> output items (`calls` in chat's `tool_calls` shape).
    Only the last item can be cut by the limit: the ones before it were finished (as the
    stream reports them)."""
    items = []
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning))
    if content or not (calls or reasoning):
        items.append(message_item(new_id("msg"), content or ""))
    for call in calls:
        fn = call["function"]
        items.append(function_call_item(new_id("fc"), call["id"], fn["name"], fn["arguments"]))
    if incomplete:
        items[-1]["status"] = "incomplete"
    return items


def usage(input_tokens: int, output_tokens: int, cached_tokens: int,
          reasoning_tokens: int) -> dict:
    # cache_write_tokens (required by OpenAI's schema) counts writes to an explicit,
    # billed cache with a retention; the prefix cache here has none.
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def status_of(finish_reason: str | None) -> tuple[str, dict | None]:
    """(status, incomplete_details) for the engine's finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def response_body(resp_id: str, created_at: int, model: str, req: ResponsesRequest,
                  params, *, status: str, output: list[dict], usage: dict | None,
                  incomplete_details: dict | None = None) -> dict:
    """The `response` object, with the request's settings echoed."""
    text = dict(req.text or {})
    text["format"] = text.get("format") or {"type": "text"}
    reasoning = {"effort": (req.reasoning or {}).get("effort"), "summary": None}
    return {
        "id": resp_id, "object": "response", "created_at": created_at, "status": status,
        "background": False, "error": None, "incomplete_details": incomplete_details,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None, "model": model, "output": output,
        "parallel_tool_calls": True if req.parallel_tool_calls is None
        else req.parallel_tool_calls,
        "previous_response_id": None, "prompt": None, "reasoning": reasoning,
        "service_tier": "default", "store": False, "temperature": params.temperature,
        "text": text, "tool_choice": req.tool_choice if req.tool_choice is not None
        else "auto", "tools": req.tools or [], "top_logprobs": 0, "top_p": params.top_p,
        "truncation": "disabled", "usage": usage, "user": req.user,
        "metadata": req.metadata or {},
    }
