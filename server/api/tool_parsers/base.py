"""The streaming machine every tool parser is built on, and `extract` as its one-shot use.

A parser is fed the model's text in whatever pieces the detokenizer produces and
answers each piece with what it adds to the message (content, a new call's id and
name, more of a call's arguments). It decides only on text it has seen and holds back
what is still undecided (a `<` that may open a tag, a call object whose name has not
arrived yet, trailing whitespace that may turn out to border a call). `extract(text)`
is the same machine fed the whole text once, so a stream cut at any points reassembles
into exactly the non-streamed message: same content, same names, same arguments.

Rules shared by all formats:
- a call counts once its header parses (e.g. `<tool_call>{"name": "f"`); text that
  fails before that point is content, verbatim, tags included;
- after that, its arguments are the model's text of the arguments value, found by
  string-aware bracket matching and not validated (OpenAI's own arguments can be
  invalid or cut short, e.g. at `max_tokens`); a call object that closes without an
  arguments key gets `{}`;
- all text outside calls is content, except whitespace between a call and the start
  or the end of the message. With no call found, content is the text, unchanged.
"""

from __future__ import annotations

from typing import ClassVar

from pagefleet.server.api.tool_parsers.envelope import CallEnvelope
from pagefleet.server.api.tool_parsers.jsonscan import WHITESPACE, Scan, partial_suffix
from pagefleet.server.api.tool_parsers.types import (
    DeltaMessage,
    ExtractedToolCalls,
    IdFactory,
    ToolCall,
    ToolCallDelta,
    openai_call_id,
)


