"""Request body -> what routing needs: model, prompt token ids, max_tokens, priority.

The prompt is rendered and tokenized exactly as `pagefleet serve` does it (the API's
own request models, `render_chat` with the same template, `encode` with the same
special-token rule), so the block hashes computed from it are the ones the engine's
prefix cache stores. The gateway checks only what it needs (the body's shape, the
template, the context fit); everything else (sampling fields, `n`, ...) is the
servers' to validate, and their 400 comes back unchanged.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from pagefleet.server.api.chat import render_chat
from pagefleet.server.api.errors import APIError
from pagefleet.server.api.protocol import ChatCompletionRequest, CompletionRequest
from pagefleet.server.api.responses_input import to_chat_request
from pagefleet.server.api.responses_protocol import ResponsesRequest

log = logging.getLogger("pagefleet.gateway")

KINDS = {"chat": ChatCompletionRequest, "completion": CompletionRequest,
         "responses": ResponsesRequest}


@dataclass
class ParsedRequest:
    kind: str                       # "chat" | "completion" | "responses"
    model: str | None
    stream: bool
    max_tokens: int | None
    priority: int | None            # None: the body does not set it
    body: Any                       # the validated request model (responses: the chat
                                    # request it maps onto, as the server maps it)


def _field_error(e: ValidationError) -> APIError:
    errs = e.errors()
    first = errs[0] if errs else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg', '')}")
    # Drop pydantic's union-branch names ('str', 'list[int]', ...) from the location.
    loc = [str(p) for p in first.get("loc", ())
           if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool")))]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    return APIError(400, f"{param}: {msg}" if param else msg, param)


def parse_request(kind: str, raw: bytes) -> ParsedRequest:
    """Validate the body with the server's request model; failures are 400s."""
    if not raw.strip():
        raise APIError(400, "the request body is empty; expected a JSON object")
    try:
        req = KINDS[kind].model_validate_json(raw)
    except ValidationError as e:
        raise _field_error(e) from None
    if kind == "responses":
        # The server serves /v1/responses as this chat request: the same messages, so
        # the same rendered prompt and block hashes. Fields it refuses are 400s here too.
        priority = req.priority if "priority" in req.model_fields_set else None
        return ParsedRequest(kind, req.model, req.stream, req.max_output_tokens, priority,
                             to_chat_request(req))
    if kind == "chat":
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
    else:
        max_tokens = req.max_tokens
    priority = req.priority if "priority" in req.model_fields_set else None
    return ParsedRequest(kind, req.model, req.stream, max_tokens, priority, req)


def resolve_chat_template(value: str | None) -> str | None:
    """A file path or an inline Jinja template (the server's --chat-template rule)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as fh:
            return fh.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template {value!r}: no such file, and not an inline template")


class PromptTokenizer:
    """One model's tokenizer and chat template, as its servers load them."""

    def __init__(self, tokenizer, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def prompts(self, parsed: ParsedRequest) -> list[list[int]]:
        """Token ids of each prompt (one for chat; completions may batch several)."""
        req = parsed.body
        if parsed.kind in ("chat", "responses"):
            text = render_chat(self.tokenizer, req.messages, template=self.chat_template,
                               add_generation_prompt=req.add_generation_prompt,
                               continue_final_message=req.continue_final_message,
                               kwargs=req.chat_template_kwargs)
            return [self.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))]
        prompt = req.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        if prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        return [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]


def load_tokenizer(source: str) -> Any:
    """The model's tokenizer (a local directory or a Hub id in the HF cache)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)
