"""Reasoning parsers: `<think>…</think>` -> `reasoning_content` apart from `content`.

`--reasoning-parser NAME` picks one (`get_reasoning_parser(NAME)`); build one per
choice, with the rendered prompt so it knows whether the output starts inside the
reasoning:

    parser = get_reasoning_parser("qwen3")(prompt=prompt_text)
    for text in deltas:
        delta = parser.feed(text)      # ReasoningDelta | None -> delta.to_openai()
    delta = parser.finish()
    reasoning, content = parser.result()   # == Parser.split(full_text, prompt=prompt_text)

Tool-call parsing and structured output apply to the content part only: feed the
content deltas to the tool parser. The server decides where the output starts once
(`Parser.starts_in_reasoning(prompt)`), builds the splitter with `in_reasoning=` that
answer and gives the engine the same answer in token ids (`think_token_ids(...)`:
`reasoning_end_token_id`, plus `reasoning_start_token_id` when starting outside), so
its grammar holds exactly what the splitter calls content; `ReasoningBoundary` is the
token-space statement of that rule.
"""

from __future__ import annotations

from pagefleet.server.api.reasoning.base import (
    REASONING_FIELDS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningDelta,
    ReasoningParser,
)
from pagefleet.server.api.reasoning.tokens import (
    ReasoningBoundary,
    ReasoningConfigError,
    ThinkTokenIds,
    content_start,
    think_token_ids,
)

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser.name: Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as `name` (ValueError listing the choices if unknown)."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None


__all__ = [
    "REASONING_FIELDS", "REASONING_PARSERS", "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser", "ReasoningBoundary", "ReasoningConfigError", "ReasoningDelta",
    "ReasoningParser", "ThinkTokenIds", "content_start", "get_reasoning_parser",
    "think_token_ids",
]
