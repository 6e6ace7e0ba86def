"""Splitting `<think>…</think>` reasoning from the answer, whole or streamed.

The parser is a small state machine fed the model's text in any pieces; it holds back
only what is undecided (a suffix that may grow into a tag, whitespace that may border
one), so streamed `reasoning_content` / `content` deltas concatenate into exactly what
`split(text)` returns for the whole text.

Where the output starts matters, and the prompt says it:
- inside the reasoning, when the chat template opened `<think>` in the prompt
  (DeepSeek-R1's and Qwen3-Thinking-2507's templates do): everything up to `</think>`
  is reasoning, and with no `</think>` at all (cut short) the whole output is;
  DeepSeek-R1's parser starts inside also when the prompt has no think tag at all;
- outside it otherwise: the output is reasoning only if its very first characters
  are `<think>` (original Qwen3 with thinking on); if not, it is all content, tags and
  all (Qwen3 with `enable_thinking=False`, whose template closes an empty block in the
  prompt). Not even whitespace may come first: the engine's token-space twin
  (`tokens.ReasoningBoundary`) decides on the first token, and the two must agree.

Whitespace right inside the tags and right after `</think>` is dropped (Qwen's own
template strips it the same way when it renders the history). Empty parts are None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

WHITESPACE = " \t\n\r"
# The reasoning text goes out under both names: `reasoning_content` is DeepSeek's and
# older vLLM's (LiteLLM and the Vercel AI SDK read it), `reasoning` is current vLLM's
# (it dropped `reasoning_content` in 2026, vllm-project/vllm#33402).
REASONING_FIELDS = ("reasoning_content", "reasoning")


@dataclass
class ReasoningDelta:
    reasoning_content: str | None = None
    content: str | None = None

    def to_openai(self) -> dict:
        out: dict = {}
        if self.reasoning_content is not None:
            for name in REASONING_FIELDS:
                out[name] = self.reasoning_content
        if self.content is not None:
            out["content"] = self.content
        return out


def _partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of tag."""
    k = min(len(tag) - 1, len(buf))
    while k > 0:
        if tag.startswith(buf[-k:]):
            return k
        k -= 1
    return 0


class ReasoningParser:
    """`<think>…</think>` splitter; subclasses say where the output starts by default."""

    name: ClassVar[str] = ""
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"

    def __init__(self, *, in_reasoning: bool | None = None, prompt: str | None = None) -> None:
        if in_reasoning is None:
            in_reasoning = self.starts_in_reasoning(prompt)
        self.in_reasoning_at_start = in_reasoning
        self.state = "reasoning_start" if in_reasoning else "start"
        self._start_stripped = False
        self.buf = ""
        self._ws = ""                     # reasoning's trailing whitespace, held
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._out_r: list[str] = []
        self._out_c: list[str] = []
        self._finished = False

    @classmethod
    def starts_in_reasoning(cls, prompt: str | None) -> bool:
        """Does the output start inside a think block? (from the rendered prompt)"""
        if prompt is None:
            return False
        return prompt.rfind(cls.start_tag) > prompt.rfind(cls.end_tag)

    # -- public API ---------------------------------------------------------------------
    def feed(self, text: str) -> ReasoningDelta | None:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if text:
            self.buf += text
            while self._step(final=False):
                pass
        return self._take()

    def finish(self) -> ReasoningDelta | None:
        if self._finished:
            return None
        while self._step(final=True):
            pass
        self._finished = True
        return self._take()

    def result(self) -> tuple[str | None, str | None]:
        """(reasoning_content, content), each None when empty."""
        return "".join(self._reasoning) or None, "".join(self._content) or None

    @property
    def reasoning_ended(self) -> bool:
        """True once the output is past the reasoning (content flows from here)."""
        return self.state in ("content_start", "content")

    @classmethod
    def split(cls, text: str, *, in_reasoning: bool | None = None,
              prompt: str | None = None) -> tuple[str | None, str | None]:
        """A whole output -> (reasoning_content, content)."""
        parser = cls(in_reasoning=in_reasoning, prompt=prompt)
        parser.feed(text)
        parser.finish()
        return parser.result()

    # -- the machine ----------------------------------------------------------------------
    def _step(self, final: bool) -> bool:
        st, buf = self.state, self.buf
        if st == "content":
            self._emit_content(buf)
            self.buf = ""
            return False
        if st in ("start", "reasoning_start", "content_start"):
            # Outside, <think> counts only as the very first thing, as in token space
            # (ReasoningBoundary looks at the first token); inside, whitespace is dropped.
            body = buf if st == "start" else buf.lstrip(WHITESPACE)
            if st == "content_start":
                self.buf = body
                if body:
                    self.state = "content"
                return bool(body)
            if not body:                       # only whitespace so far
                if final:
                    if st == "start":
                        self._emit_content(buf)
                    self.buf = ""
                return False
            if not self._start_stripped and body.startswith(self.start_tag):
                self._start_stripped = True
                self.buf, self.state = body[len(self.start_tag):], "reasoning_start"
                return True
            if not final and not self._start_stripped and self.start_tag.startswith(body):
                return False                   # may still become <think>
            if st == "start":                  # no think block: all content
                self.state = "content"
                return True
            self.buf, self.state = body, "reasoning"
            return True
        # "reasoning"
        k = buf.find(self.end_tag)
        if k >= 0:
            self._emit_reasoning(buf[:k], end=True)
            self.buf, self.state = buf[k + len(self.end_tag):], "content_start"
            return True
        keep = 0 if final else _partial_suffix(buf, self.end_tag)
        self._emit_reasoning(buf[:len(buf) - keep], end=final)
        self.buf = buf[len(buf) - keep:]
        return False

    def _emit_reasoning(self, s: str, end: bool) -> None:
        s = self._ws + s
        body = s.rstrip(WHITESPACE)
        self._ws = "" if end else s[len(body):]
        if body:
            self._reasoning.append(body)
            self._out_r.append(body)

    def _emit_content(self, s: str) -> None:
        if s:
            self._content.append(s)
            self._out_c.append(s)

    def _take(self) -> ReasoningDelta | None:
        if not self._out_r and not self._out_c:
            return None
        delta = ReasoningDelta("".join(self._out_r) or None, "".join(self._out_c) or None)
        self._out_r, self._out_c = [], []
        return delta


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and its distills): the output starts inside the reasoning unless
    the prompt has closed it.

    R1's template ends the prompt with `<think>\\n`; older templates let the model
    write `<think>` itself, which is then stripped. Like vLLM's `deepseek_r1`, an
    output without `</think>` is all reasoning. Unlike vLLM's, a prompt whose last
    think tag is `</think>` (a hybrid template with thinking off writes
    `<think></think>` into the generation prompt; R1's own template strips the
    reasoning from the history) starts outside, as `qwen3` does: the engine then
    holds a structured output's grammar from the first token, and the splitter must
    call that output content.
    """

    name = "deepseek_r1"

    @classmethod
    def starts_in_reasoning(cls, prompt: str | None) -> bool:
        if prompt is None:
            return True
        return prompt.rfind(cls.start_tag) >= prompt.rfind(cls.end_tag)


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning only if the prompt opened `<think>` or the output starts with it.

    Covers the original Qwen3 (the model writes `<think>`), `enable_thinking=False`
    (the template closes an empty block in the prompt: all content) and the 2507
    Thinking models (the template opens `<think>` in the prompt). Without the prompt
    the parser assumes the output starts outside: pass `prompt=` (or `in_reasoning=`).
    """

    name = "qwen3"
