"""A JSON list of call objects, `[{"name": ..., "arguments": ...}, ...]`, parsed as it arrives.

Mistral's list format (`[TOOL_CALLS][...]`, tokenizers before v11) and the output
forced by `tool_choice="required"` are this shape. Starts just after the `[`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagefleet.server.api.tool_parsers.envelope import CallEnvelope
from pagefleet.server.api.tool_parsers.jsonscan import Scan, skip_ws

if TYPE_CHECKING:
    from pagefleet.server.api.tool_parsers.base import ToolParser


class CallList:
    """`step` on the parser's buffer: DONE (list over, pos after it), MORE, or ERROR
    (the parser already turned the held text into content and resumes at pos)."""

    def __init__(self, parser: ToolParser, *, args_keys: tuple[str, ...] = ("arguments",),
                 stop: str | None = None) -> None:
        self.p = parser
        self.args_keys = args_keys
        self.stop = stop
        self.state = "first_item"
        self.env: CallEnvelope | None = None

    def step(self, final: bool) -> Scan:
        p = self.p
        while True:
            if self.state == "call":
                assert self.env is not None
                status = p._run_envelope(self.env, final)
                if status is not Scan.DONE:
                    return status
                self.env, self.state = None, "next"
                continue
            i = skip_ws(p.buf, p.pos)
            if i >= len(p.buf):
                if self.state != "next":         # after a call it may become content
                    p.pos = i
                if not final:
                    return Scan.MORE
                if self.state == "next":
                    return Scan.DONE
                p._fail_block(i)
                return Scan.ERROR
            c = p.buf[i]
            if self.state in ("first_item", "item"):
                if c == "{":
                    self.env = CallEnvelope(p, args_keys=self.args_keys, stop=self.stop)
                    p.pos, self.state = i + 1, "call"
                elif c == "]" and self.state == "item":
                    p.hold, p.pos = None, i + 1      # a trailing comma: the list is over
                    return Scan.DONE
                else:                                # `[]`, `[1`, `, x`: not a call
                    p._fail_block(i + 1 if c == "]" else i)
                    return Scan.ERROR
            else:                                    # "next", after a call object
                if c == ",":
                    p.hold, p.pos, self.state = i, i + 1, "item"
                else:                                # `]`, or text: content from here
                    if c == "]":
                        p.pos = i + 1
                    return Scan.DONE
