"""Tool calls and streamed deltas, and their OpenAI wire shapes.

Non-streamed: `message.tool_calls = [{"id", "type": "function", "function": {"name",
"arguments"}}]` with `arguments` a JSON-encoded string. Streamed: each chunk's
`delta.tool_calls` holds `{"index", "id", "type", "function": {"name", "arguments"}}`
on the first piece of a call and `{"index", "function": {"arguments"}}` after it;
clients concatenate `arguments` per `index`.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field

_ALNUM = string.ascii_letters + string.digits

IdFactory = Callable[[], str]


def openai_call_id() -> str:
    """`call_` and 24 random alphanumerics, the shape OpenAI's ids have."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def mistral_call_id() -> str:
    """9 random alphanumerics: Mistral's chat templates reject any other tool-call id."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass
class ToolCall:
    """One parsed call; `arguments` is the model's JSON text for the arguments object."""
    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """A piece of call `index`: the first carries `id` and `name`, later ones arguments."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        out: dict = {"index": self.index}
        function: dict = {}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        function["arguments"] = self.arguments
        out["function"] = function
        return out


@dataclass
class DeltaMessage:
    """What one fed chunk of model text adds to the message: content and/or call pieces."""
    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def to_openai(self) -> dict:
        """The chunk's `delta` object (without `role`, which the server adds once)."""
        out: dict = {}
        if self.content is not None:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = [d.to_openai() for d in self.tool_calls]
        return out


@dataclass
class ExtractedToolCalls:
    """A whole message parsed: `content` is None when it is empty and a call was made."""
    content: str | None
    tool_calls: list[ToolCall]

    def __iter__(self):          # `content, calls = parser.extract(text)`
        return iter((self.content, self.tool_calls))
