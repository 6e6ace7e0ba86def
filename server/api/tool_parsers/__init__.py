"""Tool-call parsers: model text -> OpenAI `tool_calls`, whole or streamed.

`--tool-call-parser NAME` picks one (`get_tool_parser(NAME)`); a new parser is built
for every choice of every request (they hold the stream's state):

    parser = get_tool_parser("hermes")()
    for text in deltas:                     # detokenized model output, any chunking
        delta = parser.feed(text)           # DeltaMessage | None -> delta.to_openai()
    delta = parser.finish()
    content, calls = parser.result()        # == get_tool_parser("hermes").extract(full)

`tool_choice="required"` / a named function use `RequiredToolParser` /
`NamedToolParser(name)` instead, on output forced by `schema.plan_tool_choice`'s schema.
The formats and the rules are in docs/tools_and_reasoning.md.
"""

from __future__ import annotations

from pagefleet.server.api.tool_parsers.base import ToolParser
from pagefleet.server.api.tool_parsers.forced import NamedToolParser, RequiredToolParser
from pagefleet.server.api.tool_parsers.hermes import HermesToolParser
from pagefleet.server.api.tool_parsers.llama3_json import Llama3JsonToolParser
from pagefleet.server.api.tool_parsers.mistral import MistralToolParser
from pagefleet.server.api.tool_parsers.schema import (
    FunctionTool,
    ToolChoiceError,
    ToolChoicePlan,
    parse_tools,
    plan_tool_choice,
)
from pagefleet.server.api.tool_parsers.types import (
    DeltaMessage,
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
    MistralToolParser.name: MistralToolParser,
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name` (ValueError listing the choices if unknown)."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose from "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None


def parser_for_plan(plan: ToolChoicePlan, parser_name: str | None) -> ToolParser | None:
    """A fresh parser for one choice: None when tool calls are off (`tool_choice` none).

    Forced calls (`required`, named) parse the forced JSON whatever the model's format,
    but take their ids from the model's parser, so Mistral gets its 9-character ids.
    """
    if plan.mode == "none":
        return None
    native = get_tool_parser(parser_name) if parser_name is not None else None
    ids = native.new_id if native is not None else None    # Mistral needs its own id shape
    if plan.mode == "required":
        return RequiredToolParser(id_factory=ids)
    if plan.mode == "named":
        assert plan.function is not None
        return NamedToolParser(plan.function.name, id_factory=ids)
    if native is None:
        raise ValueError("tool_choice 'auto' needs a --tool-call-parser")
    parser = native()
    if not plan.parallel_tool_calls:
        parser.max_calls = 1
    return parser


__all__ = [
    "TOOL_PARSERS", "DeltaMessage", "ExtractedToolCalls", "FunctionTool",
    "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser", "NamedToolParser",
    "RequiredToolParser", "ToolCall", "ToolCallDelta", "ToolChoiceError", "ToolChoicePlan",
    "ToolParser", "get_tool_parser", "parse_tools", "parser_for_plan", "plan_tool_choice",
]
