"""Incremental detokenization and stop strings.

Decoding the whole output every step is quadratic; decoding token by token breaks
multi-byte characters and merges. So each request keeps two offsets into its output
ids (vLLM's approach): the text of ids[prefix:read] is known, the text of ids[prefix:]
is decoded, and only the difference is new. A trailing U+FFFD means a character is not
complete yet; it waits for the next token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Prompt tokens decoded as context before the output, so that the first output token
# keeps the leading space a SentencePiece tokenizer gives it only mid-text.
PROMPT_CONTEXT_TOKENS = 5


@dataclass
class DetokState:
    """Decoding position over `context + output ids` (context: the prompt's tail)."""

    context: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    @classmethod
    def for_prompt(cls, prompt_ids: list[int]) -> "DetokState":
        ctx = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        return cls(context=ctx, prefix_offset=0, read_offset=len(ctx))


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.vocab_len = len(tokenizer)

    def _decode(self, ids: list[int], skip: bool) -> str:
        ids = [i for i in ids if i < self.vocab_len]
        return self.tokenizer.decode(ids, skip_special_tokens=skip,
                                     clean_up_tokenization_spaces=False)

    def step(self, state: DetokState, output_ids: list[int], skip: bool | None = None) -> str:
        """Account for the newest ids; return the new text (possibly empty)."""
        skip = self.skip if skip is None else skip
        n_ctx, p, r = len(state.context), state.prefix_offset, state.read_offset
        # ids = context + output_ids, sliced without building the whole list
        head = state.context[p:] if p < n_ctx else []
        tail_from = max(p - n_ctx, 0)
        prefix_text = self._decode(head + output_ids[tail_from:r - n_ctx], skip)
        full_text = self._decode(head + output_ids[tail_from:], skip)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            new = full_text[len(prefix_text):]
            state.prefix_offset = state.read_offset
            state.read_offset = n_ctx + len(output_ids)
            state.text += new
            return new
        return ""


def find_stop(text: str, stop_strings: tuple[str, ...], start: int) -> tuple[int, str] | None:
    """First stop string occurring in text at or after `start` (earliest wins)."""
    best: tuple[int, str] | None = None
    for s in stop_strings:
        i = text.find(s, max(0, start))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best
