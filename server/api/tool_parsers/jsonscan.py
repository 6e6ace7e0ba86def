"""Incremental JSON scanning for tool-call parsers: strings, and values found by bracket matching.

A streaming parser sees the model's text a few characters at a time, so every scanner
here answers one of three things about the text it has: "done, up to here", "not
decided yet, give me more" or "this is not JSON". It never decides on something it
has not seen, which is what makes a stream cut at any point reassemble into the same
result as the whole text parsed at once.

Argument values are delimited by string-aware bracket matching (`ValueScanner`), not
validated: once a call is recognised its arguments are the model's text as written,
invalid JSON included, as OpenAI returns them (its docs tell clients to validate).
"""

from __future__ import annotations

import json
import re
from enum import Enum

WHITESPACE = " \t\n\r"

# A complete JSON string, and a string cut short (a valid prefix of one).
_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"')
_STRING_PREFIX = re.compile(
    r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*(?:\\(?:u[0-9a-fA-F]{0,3})?)?\Z')


class Scan(Enum):
    """What a scanner knows after looking at the text it was given."""
    DONE = "done"
    MORE = "more"        # a valid prefix: the answer depends on text not seen yet
    ERROR = "error"      # not what was expected, whatever comes next


def skip_ws(buf: str, i: int) -> int:
    """Index of the first non-whitespace character at or after i (len(buf) if none)."""
    n = len(buf)
    while i < n and buf[i] in WHITESPACE:
        i += 1
    return i


def scan_string(buf: str, i: int, final: bool) -> tuple[Scan, int, str | None]:
    """A strict JSON string starting at buf[i] == '"': (DONE, end, value) or MORE/ERROR."""
    m = _STRING.match(buf, i)
    if m:
        return Scan.DONE, m.end(), json.loads(m.group())
    if not final and _STRING_PREFIX.match(buf, i):
        return Scan.MORE, i, None
    return Scan.ERROR, i, None


def tag_prefix_at(buf: str, i: int, tag: str) -> Scan:
    """DONE if `tag` starts at i, MORE if buf[i:] is a proper prefix of it, else ERROR."""
    if buf.startswith(tag, i):
        return Scan.DONE
    rest = buf[i:]
    if len(rest) < len(tag) and tag.startswith(rest):
        return Scan.MORE
    return Scan.ERROR


def partial_suffix(buf: str, tag: str, start: int = 0) -> int:
    """Length of the longest suffix of buf[start:] that is a proper prefix of `tag`.

    That suffix could still become the tag, so a streaming parser holds it back.
    """
    k = min(len(tag) - 1, len(buf) - start)
    first = tag[0]
    while k > 0:
        j = len(buf) - k
        if buf[j] == first and tag.startswith(buf[j:]):
            return k
        k -= 1
    return 0


class ValueScanner:
    """Finds where one JSON value ends, fed text piece by piece; no validation.

    Objects and arrays end at the bracket that returns the depth to zero (brackets
    inside strings do not count), strings at their closing quote, bare scalars
    (numbers, true/false/null, or anything else a model writes) at the first
    whitespace or `,` `}` `]`. A `stop` tag met outside a string (a parser's end tag,
    such as `</tool_call>`) ends the value early: the model closed the call without
    closing its JSON, and the value is then cut there.
    """

    def __init__(self, stop: str | None = None) -> None:
        self.stop = stop
        self.depth = 0
        self.kind: str | None = None      # "nest", "string" or "scalar"
        self.in_string = False
        self.escape = False

    def scan(self, buf: str, i: int, final: bool) -> tuple[Scan, int]:
        """Consume buf[i:]; return (DONE, end) or (MORE, where it stopped)."""
        n = len(buf)
        if self.kind is None:
            if i >= n:
                return (Scan.DONE if final else Scan.MORE), i
            c = buf[i]
            if c in "{[":
                self.kind, self.depth = "nest", 1
            elif c == '"':
                self.kind, self.in_string = "string", True
            else:
                self.kind = "scalar"
                return self._scalar(buf, i, final)
            i += 1
        if self.kind == "scalar":
            return self._scalar(buf, i, final)
        stop = self.stop
        while i < n:
            c = buf[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
                    if self.kind == "string":
                        return Scan.DONE, i + 1
            else:
                if stop is not None and c == stop[0]:
                    at = tag_prefix_at(buf, i, stop)
                    if at is Scan.DONE:
                        return Scan.DONE, i
                    if at is Scan.MORE and not final:
                        return Scan.MORE, i
                if c == '"':
                    self.in_string = True
                elif c in "{[":
                    self.depth += 1
                elif c in "}]":
                    self.depth -= 1
                    if self.depth == 0:
                        return Scan.DONE, i + 1
            i += 1
        return (Scan.DONE if final else Scan.MORE), i

    def _scalar(self, buf: str, i: int, final: bool) -> tuple[Scan, int]:
        n = len(buf)
        stop = self.stop
        while i < n:
            c = buf[i]
            if c in WHITESPACE or c in ",}]":
                return Scan.DONE, i
            if stop is not None and c == stop[0]:
                at = tag_prefix_at(buf, i, stop)
                if at is Scan.DONE:
                    return Scan.DONE, i
                if at is Scan.MORE and not final:
                    return Scan.MORE, i
            i += 1
        return (Scan.DONE if final else Scan.MORE), i
