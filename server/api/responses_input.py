"""A Responses API request -> the chat request that serves it.

`/v1/responses` has no engine path of its own: `to_chat_request` turns its
`instructions` and `input` items into chat messages, its flat function tools into chat
tools, `tool_choice`, `text.format` into `response_format` and `reasoning.effort` into
`reasoning_effort`, and the chat path then renders, checks, admits and samples it
exactly as `/v1/chat/completions` would. The gateway uses the same mapping to compute
the prompt ids it routes on.

Input items:
- a string: one user message;
- `{"type": "message"?, "role", "content"}`: content a string or a list of
  `input_text` / `output_text` (/ `refusal`) parts, joined with newlines as chat joins
  text parts; image, file and audio parts are refused (no multimodal models here);
- `{"type": "function_call", "call_id", "name", "arguments"}`: an assistant tool call
  (consecutive calls and a preceding assistant message form one assistant turn);
- `{"type": "function_call_output", "call_id", "output"}`: a `tool` message (its
  `call_id` must be an earlier `function_call`'s, as OpenAI requires);
- `{"type": "reasoning", "content"/"summary"}`: handed to the next assistant turn as
  its `reasoning_content` (templates that keep past reasoning read it; the others
  drop it, as they do on chat).
Anything else (item references, built-in tool calls) is a 400 naming the item.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from pagefleet.server.api import protocol as P
from pagefleet.server.api.errors import APIError, bad_request, to_api_error
from pagefleet.server.api.responses_protocol import (BUILTIN_TOOLS, SAMPLING_PASSTHROUGH,
                                                     ResponsesRequest, refused_field)

TEXT_PARTS = ("input_text", "output_text", "text")
CHAT_EFFORTS = ("minimal", "low", "medium", "high")


def _str(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise bad_request(f"{param}: expected a string", param)
    return value


def _parts_text(content: Any, param: str, *, refusal_ok: bool) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param}: expected a string or a list of content parts", param)
    texts = []
    for j, part in enumerate(content):
        where = f"{param}.{j}"
        if not isinstance(part, dict):
            raise bad_request(f"{where}: expected a content part object", where)
        kind = part.get("type")
        if kind in TEXT_PARTS:
            texts.append(_str(part.get("text"), f"{where}.text"))
        elif kind == "refusal" and refusal_ok:
            texts.append(_str(part.get("refusal"), f"{where}.refusal"))
        else:
            raise bad_request(f"{where}.type: only text content parts (input_text, "
                              f"output_text) are supported, got {kind!r}", f"{where}.type")
    return "\n".join(texts)


def _reasoning_text(item: dict, where: str) -> str:
    pieces = []
    for key in ("content", "summary"):
        parts = item.get(key) or []
        if not isinstance(parts, list):
            raise bad_request(f"{where}.{key}: expected a list of text parts", f"{where}.{key}")
        for j, part in enumerate(parts):
            text = part.get("text") if isinstance(part, dict) else None
            pieces.append(_str(text, f"{where}.{key}.{j}.text"))
        if pieces:
            break
    return "\n".join(pieces)


def _check_arguments(args: str, param: str) -> None:
    """A call's arguments must be a JSON object (templates read them parsed, as chat
    checks them): named here by the input item, not by the chat message it becomes."""
    if not args:
        return
    try:
        value = json.loads(args)
    except (ValueError, RecursionError) as e:     # RecursionError: nested too deep
        raise bad_request(f"{param}: not valid JSON ({e}); a function call's arguments "
                          "must be a JSON object, sent as a string", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param}: must be a JSON object", param)


def input_messages(req: ResponsesRequest) -> list[dict]:
    """`instructions` and `input` -> chat messages (dicts)."""
    messages: list[dict] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        return messages
    if not req.input:
        raise bad_request("input: must not be empty", "input")
    reasoning: str | None = None      # a reasoning item waiting for its assistant turn
    calls: set[str] = set()           # call ids of the function calls so far

    def assistant_turn() -> dict:
        """The assistant message a function call joins: the last one, or a new one."""
        nonlocal reasoning
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and reasoning is None:
            return last
        msg: dict = {"role": "assistant", "content": None}
        if reasoning is not None:
            msg["reasoning_content"], reasoning = reasoning, None
        messages.append(msg)
        return msg

    for i, item in enumerate(req.input):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise bad_request(f"{where}: expected an input item object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role: expected user, system, developer or "
                                  f"assistant, got {role!r}", f"{where}.role")
            text = _parts_text(item.get("content"), f"{where}.content",
                               refusal_ok=role == "assistant")
            msg = {"role": role, "content": text}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            messages.append(msg)
        elif kind == "function_call":
            call_id = _str(item.get("call_id"), f"{where}.call_id")
            name = _str(item.get("name"), f"{where}.name")
            args = _str(item.get("arguments", ""), f"{where}.arguments")
            _check_arguments(args, f"{where}.arguments")
            calls.add(call_id)
            turn = assistant_turn()
            turn.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name,
                                                                 "arguments": args}})
        elif kind == "function_call_output":
            call_id = _str(item.get("call_id"), f"{where}.call_id")
            if call_id not in calls:   # OpenAI's rule and wording; a chat template would
                # render an answer to no call, which the model never saw asked
                raise bad_request(f"{where}.call_id: No tool call found for function call "
                                  f"output with call_id {call_id!r}: the function_call item "
                                  "it answers must come earlier in input", f"{where}.call_id")
            output = _parts_text(item.get("output"), f"{where}.output", refusal_ok=False)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, where)
        elif kind == "item_reference":
            raise bad_request(f"{where}: item references need a response store, which this "
                              "server does not keep; send the item itself", f"{where}.type")
        else:
            raise bad_request(f"{where}.type: input items of type {kind!r} are not supported "
                              "(message, function_call, function_call_output, reasoning "
                              "are)", f"{where}.type")
    return messages


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Flat Responses function tools -> chat tools; built-in tools are refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        kind = tool.get("type")
        if kind != "function":
            what = "built-in tools run on OpenAI's side and are not available here" \
                if isinstance(kind, str) and kind.startswith(BUILTIN_TOOLS) \
                else "only function tools are supported"
            raise bad_request(f"{where}.type: {what}; got {kind!r}", f"{where}.type")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict")
              if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice           # auto / none / required; anything else: chat's 400
    kind = choice.get("type")
    if kind == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad_request(f"tool_choice.type: only 'function' can be named (or the strings "
                      f"auto, none, required); got {kind!r}", "tool_choice.type")


def response_format(text: dict | None) -> dict | None:
    """`text.format` -> chat's `response_format`; `text.verbosity` is refused."""
    if not text:
        return None
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request("text.verbosity: verbosity is not supported", "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format: expected an object", "text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        js = {k: fmt[k] for k in ("name", "schema", "description", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": js}
    raise bad_request(f"text.format.type: expected text, json_object or json_schema, got "
                      f"{kind!r}", "text.format.type")


