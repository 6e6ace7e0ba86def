"""`mistral`: `[TOOL_CALLS]` calls, in both formats Mistral's tokenizers have used.

From mistral-common's decoder (`mistral_common/tokens/tokenizers/tools.py`) and vLLM's
parser:

- tokenizers v2-v7 (Mistral-7B-Instruct-v0.3, Mixtral-8x22B, Nemo): one `[TOOL_CALLS]`
  then a JSON list, `[TOOL_CALLS][{"name": "f", "arguments": {...}}, {...}]`;
- v11+ (Mistral-Small-3.1+, Magistral, Ministral 3): one `[TOOL_CALLS]` per call,
  `[TOOL_CALLS]f[ARGS]{...}`, or `[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{...}` with the
  model's own call id; decoded without special tokens `[ARGS]` disappears and the
  name runs straight into the arguments, `[TOOL_CALLS]f{...}` (also accepted).

Which one is told apart by what follows `[TOOL_CALLS]`: a `[` opens the list format.
Call ids are 9 alphanumerics (a model-given `[CALL_ID]`/`"id"` is kept): Mistral's chat
templates refuse any other id when the call comes back in the history. `[TOOL_CALLS]`
is a control token: the server must decode with special tokens kept.
"""

from __future__ import annotations

import string

from pagefleet.server.api.tool_parsers.base import ToolParser
from pagefleet.server.api.tool_parsers.calllist import CallList
from pagefleet.server.api.tool_parsers.jsonscan import Scan, ValueScanner, skip_ws, tag_prefix_at
from pagefleet.server.api.tool_parsers.types import IdFactory, mistral_call_id

NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-.")
ID_CHARS = frozenset(string.ascii_letters + string.digits)


class MistralToolParser(ToolParser):
    name = "mistral"
    BOT, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    tags = (BOT, ARGS, CALL_ID)
    new_id = staticmethod(mistral_call_id)

    def __init__(self, id_factory: IdFactory | None = None) -> None:
        super().__init__(id_factory)
        self.state = "text"
        self.list: CallList | None = None
        self.value: ValueScanner | None = None
        self.fn_name = ""
        self.call_id: str | None = None

    def _step(self, final: bool) -> bool:
        st = self.state
        if st == "text":
            if self._scan_text(self.BOT, final):
                self.state = "bot"
                return True
            return False
        if st == "list":
            assert self.list is not None
            status = self.list.step(final)
            if status is Scan.MORE:
                return False
            self.state = "text"
            return True
        if st == "args":
            return self._args_step(final)
        if st in ("name", "call_id"):
            return self._word_step(final)
        i = skip_ws(self.buf, self.pos)
        if i >= len(self.buf):
            if not final:
                if st != "after":                # whitespace after a call may be content
                    self.pos = i
                return False
            if st != "after":
                self._fail_block(i)
            self.pos, self.state = i, "text"
            return True
        c = self.buf[i]
        if st == "bot":                          # just after [TOOL_CALLS]
            if c == "[":
                self.list = CallList(self, stop=self.BOT)
                self.pos, self.state = i + 1, "list"
            elif c in NAME_CHARS:
                self.fn_name, self.call_id = "", None
                self.pos, self.state = i, "name"
            else:
                self._fail_block(i)
                self.state = "text"
            return True
        if st == "sep":                          # after the name or the call id
            return self._sep_step(i, final)
        # "after" a v11 call: another [TOOL_CALLS], or the rest is content.
        at = tag_prefix_at(self.buf, i, self.BOT)
        if at is Scan.MORE and not final:
            return False
        if at is Scan.DONE:
            self.hold, self.pos, self.state = i, i + len(self.BOT), "bot"
        else:
            self.state = "text"                  # its whitespace included: content
        return True

    def _word_step(self, final: bool) -> bool:
        """The function name, or the [CALL_ID] value, up to the next separator."""
        chars = NAME_CHARS if self.state == "name" else ID_CHARS
        buf, i = self.buf, self.pos
        while i < len(buf) and buf[i] in chars:
            i += 1
        word = buf[self.pos:i]
        if self.state == "name":
            self.fn_name += word
        else:
            self.call_id = (self.call_id or "") + word
        self.pos = i
        if i >= len(buf) and not final:
            return False
        self.state = "sep"
        return True

    def _sep_step(self, i: int, final: bool) -> bool:
        buf = self.buf
        if buf[i] == "{" and self.fn_name:
            self._start_call(self.fn_name, self.call_id)
            self.hold = None
            self.value = ValueScanner(self.BOT)
            self.pos, self.state = i, "args"
            return True
        for tag in (self.ARGS, self.CALL_ID):
            at = tag_prefix_at(buf, i, tag)
            if at is Scan.MORE and not final:
                self.pos = i
                return False
            if at is Scan.DONE and self.fn_name:
                if tag == self.CALL_ID and self.call_id is None:
                    self.pos, self.state = i + len(tag), "call_id"
                    self.call_id = ""
                    return True
                if tag == self.ARGS:
                    self.pos = i + len(tag)       # stays in "sep": `{` comes next
                    return True
        self._fail_block(i)                      # `[TOOL_CALLS]f x`: not a call
        self.state = "text"
        return True

    def _args_step(self, final: bool) -> bool:
        assert self.value is not None
        status, j = self.value.scan(self.buf, self.pos, final)
        self._args(self.buf[self.pos:j])
        self.pos = j
        if status is Scan.MORE:
            return False
        self._end_call(closed=True)
        self.value, self.state = None, "after"
        return True
