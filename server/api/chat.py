"""Chat prompts: template loading, rendering messages, and chat logprobs.

The prompt text comes from `tokenizer.apply_chat_template(..., tokenize=False)` and is
then encoded with `add_special_tokens=False` by default, because the template already
wrote the special tokens (encoding with them would add a second BOS on Llama-style
tokenizers). This is vLLM's behaviour too.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pagefleet.server.api.errors import bad_request
from pagefleet.server.config import ConfigError


def load_chat_template(arg: str | None) -> str | None:
    """`--chat-template`: a file path or an inline Jinja template (vLLM's rule)."""
    if arg is None:
        return None
    if os.path.isfile(arg):
        with open(arg, encoding="utf-8") as fh:
            return fh.read()
    if any(mark in arg for mark in ("{{", "{%")):
        return arg.replace("\\n", "\n")    # shells hand inline templates over with literal \n
    raise ConfigError(f"--chat-template {arg!r}: no such file, and it is not an inline "
                      "Jinja template")


def message_text(content: Any, index: int) -> str:
    """A message's content as text: a string, or the text parts of a parts list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        where = f"messages.{index}.content.{j}"
        if part.get("type") != "text":
            raise bad_request(f"{where}: only text content parts are supported, got type "
                              f"{part.get('type')!r}", f"messages.{index}.content")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.text: a text part needs its text as a string",
                              f"{where}.text")
        parts.append(part["text"])
    return "\n".join(parts)


# apply_chat_template's own arguments (and the variables it derives from them).
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "chat_template",
                                       "return_dict", "return_tensors", "tokenizer",
                                       "tokenizer_kwargs", "padding", "truncation", "max_length",
                                       "return_assistant_tokens_mask"})


def _tool_calls_for_template(calls: Any, index: int) -> Any:
    """An assistant message's `tool_calls` as chat templates expect them, the way vLLM's
    `chat_utils._postprocess_messages` makes them: each `function.arguments` JSON string
    parsed into its value (a dict), an empty or missing one as `{}`. OpenAI clients send
    arguments as a string; Llama 3.1's (`arguments | tojson`) and Qwen3-Coder's
    (`arguments | items`) templates read a mapping, as Transformers documents. Arguments
    that are not JSON are a 400 naming them (vLLM's json.loads fails the request too)."""
    if not isinstance(calls, list):
        return calls
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            out.append(call)
            continue
        args = fn.get("arguments")
        if not args:
            args = {}
        elif isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError) as e:     # RecursionError: too deep
                where = f"messages.{index}.tool_calls.{j}.function.arguments"
                raise bad_request(f"{where}: not valid JSON ({e}); a tool call's arguments "
                                  "must be a JSON object, sent as a string", where) from None
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def render_chat(tokenizer, messages: list, *, template: str | None,
                add_generation_prompt: bool, continue_final_message: bool,
                kwargs: dict | None = None, documents: list | None = None) -> str:
    """Messages -> prompt text with the chat template; template errors become 400s.
    `kwargs` (the request's chat_template_kwargs) may set add_generation_prompt and
    continue_final_message, as in vLLM; they cannot replace what the renderer itself
    passes (the messages, the template, tokenize). `documents` (the request's, for RAG
    templates) go to the template as `documents`, as vLLM passes them."""
    kwargs = dict(kwargs or {})
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise bad_request(f"chat_template_kwargs: {reserved[0]!r} cannot be set here",
                          "chat_template_kwargs")
    add_generation_prompt = bool(kwargs.pop("add_generation_prompt", add_generation_prompt))
    continue_final_message = bool(kwargs.pop("continue_final_message", continue_final_message))
    if add_generation_prompt and continue_final_message:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be "
                          "true", "continue_final_message")
    if not messages:
        raise bad_request("messages: must not be empty", "messages")
    if continue_final_message and messages[-1].role != "assistant":
        raise bad_request("continue_final_message needs the last message to be from the "
                          "assistant", "continue_final_message")
    if documents is not None:
        kwargs.setdefault("documents", documents)   # vLLM: chat_template_kwargs win
    conv = []
    for i, m in enumerate(messages):
        d = {k: v for k, v in (m.model_extra or {}).items()}
        d.update(role=m.role, content=message_text(m.content, i))
        if m.name is not None:
            d["name"] = m.name
        if m.role == "assistant" and "tool_calls" in d:
            if isinstance(d["tool_calls"], list) and not d["tool_calls"]:
                del d["tool_calls"]      # vLLM: an empty list keeps the plain assistant path
            else:
                d["tool_calls"] = _tool_calls_for_template(d["tool_calls"], i)
        conv.append(d)
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise bad_request("the model has no chat template; start the server with "
                          "--chat-template, or use /v1/completions", "messages")
    try:
        return tokenizer.apply_chat_template(
            conv, tokenize=False, chat_template=template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **kwargs)
    except Exception as e:  # noqa: BLE001 - jinja raises many types; all mean bad input
        raise bad_request(f"the chat template could not render the messages: {e}",
                          "messages") from e


class LogprobFormatter:
    """Engine logprobs ({token_id: logprob} per token) -> OpenAI chat `logprobs.content`."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def token(self, tid: int) -> str:
        s = self._cache.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid])
            if len(self._cache) < 65536:
                self._cache[tid] = s
        return s

    def entry(self, tid: int, lp: float, as_ids: bool = False) -> dict:
        tok = f"token_id:{tid}" if as_ids else self.token(tid)
        return {"token": tok, "logprob": max(lp, -9999.0), "bytes": list(tok.encode("utf-8"))}

    def content(self, token_ids: list[int], logprobs: list[dict[int, float]], top: int,
                as_ids: bool = False) -> list:
        """`as_ids`: the request's return_tokens_as_token_ids (vLLM's): every token,
        the top ones too, is written `token_id:<id>`, as /v1/completions does."""
        out = []
        for tid, d in zip(token_ids, logprobs):
            e = self.entry(tid, d.get(tid, float("-inf")), as_ids)
            ranked = sorted(d.items(), key=lambda kv: kv[1], reverse=True)[:top]
            e["top_logprobs"] = [self.entry(t, lp, as_ids) for t, lp in ranked]
            out.append(e)
        return out