def reasoning_effort(reasoning: dict | None) -> str | None:
    if not reasoning:
        return None
    if reasoning.get("summary") is not None or reasoning.get("generate_summary") is not None:
        param = "reasoning.summary" if reasoning.get("summary") is not None \
            else "reasoning.generate_summary"
        raise bad_request(f"{param}: reasoning summaries are not supported (the reasoning "
                          "itself is returned as a reasoning item when the server runs "
                          "with --reasoning-parser)", param)
    effort = reasoning.get("effort")
    if effort is not None and effort not in CHAT_EFFORTS:
        raise bad_request(f"reasoning.effort: {effort!r} cannot be honoured; expected one of "
                          f"{', '.join(CHAT_EFFORTS)}", "reasoning.effort")
    return effort


def to_chat_request(req: ResponsesRequest) -> P.ChatCompletionRequest:
    """The chat request that serves `req` (every refused field is a 400 first)."""
    if (refused := refused_field(req)) is not None:
        raise bad_request(f"{refused[0]}: {refused[1]}", refused[0])
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens: must be >= 1, got {req.max_output_tokens}",
                          "max_output_tokens")
    body: dict[str, Any] = {
        "model": req.model, "messages": input_messages(req),
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "seed": req.seed, "stream": req.stream,
        "priority": req.priority, "tools": chat_tools(req.tools),
        "tool_choice": chat_tool_choice(req.tool_choice),
        "response_format": response_format(req.text),
        "reasoning_effort": reasoning_effort(req.reasoning)}
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    body.update({k: getattr(req, k) for k in SAMPLING_PASSTHROUGH if getattr(req, k) is not None})
    try:
        return P.ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None or k == "max_completion_tokens"})
    except ValidationError as e:
        raise to_responses_error(to_api_error(e)) from None


# Chat's names for what a Responses request calls otherwise, for error messages.
_PARAM_NAMES = (("max_completion_tokens", "max_output_tokens"),
                ("response_format.json_schema", "text.format"),
                ("response_format", "text.format"), ("reasoning_effort", "reasoning.effort"),
                ("messages", "input"))


_INPUT_WORDS = (("in the messages", "in the input"), ("length of the messages",
                                                        "length of the input"),
                ("the input messages", "the input"))


def _rename(text: str) -> str:
    for chat, responses in _PARAM_NAMES:
        if text.startswith(chat):
            return responses + text[len(chat):]
    if text.startswith("tool_choice.function."):
        return "tool_choice." + text[len("tool_choice.function."):]
    if text.startswith("tools.") and ".function." in text:
        return text.replace(".function.", ".", 1)
    return text


def to_responses_error(err: APIError) -> APIError:
    """A chat-path error with its field named as the Responses request names it."""
    if not err.param:
        return err
    param = _rename(err.param)
    if param == err.param:
        return err
    message = err.message
    if message.startswith(err.param):
        message = param + message[len(err.param):]
    if param == "input":   # the context-length wording (PromptTooLongError) speaks chat's
        for chat, responses in _INPUT_WORDS:
            message = message.replace(chat, responses)
    return APIError(err.status, message, param, headers=err.headers)
