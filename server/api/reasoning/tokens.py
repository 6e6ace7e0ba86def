"""Where reasoning ends in token space, for the engine.

Structured output (a JSON schema, a regex, a forced tool call) must hold the answer
only, not the thinking before it. The engine core sees token ids, not text, so it
needs the boundary in ids: the `</think>` token, one id in every tokenizer that
reasoning models ship (`<think>`/`</think>` are added tokens in Qwen3's and
DeepSeek-R1's). `ReasoningBoundary` follows the same rules as the text splitter:

- output starting inside the reasoning: content starts after the first `</think>`;
- output starting outside: if its first token is `<think>`, as above; any other
  first token means there is no reasoning and content starts at 0.

In the second case the first token is undecided while a grammar is active: the
engine allows `<think>` (`first_token_extra()`) next to the grammar's tokens for the
first step, so a model that wants to think can, and one that does not starts the
answer under the grammar at once. The engine core cannot import this module; its
`StructuredState` (with `reasoning_start_token_id`) implements the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagefleet.server.api.reasoning.base import ReasoningParser


class ReasoningConfigError(ValueError):
    """The tokenizer cannot support the reasoning parser (a startup error)."""


@dataclass(frozen=True)
class ThinkTokenIds:
    start: int | None
    end: int

    def prompt_opens_reasoning(self, prompt_ids: Sequence[int]) -> bool:
        """The last think tag in the prompt is `<think>`: the output starts inside."""
        for tid in reversed(prompt_ids):
            if tid == self.end:
                return False
            if tid == self.start:
                return True
        return False


def _single_id(tokenizer, tag: str) -> int | None:
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def think_token_ids(parser: type[ReasoningParser], tokenizer) -> ThinkTokenIds:
    """The ids of the parser's tags; ReasoningConfigError if `</think>` is not one token."""
    end = _single_id(tokenizer, parser.end_tag)
    if end is None:
        raise ReasoningConfigError(
            f"--reasoning-parser {parser.name}: the tokenizer has no single token for "
            f"{parser.end_tag!r}, so the end of the reasoning cannot be found in token "
            "space; use a tokenizer that has it as an added token (Qwen3's and "
            "DeepSeek-R1's do), or drop --reasoning-parser")
    return ThinkTokenIds(_single_id(tokenizer, parser.start_tag), end)


class ReasoningBoundary:
    """Fed the output's token ids as they are sampled; knows where content starts."""

    def __init__(self, ids: ThinkTokenIds, in_reasoning: bool) -> None:
        self.ids = ids
        self.state = "reasoning" if in_reasoning else "start"
        self.seen = 0
        self.content_start: int | None = None

    @property
    def ended(self) -> bool:
        return self.content_start is not None

    def first_token_extra(self) -> int | None:
        """While undecided (output starting outside, nothing sampled yet): `<think>`'s id."""
        return self.ids.start if self.state == "start" else None

    def feed(self, token_ids: Sequence[int]) -> int | None:
        """Add sampled ids; returns the content's start offset in the output once known."""
        for tid in token_ids:
            if self.content_start is not None:
                break
            if self.state == "start":
                if self.ids.start is not None and tid == self.ids.start:
                    self.state = "reasoning"
                else:
                    self.state, self.content_start = "content", self.seen
            elif tid == self.ids.end:
                self.state, self.content_start = "content", self.seen + 1
            self.seen += 1
        return self.content_start


def content_start(token_ids: Sequence[int], ids: ThinkTokenIds, in_reasoning: bool) -> int | None:
    """Offset where content starts in a whole output (None: still reasoning)."""
    return ReasoningBoundary(ids, in_reasoning).feed(token_ids)
