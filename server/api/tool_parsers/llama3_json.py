"""`llama3_json`: Llama 3.1/3.2/3.3 JSON calls, `{"name": ..., "parameters": {...}}`.

What the model writes with the JSON tool-calling template (vLLM's
`tool_chat_template_llama3.1_json.jinja`, Meta's "JSON based tool calling"):

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}
    {"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}

A call is a JSON object at the very start of the output (after whitespace), or right
after `<|python_tag|>` anywhere, and further ones follow separated by `;`. It needs a
`"name"` string and a `"parameters"` (or `"arguments"`) key, and no keys but those,
`"type"` (Llama 3.2 writes `"type": "function"`) and `"id"`. Any other object is
content: a JSON answer such as `{"name": "Ann", "age": 3}` stays an answer. A `{` in the middle of
prose is content too (vLLM's non-streaming parser would take it as a call, its
streaming parser would not; here both modes agree).
"""

from __future__ import annotations

from pagefleet.server.api.tool_parsers.base import ToolParser
from pagefleet.server.api.tool_parsers.envelope import CallEnvelope
from pagefleet.server.api.tool_parsers.jsonscan import Scan, skip_ws, tag_prefix_at
from pagefleet.server.api.tool_parsers.types import IdFactory

ARGS_KEYS = ("parameters", "arguments")
CALL_KEYS = frozenset({"name", "type", "id", *ARGS_KEYS})


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"
    tags = (PYTHON_TAG,)

    def __init__(self, id_factory: IdFactory | None = None) -> None:
        super().__init__(id_factory)
        self.state = "start"
        self.env: CallEnvelope | None = None
        self.hold = 0

    def _step(self, final: bool) -> bool:
        st = self.state
        if st == "text":
            if self._scan_text(self.PYTHON_TAG, final):
                self.state = "open"
                return True
            return False
        if st == "call":
            assert self.env is not None
            status = self._run_envelope(self.env, final)
            if status is Scan.MORE:
                return False
            self.state = "after" if status is Scan.DONE else "text"
            return True
        i = skip_ws(self.buf, self.pos)
        if i >= len(self.buf):
            if not final:
                if st != "after":                # whitespace after a call may be content
                    self.pos = i
                return False
            if st in ("start", "open"):
                self._fail_block(i)
            self.pos, self.state = i, "text"
            return True
        c = self.buf[i]
        if st == "start":
            at = tag_prefix_at(self.buf, i, self.PYTHON_TAG)
            if at is Scan.MORE and not final:
                return False
            if at is Scan.DONE:
                self.pos, self.state = i + len(self.PYTHON_TAG), "open"
            elif c == "{":
                self._open_call(i)
            else:
                self._fail_block(i)      # prose: its leading whitespace is content too
                self.state = "text"
            return True
        if st == "open":                 # after <|python_tag|> or `;`: a call object
            if c == "{":
                self._open_call(i)
            else:
                self._fail_block(i)
                self.state = "text"
            return True
        # "after" a call: `;` and another, or the rest is content.
        if c == ";":
            self.hold, self.pos, self.state = i, i + 1, "open"
        else:
            self.state = "text"                  # its whitespace included: content
        return True

    def _open_call(self, i: int) -> None:
        self.env = CallEnvelope(self, args_keys=ARGS_KEYS, need_args=True, only_keys=CALL_KEYS)
        self.pos, self.state = i + 1, "call"
