"""Schema rewrites that keep xgrammar's output valid JSON where xgrammar itself does not.

xgrammar <= 0.2.9 compiles a string with `minLength`/`maxLength` to a repetition of
`[^"\\\r\n]`: raw control characters (TAB, U+0001, ...) are allowed inside the string,
which no strict JSON parser accepts (Python's `json.loads` raises "Invalid control
character"; reported upstream as mlc-ai/xgrammar#800, fixes still open). Its `pattern`
path does exclude them and counts decoded characters, so a length-bounded string
without a pattern is rewritten as the pattern `^[\\s\\S]{min,max}$`, which means the
same. (Both paths leave escapes such as `\\n` or `\\"` out of bounded strings: valid
JSON, a narrower choice of characters.) Drop this module when xgrammar's length path
is fixed: `test_length_bounded_strings_are_strict_json` shows the difference.
"""

from __future__ import annotations

from typing import Any

_CHILD_MAPS = ("properties", "patternProperties", "$defs", "definitions",
               "dependentSchemas")
_CHILD_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_CHILD_VALUES = ("items", "additionalProperties", "unevaluatedProperties",
                 "unevaluatedItems", "additionalItems", "propertyNames", "contains", "not",
                 "if", "then", "else")


def bounded_strings_as_patterns(schema: Any) -> Any:
    """A copy of `schema` where every `minLength`/`maxLength` without `pattern` or
    `format` beside it is the equivalent `pattern` instead."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _CHILD_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: bounded_strings_as_patterns(v) for k, v in out[key].items()}
    for key in _CHILD_LISTS + _CHILD_VALUES:
        if isinstance(out.get(key), (dict, list)):
            out[key] = bounded_strings_as_patterns(out[key])
    bounded = "minLength" in out or "maxLength" in out
    if bounded and "pattern" not in out and "format" not in out:
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", None)
        out["pattern"] = f"^[\\s\\S]{{{lo},{'' if hi is None else hi}}}$"
    return out