class ToolParser:
    """Base class: buffer management, emission, feed/finish/extract. Formats override `_step`."""

    name: ClassVar[str] = ""
    # Tags of the format that must survive detokenization: when a tokenizer marks them
    # special, the server must decode with skip_special_tokens=False while tools are on.
    tags: ClassVar[tuple[str, ...]] = ()
    new_id: ClassVar[IdFactory] = staticmethod(openai_call_id)

    def __init__(self, id_factory: IdFactory | None = None) -> None:
        self._ids = id_factory or type(self).new_id
        self.buf = ""
        self.pos = 0                      # first unconsumed character of buf
        self.hold: int | None = None      # start of text held back (may become content)
        self._content_parts: list[str] = []
        self._calls: list[tuple[str, str]] = []     # (id, name) per call
        self._call_args: list[list[str]] = []       # argument pieces per call
        self._out: list[str | ToolCallDelta] = []
        self._ws = ""                     # trailing whitespace of content, not yet sent
        self._after_call = False          # no content since the last call ended
        self._call_open = False
        self._call_has_args = False
        self._finished = False
        # At most this many calls reach the message (`parallel_tool_calls: false`):
        # later ones are still parsed, so their text is not content, but dropped.
        self.max_calls: int | None = None

    # -- public API ---------------------------------------------------------------------
    def feed(self, text: str) -> DeltaMessage | None:
        """Add model text; returns what it contributes to the message (None if nothing yet)."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if text:
            self.buf += text
            self._run(final=False)
            self._compact()
        return self._take()

    def finish(self) -> DeltaMessage | None:
        """End of the output: decide everything held back and close an open call."""
        if self._finished:
            return None
        self._run(final=True)
        self._at_end()
        if self._call_open:
            self._end_call(closed=False)
        if self._ws and not self._after_call:
            self._emit_content(self._ws)
        self._ws = ""
        self._finished = True
        return self._take()

    def result(self) -> ExtractedToolCalls:
        """The message so far: content (None when empty and a call was made) and the calls."""
        content = "".join(self._content_parts)
        calls = [ToolCall(cid, name, "".join(args))
                 for (cid, name), args in zip(self._calls, self._call_args, strict=True)]
        if self.max_calls is not None:
            calls = calls[:self.max_calls]
        return ExtractedToolCalls(content if (content or not calls) else None, calls)

    @classmethod
    def extract(cls, text: str, **kwargs) -> ExtractedToolCalls:
        """Parse a whole model output: `content, calls = Parser.extract(text)`.

        Keyword arguments go to the constructor (`id_factory`, a named parser's
        `function_name`).
        """
        parser = cls(**kwargs)
        parser.feed(text)
        parser.finish()
        return parser.result()

    # -- for formats --------------------------------------------------------------------
    def _step(self, final: bool) -> bool:
        """Advance the format's state machine; False when it needs more text."""
        raise NotImplementedError

    def _at_end(self) -> None:
        """After the final run: turn whatever is still held into content."""
        if self.hold is not None:
            self._content(self.buf[self.hold:])
            self.hold = None
        elif self.pos < len(self.buf):
            self._content(self.buf[self.pos:])
        self.pos = len(self.buf)

    def _run(self, final: bool) -> None:
        while self._step(final):
            pass

    def _fail_block(self, upto: int) -> None:
        """Held text up to `upto` was not a call after all: it is content; resume there."""
        start = self.hold if self.hold is not None else self.pos
        self._content(self.buf[start:upto])
        self.hold = None
        self.pos = upto

    def _content(self, s: str) -> None:
        if not s:
            return
        if self._after_call and not self._content_parts:
            s = s.lstrip(WHITESPACE)           # the message starts with a call
            if not s:
                return
        s = self._ws + s
        body = s.rstrip(WHITESPACE)
        self._ws = s[len(body):]             # held: it may end the message before a call
        if body:
            self._emit_content(body)
            self._after_call = False

    def _emit_content(self, s: str) -> None:
        self._content_parts.append(s)
        if self._out and isinstance(self._out[-1], str):
            self._out[-1] += s
        else:
            self._out.append(s)

    def _start_call(self, name: str, call_id: str | None = None) -> None:
        if not self._content_parts:
            self._ws = ""                    # the message starts with a call
        cid = call_id or self._ids()
        self._calls.append((cid, name))
        self._call_args.append([])
        self._out.append(ToolCallDelta(len(self._calls) - 1, cid, name, ""))
        self._call_open = True
        self._call_has_args = False

    def _args(self, s: str) -> None:
        if not s:
            return
        self._call_args[-1].append(s)
        self._call_has_args = True
        last = self._out[-1] if self._out else None
        if isinstance(last, ToolCallDelta) and last.index == len(self._calls) - 1:
            last.arguments += s
        else:
            self._out.append(ToolCallDelta(len(self._calls) - 1, arguments=s))

    def _end_call(self, closed: bool) -> None:
        """Close the open call; one that closed properly without arguments gets `{}`."""
        if closed and not self._call_has_args:
            self._args("{}")
        self._call_open = False
        self._after_call = True

    def _take(self) -> DeltaMessage | None:
        if not self._out:
            return None
        content: list[str] = []
        merged: dict[int, ToolCallDelta] = {}
        for item in self._out:
            if isinstance(item, str):
                content.append(item)
            elif self.max_calls is not None and item.index >= self.max_calls:
                continue
            elif item.index in merged:
                merged[item.index].arguments += item.arguments
            else:
                merged[item.index] = item
        self._out = []
        if not content and not merged:
            return None                      # only dropped calls (max_calls)
        return DeltaMessage("".join(content) if content else None, list(merged.values()))

    def _compact(self) -> None:
        cut = self.pos if self.hold is None else min(self.pos, self.hold)
        if cut:
            self.buf = self.buf[cut:]
            self.pos -= cut
            if self.hold is not None:
                self.hold -= cut

    def _scan_text(self, tag: str | None, final: bool) -> bool:
        """Content until `tag`; True when found (held from the tag, pos after it).

        A suffix that may still grow into the tag is held back until it is decided.
        """
        buf, i = self.buf, self.pos
        k = buf.find(tag, i) if tag else -1
        if k >= 0:
            self._content(buf[i:k])
            self.hold, self.pos = k, k + len(tag)
            return True
        keep = 0 if final or not tag else partial_suffix(buf, tag, i)
        end = len(buf) - keep
        self._content(buf[i:end])
        self.pos = end
        return False

    def _run_envelope(self, env: CallEnvelope, final: bool) -> Scan:
        """Advance a call object at pos: DONE (call ended), MORE, or ERROR (made content)."""
        status, j = env.step(self.buf, self.pos, final)
        if env.committed:
            self.hold = None                 # the header is consumed, not content
        if status is Scan.ERROR:
            self._fail_block(j)
            return status
        self.pos = j
        if status is Scan.DONE:
            env.end()
        return status
