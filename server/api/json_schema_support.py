"""Which JSON Schema keywords structured outputs can enforce, checked before compiling.

xgrammar converts a schema to a grammar and *silently drops* what it cannot express.
A request must never get a 200 whose output ignores part of its schema, so the
keywords below are refused up front with the path where they occur. The list was
measured on xgrammar 0.2.9 (random walks over the compiled grammar, each output
validated with `jsonschema`; tests/server/test_structured_output.py repeats the check
for every keyword listed here, so an xgrammar upgrade that starts enforcing one fails a
test instead of staying refused):

- refused with its own message: array-form `items` (draft-04..07 tuples; xgrammar
  refuses it as "items must be a boolean or an object", which would call a valid
  draft-07 schema invalid): `prefixItems` is the 2020-12 form it enforces.
- dropped: `uniqueItems: true`, `contains`/`minContains`/`maxContains`, `not`,
  `if`/`then`/`else`, `dependentRequired`/`dependentSchemas`/`dependencies`,
  `multipleOf` on non-integers, `allOf` with more than one subschema, a required name
  missing from `properties`, `minLength`/`maxLength` beside `pattern` or `format`,
  constraints beside `$ref`, a `$ref` outside the schema (never fetched),
  constraints beside `enum`/`const`; and a `pattern` (or a `patternProperties` key)
  with an escape xgrammar would misread, or with lookaround, backreferences, `\\b`,
  `\\p{...}` or inline flags, which it drops from a schema (`regex_support.py`).
- enforced (accepted): type (and lists of types), properties/required,
  additionalProperties (false by default: strict, as OpenAI's strict mode), enum,
  const, anyOf, oneOf (as anyOf: the output matches at least one branch), a single
  allOf, $ref/$defs/definitions (recursion too), items/prefixItems, min/maxItems,
  min/maxLength, pattern, format (the formats xgrammar knows; other formats are
  annotations, as in JSON Schema itself), minimum/maximum and their exclusive forms,
  integer multipleOf, min/maxProperties, propertyNames, patternProperties,
  unevaluatedProperties/unevaluatedItems.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pagefleet.server.api.regex_support import regex_problem

# Keywords that describe and never constrain.
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
    "writeOnly", "$schema", "$id", "$anchor", "$defs", "definitions", "discriminator",
    "contentMediaType", "contentEncoding",
})
NEVER_ENFORCED = ("contains", "minContains", "maxContains", "not", "if", "then", "else",
                  "dependentRequired", "dependentSchemas", "dependencies")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "unevaluatedProperties",
                  "unevaluatedItems", "additionalItems", "propertyNames", "contains", "not",
                  "if", "then", "else")


def _subschemas(schema: dict, path: str) -> Iterator[tuple[dict, str]]:
    for key in _SCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                if isinstance(sub, dict):
                    yield sub, f"{path}/{key}/{name}"
    for key in _SCHEMA_LISTS + ("items",):
        value = schema.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                if isinstance(sub, dict):
                    yield sub, f"{path}/{key}/{i}"
    for key in _SCHEMA_VALUES:
        value = schema.get(key)
        if isinstance(value, dict):
            yield value, f"{path}/{key}"


def _constraints(schema: dict, *, allow: frozenset[str] = frozenset()) -> list[str]:
    return sorted(k for k in schema if k not in ANNOTATIONS and k not in allow)


def _refusal(schema: dict) -> str | None:
    """Why this one schema node cannot be enforced (subschemas aside), or None."""
    for key in NEVER_ENFORCED:
        if key in schema:
            return f"`{key}`"
    if isinstance(schema.get("items"), list):
        # draft-04..07 tuple validation; xgrammar takes only the 2020-12 form
        return ("array-form `items` (draft-07 tuples; write them as `prefixItems`, "
                "with `items` for the rest)")
    if schema.get("uniqueItems") is True:
        return "`uniqueItems`"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return "`allOf` with more than one subschema"
    if "multipleOf" in schema and not (schema.get("type") == "integer"
                                       and isinstance(schema["multipleOf"], int)):
        return "`multipleOf` on a non-integer"
    if ("pattern" in schema or "format" in schema) and (
            "minLength" in schema or "maxLength" in schema):
        return "`minLength`/`maxLength` together with `pattern` or `format`"
    if "$ref" in schema:
        ref = schema["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#"):
            # xgrammar never fetches a document: the field would go unconstrained
            return f"the external `$ref` {ref!r} (only references within the schema)"
        extra = _constraints(schema, allow=frozenset({"$ref"}))
        if extra:
            return f"`{extra[0]}` beside `$ref`"
    for key in ("enum", "const"):
        if key in schema:
            extra = _constraints(schema, allow=frozenset({key, "type"}))
            if extra:
                return f"`{extra[0]}` beside `{key}`"
    patterns = [schema["pattern"]] if isinstance(schema.get("pattern"), str) else []
    if isinstance(schema.get("patternProperties"), dict):
        patterns += list(schema["patternProperties"])
    for pattern in patterns:
        problem = regex_problem(pattern, in_schema=True)
        if problem is not None:
            return f"the pattern {pattern!r} ({problem})"
    required = schema.get("required")
    if isinstance(required, list):
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        missing = [r for r in required if isinstance(r, str) and r not in props]
        if missing:
            return f"required property {missing[0]!r} that `properties` does not define"
    return None


def unsupported_feature(schema: Any, path: str = "#") -> str | None:
    """The first part of `schema` that structured outputs cannot enforce, as
    "<what> (at <json pointer>)", or None when every keyword is enforced."""
    if not isinstance(schema, dict):
        return None
    why = _refusal(schema)
    if why:
        return f"{why} (at {path})"
    for sub, sub_path in _subschemas(schema, path):
        found = unsupported_feature(sub, sub_path)
        if found:
            return found
    return None
