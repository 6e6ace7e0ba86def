"""Regex escapes that xgrammar would silently misread.

xgrammar's regex converter (ECMAScript-like) refuses what it does not support with an
error (lookaround, backreferences, `\\b`, `\\p{...}`, inline flags), except for one
case: an escaped letter or digit it does not know (`\\Z`, `\\A`, `\\h`, `\\Q`, a digit
inside a class, `\\x` without two hex digits) only logs a warning and matches the
character itself. A Python-style `\\A...\\Z` would then accept a literal "A" and "Z".
Those are refused here (found by probing every letter and digit on xgrammar 0.2.9,
inside and outside a character class).
"""

from __future__ import annotations

import re

KNOWN = frozenset("adefnrstuvwxDSW0")       # taken as escapes, as in ECMAScript
REFUSED_BY_XGRAMMAR = {False: frozenset("bckpBP123456789"),  # outside a class
                       True: frozenset("bc")}                # inside ([\b] is backspace)
_HEX2 = re.compile(r"[0-9A-Fa-f]{2}")


def regex_problem(pattern: str, *, in_schema: bool = False) -> str | None:
    """Why xgrammar would not match `pattern` as written, when it would not say so
    itself; None otherwise. `in_schema`: a JSON Schema `pattern`, where xgrammar also
    drops what it refuses in a bare regex (lookaround, backreferences, `\\b`,
    `\\p{...}`, inline flags) with only a log line, so those are refused here too."""
    i, in_class = 0, False
    while i < len(pattern):
        ch = pattern[i]
        if in_schema and not in_class and pattern.startswith("(?", i) \
                and not pattern.startswith("(?:", i):
            return (f"the group {pattern[i:i + 4]!r}... at position {i} (lookaround, named "
                    "groups and inline flags) is not supported")
        if ch == "\\" and i + 1 < len(pattern):
            esc = pattern[i + 1]
            if in_schema and esc in REFUSED_BY_XGRAMMAR[in_class]:
                return f"the escape \\{esc} at position {i} is not supported"
            if esc.isascii() and esc.isalnum() and esc not in KNOWN \
                    and esc not in REFUSED_BY_XGRAMMAR[in_class]:
                return f"the escape \\{esc} at position {i} is not supported"
            if esc == "x" and not _HEX2.fullmatch(pattern[i + 2:i + 4]):
                return f"\\x at position {i} needs two hex digits"
            i += 2
            continue
        if ch == "[" and not in_class:
            in_class = True
        elif ch == "]" and in_class:
            in_class = False
        i += 1
    return None
