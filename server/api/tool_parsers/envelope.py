"""One call object, `{"name": "f", "arguments": {...}}`, parsed as its text arrives.

Shared by every JSON-envelope format (hermes, llama3_json, mistral's list format and
the `tool_choice="required"` array). Keys may come in any order and unknown keys
(Llama 3.2 writes `"type": "function"`) are skipped. The call is committed, and its id
and name sent, as soon as the name is known (and, when `need_args` is set, the
arguments key has been seen too: Llama's calls are bare JSON, and `{"name": "Ann"}`
alone is more likely an answer than a call; `only_keys` then also rejects, before the
commit, any key a call object does not have). Arguments seen before the commit are
held and sent with it; after it they stream as they arrive.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagefleet.server.api.tool_parsers.jsonscan import Scan, ValueScanner, scan_string, skip_ws

if TYPE_CHECKING:
    from pagefleet.server.api.tool_parsers.base import ToolParser


class CallEnvelope:
    """Incremental parse of one call object, starting just after its `{`.

    `step` returns (DONE, i) once the object is over (closed, or, after the commit,
    abandoned at a character that cannot continue it, which the caller then reads),
    (MORE, i) when it needs more text, and (ERROR, i) when the text up to i shows that
    this is not a call: the caller then treats its text as content.
    """

    def __init__(self, parser: ToolParser, *, args_keys: tuple[str, ...] = ("arguments",),
                 need_args: bool = False, stop: str | None = None,
                 only_keys: frozenset[str] | None = None) -> None:
        self.p = parser
        self.args_keys = args_keys
        self.need_args = need_args
        self.only_keys = only_keys
        self.stop = stop
        self.state = "first_key"
        self.key: str | None = None
        self.name: str | None = None
        self.call_id: str | None = None
        self.held: list[str] = []
        self.args_seen = False
        self.committed = False
        self.closed = False
        self.value: ValueScanner | None = None
        self.value_is_args = False

    def step(self, buf: str, i: int, final: bool) -> tuple[Scan, int]:
        while True:
            st = self.state
            if st == "in_value":
                assert self.value is not None
                status, j = self.value.scan(buf, i, final)
                if self.value_is_args and j > i:
                    if self.committed:
                        self.p._args(buf[i:j])
                    else:
                        self.held.append(buf[i:j])
                i = j
                if status is Scan.MORE:
                    return Scan.MORE, i
                self.value = None
                self.state = "after_value"
                continue
            i = skip_ws(buf, i)
            if i >= len(buf):
                return (self._bad(i) if final else (Scan.MORE, i))
            c = buf[i]
            if st in ("first_key", "key"):
                if c == "}" and st == "first_key":
                    return self._close(i + 1)
                if c != '"':
                    return self._bad(i)
                status, j, key = scan_string(buf, i, final)
                if status is Scan.MORE:
                    return Scan.MORE, i
                if status is Scan.ERROR:
                    return self._bad(i)
                if self.only_keys is not None and not self.committed \
                        and key not in self.only_keys:
                    return self._bad(j)          # a key no call object has: an answer
                self.key, i, self.state = key, j, "colon"
            elif st == "colon":
                if c != ":":
                    return self._bad(i)
                i, self.state = i + 1, "value"
            elif st == "value":
                result = self._value(buf, i, final)
                if result is not None:
                    return result
                i = self._value_end
            elif st == "after_value":
                if c == ",":
                    i, self.state = i + 1, "key"
                elif c == "}":
                    return self._close(i + 1)
                else:
                    return self._bad(i)

    def _value(self, buf: str, i: int, final: bool) -> tuple[Scan, int] | None:
        """Start the value of self.key at buf[i]; None when it was consumed in place."""
        key = self.key
        is_name = key == "name" and self.name is None
        is_id = (key == "id" and self.call_id is None and not self.committed
                 and buf[i] == '"')
        if is_name or is_id:
            if buf[i] != '"':
                return self._bad(i)
            status, j, value = scan_string(buf, i, final)
            if status is Scan.MORE:
                return Scan.MORE, i
            if status is Scan.ERROR or (is_name and not value):
                return self._bad(i)
            if is_name:
                self.name = value
            else:
                self.call_id = value or None
            self._value_end, self.state = j, "after_value"
            self._maybe_commit()
            return None
        self.value_is_args = key in self.args_keys and not self.args_seen
        if self.value_is_args:
            self.args_seen = True
            self._maybe_commit()
        self.value = ValueScanner(self.stop)
        self._value_end, self.state = i, "in_value"
        return None

    def _maybe_commit(self) -> None:
        if self.committed or self.name is None or (self.need_args and not self.args_seen):
            return
        self.committed = True
        self.p._start_call(self.name, self.call_id)
        if self.held:
            self.p._args("".join(self.held))
            self.held = []

    def _close(self, j: int) -> tuple[Scan, int]:
        if not self.committed:
            return Scan.ERROR, j
        self.closed = True
        return Scan.DONE, j

    def _bad(self, i: int) -> tuple[Scan, int]:
        return (Scan.DONE, i) if self.committed else (Scan.ERROR, i)

    def end(self) -> None:
        """Close the committed call (`{}` arguments if it closed without any)."""
        self.p._end_call(closed=self.closed and not self.args_seen)
