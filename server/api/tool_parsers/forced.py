"""Parsers for the outputs `tool_choice="required"` and a named `tool_choice` force.

Those outputs are not in the model's own tool format: structured decoding holds them
to a JSON schema (`schema.py`), which is how vLLM does it too, so they parse the same
whatever `--tool-call-parser` says (and need none):

- `required`: a JSON list of calls, `[{"name": "f", "parameters": {...}}, ...]`;
- named function `f`: the output is `f`'s arguments object itself.
"""

from __future__ import annotations

import dataclasses

from pagefleet.server.api.tool_parsers.base import ToolParser
from pagefleet.server.api.tool_parsers.calllist import CallList
from pagefleet.server.api.tool_parsers.jsonscan import WHITESPACE, Scan, skip_ws
from pagefleet.server.api.tool_parsers.types import IdFactory

REQUIRED_ARGS_KEYS = ("parameters", "arguments")


class RequiredToolParser(ToolParser):
    """`[{"name": ..., "parameters": ...}, ...]`; nothing else is content.

    The output is forced JSON, never text for the user: what is not a call (the list's
    `, ` and an unfinished call object when max_tokens cuts the output, `[` alone) is
    dropped, and `content` is always null, as OpenAI's forced calls have it.
    """

    name = "required"

    def _content(self, s: str) -> None:
        pass

    def result(self):
        return dataclasses.replace(super().result(), content=None)

    def __init__(self, id_factory: IdFactory | None = None) -> None:
        super().__init__(id_factory)
        self.state = "start"
        self.list: CallList | None = None
        self.hold = 0

    def _step(self, final: bool) -> bool:
        if self.state == "text":
            self._scan_text(None, final)
            return False
        if self.state == "list":
            assert self.list is not None
            if self.list.step(final) is Scan.MORE:
                return False
            self.state = "text"
            return True
        i = skip_ws(self.buf, self.pos)
        if i >= len(self.buf):
            if final:
                self._fail_block(i)
                self.state = "text"
            return final
        if self.buf[i] == "[":
            self.list = CallList(self, args_keys=REQUIRED_ARGS_KEYS)
            self.pos, self.state = i + 1, "list"
        else:
            self._fail_block(i)
            self.state = "text"
        return True


class NamedToolParser(ToolParser):
    """The whole output is the arguments of one call to `function_name`.

    The call (id and name) is sent with the first piece of text; the arguments are the
    text with surrounding whitespace trimmed.
    """

    name = "named"

    def __init__(self, function_name: str, id_factory: IdFactory | None = None) -> None:
        super().__init__(id_factory)
        self.function_name = function_name
        self._pending_ws = ""
        self._seen_text = False

    def _step(self, final: bool) -> bool:
        if not self._call_open and not self._calls:
            self._start_call(self.function_name)
        text = self.buf[self.pos:]
        self.pos = len(self.buf)
        if not self._seen_text:
            text = text.lstrip(WHITESPACE)
            if not text:
                return False
            self._seen_text = True
        text = self._pending_ws + text
        body = text.rstrip(WHITESPACE)
        self._pending_ws = text[len(body):]
        self._args(body)
        return False

    def finish(self):
        if not self._calls:
            self._start_call(self.function_name)
        return super().finish()

    def _at_end(self) -> None:
        if self._call_open:
            self._end_call(closed=False)
