"""`hermes`: Qwen2.5 / Qwen3 / Hermes-2-Pro calls, `<tool_call>{"name", "arguments"}</tool_call>`.

What the model writes (Qwen2.5's template asks for exactly this, one block per call):

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "CET"}}
    </tool_call>

Text outside the blocks is content. A block whose JSON does not start like a call
object is content, tags and all. `</tool_call>` ends a call even when its JSON is not
closed (the arguments are then cut there); inside a JSON string it is just text.
"""

from __future__ import annotations

from pagefleet.server.api.tool_parsers.base import ToolParser
from pagefleet.server.api.tool_parsers.envelope import CallEnvelope
from pagefleet.server.api.tool_parsers.jsonscan import Scan, skip_ws, tag_prefix_at
from pagefleet.server.api.tool_parsers.types import IdFactory


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    tags = (START, END)

    def __init__(self, id_factory: IdFactory | None = None) -> None:
        super().__init__(id_factory)
        self.state = "text"
        self.env: CallEnvelope | None = None

    def _step(self, final: bool) -> bool:
        if self.state == "text":
            if self._scan_text(self.START, final):
                self.state = "open"
                return True
            return False
        if self.state == "call":
            assert self.env is not None
            status = self._run_envelope(self.env, final)
            if status is Scan.MORE:
                return False
            self.state = "after" if status is Scan.DONE else "text"
            return True
        i = skip_ws(self.buf, self.pos)
        if i >= len(self.buf):
            if not final:
                self.pos = i
                return False
            if self.state == "open":
                self._fail_block(i)
            self.state = "text"
            return True
        if self.state == "open":
            if self.buf[i] == "{":
                self.env = CallEnvelope(self, stop=self.END)
                self.pos, self.state = i + 1, "call"
            else:
                self._fail_block(i)
                self.state = "text"
            return True
        # "after": the call object closed; consume its end tag if it follows.
        at = tag_prefix_at(self.buf, i, self.END)
        if at is Scan.MORE and not final:
            self.pos = i
            return False
        self.pos = i + len(self.END) if at is Scan.DONE else i
        self.state = "text"
        return True
