"""Structured outputs, API side: an OpenAI/vLLM request body -> one `GrammarSpec`,
validated at the edge so that the engine core only ever compiles good specs.

Fields read (chat and completions alike, as vLLM does):
- `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name", "schema", "description", "strict"}}`.
- `structured_outputs` (vLLM >= 0.10): one of `json` (schema object or its JSON text),
  `regex`, `choice` (list of strings), `grammar` (EBNF/GBNF with a `root` rule, or Lark
  with a `start` rule), `json_object: true`; options `disable_any_whitespace`,
  `disable_additional_properties` and `disable_fallback` (booleans).
- `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
  `guided_decoding_backend`: the names vLLM took until 0.11 (removed in 0.12, which
  ignores them). Clients written for the vLLM versions our users run still send them,
  and ignoring a constraint is never right here, so they are taken as the
  `structured_outputs` field of the same meaning (one notice in the log per name).

Every problem is a 400 naming the field: a wrong type, an unknown key, two constraints
at once, an invalid JSON Schema (checked against its metaschema by jsonschema-rs: a
millisecond where pure-Python jsonschema takes seconds on a large schema), a schema
keyword that xgrammar would silently drop (`json_schema_support.py`), a regex or grammar
that does not parse, a regex escape xgrammar would misread (`regex_support.py`), and
what xgrammar has no way to do (`whitespace_pattern`, `structural_tag`, and the
top-level `structural_tag` of vLLM <= 0.11). Checks are
cached by spec, so a schema sent by every request is checked once.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Mapping
from typing import Any

import jsonschema_rs

from pagefleet.server.api.errors import bad_request
from pagefleet.server.api.json_schema_support import unsupported_feature
from pagefleet.server.api.regex_support import regex_problem
from pagefleet.server.engine.structured_output import GrammarSpec, parse_grammar

log = logging.getLogger("pagefleet.api")

MAX_SPEC_CHARS = 1 << 18          # a schema, regex, grammar or choice list: 256 KiB of text
SO_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
SO_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "disable_fallback",
              "whitespace_pattern")
LEGACY = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
LEGACY_OPTIONS = ("guided_decoding_backend", "guided_whitespace_pattern")
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
KNOWN_DIALECTS = frozenset({
    "http://json-schema.org/draft-04/schema", "http://json-schema.org/draft-06/schema",
    "http://json-schema.org/draft-07/schema", "http://json-schema.org/draft/2019-09/schema",
    "http://json-schema.org/draft/2020-12/schema"})
KIND_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regex",
              "choice": "choice", "ebnf": "EBNF grammar", "lark": "Lark grammar"}
_noticed: set[str] = set()


def grammar_spec_from_request(body: Mapping[str, Any], *,
                              disable_any_whitespace: bool = False) -> GrammarSpec | None:
    """The one constraint a request body asks for, or None. Raises `APIError` (400,
    `param` naming the field) for anything that cannot be enforced as asked.

    `disable_any_whitespace` is the server's default for JSON kinds (vLLM's
    `--structured-outputs-config '{"disable_any_whitespace": true}'`); the request's
    `structured_outputs.disable_any_whitespace` overrides it.
    """
    so = _object(body.get("structured_outputs"), "structured_outputs")
    any_whitespace = _whitespace_option(so, body, not disable_any_whitespace)
    found: list[tuple[str, GrammarSpec]] = []
    rf = _object(body.get("response_format"), "response_format")
    if rf is not None:
        spec = _from_response_format(rf, any_whitespace)
        if spec is not None:
            found.append((_response_format_param(rf), spec))
    if so is not None:
        unknown = [k for k in so if k not in SO_CONSTRAINTS + SO_OPTIONS]
        if unknown:
            raise bad_request(f"structured_outputs.{unknown[0]}: unknown field (fields: "
                              f"{', '.join(SO_CONSTRAINTS + SO_OPTIONS)})",
                              f"structured_outputs.{unknown[0]}")
        for key in SO_CONSTRAINTS:
            value = so.get(key)
            if value is None or (key == "json_object" and value is False):
                continue
            param = f"structured_outputs.{key}"
            found.append((param, _constraint(key, value, param, any_whitespace)))
    if body.get("structural_tag") is not None:
        # vLLM <= 0.11's top-level name of structured_outputs.structural_tag: refused
        # like that one (ignoring a constraint is never right here).
        raise bad_request("structural_tag: structural tags are not supported; use "
                          "structured_outputs json, regex, choice or grammar",
                          "structural_tag")
    for legacy, key in LEGACY.items():
        value = body.get(legacy)
        if value is not None:
            _notice(legacy, f"structured_outputs.{key}")
            found.append((legacy, _constraint(key, value, legacy, any_whitespace)))
    if len(found) > 1:
        (first, _), (second, _) = found[0], found[1]
        raise bad_request(f"{second}: only one structured-output constraint per request, "
                          f"but {first} is set too", second)
    return found[0][1] if found else None


# -- the fields ----------------------------------------------------------------------
def _object(value: Any, param: str) -> dict | None:
    if value is None or isinstance(value, dict):
        return value
    raise bad_request(f"{param}: expected an object, got {type(value).__name__}", param)


def _bool(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise bad_request(f"{param}: expected a boolean", param)
    return value


def _whitespace_option(so: dict | None, body: Mapping[str, Any], default: bool) -> bool:
    """any_whitespace for JSON kinds, and the options xgrammar has no way to honour."""
    for param, value in (("structured_outputs.whitespace_pattern",
                          (so or {}).get("whitespace_pattern")),
                         ("guided_whitespace_pattern", body.get("guided_whitespace_pattern"))):
        if value is not None:
            raise bad_request(f"{param}: a custom whitespace pattern is not supported by "
                              "the xgrammar backend; use "
                              "structured_outputs.disable_any_whitespace for compact JSON",
                              param)
    backend = body.get("guided_decoding_backend")
    if backend is not None:
        if not isinstance(backend, str):
            raise bad_request("guided_decoding_backend: expected a string",
                              "guided_decoding_backend")
        _notice("guided_decoding_backend", "the xgrammar backend (the only one here)")
    for key in ("disable_additional_properties", "disable_fallback"):
        if so is not None and so.get(key) is not None:
            _bool(so[key], f"structured_outputs.{key}")
    disable = (so or {}).get("disable_any_whitespace")
    if disable is None:
        return default
    return not _bool(disable, "structured_outputs.disable_any_whitespace")


def _response_format_param(rf: dict) -> str:
    return ("response_format.json_schema" if rf.get("type") == "json_schema"
            else "response_format")


def _from_response_format(rf: dict, any_whitespace: bool) -> GrammarSpec | None:
    kind = rf.get("type")
    if kind == "structural_tag":
        raise bad_request("response_format.type: 'structural_tag' is not supported; use "
                          "'json_schema' or structured_outputs", "response_format.type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request(f"response_format.type: must be one of "
                          f"{', '.join(RESPONSE_FORMAT_TYPES)}, got {kind!r}",
                          "response_format.type")
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    unknown = [k for k in rf if k not in allowed]
    if unknown:
        raise bad_request(f"response_format.{unknown[0]}: unknown field for type {kind!r}",
                          f"response_format.{unknown[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object(any_whitespace)
    js = _object(rf.get("json_schema"), "response_format.json_schema")
    if js is None:
        raise bad_request("response_format.json_schema: required when type is "
                          "'json_schema'", "response_format.json_schema")
    unknown = [k for k in js if k not in ("name", "description", "schema", "strict")]
    if unknown:
        raise bad_request(f"response_format.json_schema.{unknown[0]}: unknown field",
                          f"response_format.json_schema.{unknown[0]}")
    if not isinstance(js.get("name"), str) or not js["name"]:
        raise bad_request("response_format.json_schema.name: required (a non-empty string)",
                          "response_format.json_schema.name")
    for key in ("description",):
        if js.get(key) is not None and not isinstance(js[key], str):
            raise bad_request(f"response_format.json_schema.{key}: expected a string",
                              f"response_format.json_schema.{key}")
    if js.get("strict") is not None:
        _bool(js["strict"], "response_format.json_schema.strict")
    if js.get("schema") is None:
        raise bad_request("response_format.json_schema.schema: required (the JSON Schema "
                          "the output must follow)", "response_format.json_schema.schema")
    return json_schema_spec(js["schema"], "response_format.json_schema.schema", any_whitespace)


def _constraint(key: str, value: Any, param: str, any_whitespace: bool) -> GrammarSpec:
    if key == "json":
        return json_schema_spec(value, param, any_whitespace)
    if key == "json_object":
        if value is not True:
            raise bad_request(f"{param}: expected true (or leave it out)", param)
        return GrammarSpec.json_object(any_whitespace)
    if key == "structural_tag":
        raise bad_request(f"{param}: structural tags are not supported; use json, regex, "
                          "choice or grammar", param)
    if key == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) for c in value)):
            raise bad_request(f"{param}: expected a non-empty list of strings", param)
        spec = GrammarSpec.choice(value)
    else:
        if not isinstance(value, str) or not value.strip():
            raise bad_request(f"{param}: expected a non-empty string", param)
        spec = GrammarSpec.regex(value) if key == "regex" else GrammarSpec.grammar(value)
    _raise_if_invalid(spec, param)
    return spec


def json_schema_spec(value: Any, param: str, any_whitespace: bool) -> GrammarSpec:
    """A JSON Schema (object or its JSON text) as a GrammarSpec, checked: a 400 naming
    `param` when it cannot be enforced (response_format's, and a forced tool call's)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad_request(f"{param}: not valid JSON: {exc}", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param}: expected a JSON Schema object, got "
                          f"{type(value).__name__}", param)
    try:
        spec = GrammarSpec.json_schema(value, any_whitespace)
    except (TypeError, ValueError) as exc:       # NaN, circular structures
        raise bad_request(f"{param}: not serializable as JSON: {exc}", param) from None
    _raise_if_invalid(spec, param)
    return spec


# -- checks, cached by spec ----------------------------------------------------------
def _raise_if_invalid(spec: GrammarSpec, param: str) -> None:
    problem = spec_problem(spec)
    if problem is not None:
        raise bad_request(f"{param}: {problem}", param)


@functools.lru_cache(maxsize=1024)
def spec_problem(spec: GrammarSpec) -> str | None:
    """Why `spec` cannot be enforced, or None. Pure and cached: the same schema or
    regex is parsed once, not once per request."""
    if len(spec.text) > MAX_SPEC_CHARS:
        return f"too large ({len(spec.text)} characters; at most {MAX_SPEC_CHARS})"
    if "\x00" in spec.text:
        return "must not contain a NUL character"
    if spec.kind == "json_schema":
        problem = _schema_problem(json.loads(spec.text))
        if problem is not None:
            return problem
    if spec.kind == "regex" and (problem := regex_problem(spec.text)) is not None:
        return f"invalid regex: {problem}"
    try:
        parse_grammar(spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        what = KIND_NAMES[spec.syntax or spec.kind]
        return f"invalid {what}: {xgrammar_message(exc)}"
    return None


def _schema_problem(schema: dict) -> str | None:
    dialect = schema.get("$schema")
    if dialect is not None and (not isinstance(dialect, str)
                                or dialect.rstrip("#").replace("https:", "http:")
                                not in KNOWN_DIALECTS):
        # Checked first: an unknown metaschema URI would be fetched over the network.
        return (f"unsupported $schema {dialect!r} (one of JSON Schema draft-04, -06, -07, "
                "2019-09, 2020-12, or leave it out for 2020-12)")
    try:
        jsonschema_rs.meta.validate(schema)
    except jsonschema_rs.ValidationError as exc:
        where = "#" + "".join(f"/{p}" for p in exc.instance_path)
        return f"invalid JSON schema: {exc.message} (at {where})"
    except jsonschema_rs.ReferencingError as exc:
        return f"invalid JSON schema: {str(exc).splitlines()[0]}"
    unsupported = unsupported_feature(schema)
    if unsupported is not None:
        return f"structured outputs cannot enforce {unsupported}"
    return None


_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+?\.cc:\d+: (?:Check failed: .*?: )?")


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's error text without its C++ timestamp and source location."""
    text = str(exc).strip()
    return _XGR_PREFIX.sub("", text).strip() or type(exc).__name__


def _notice(name: str, taken_as: str) -> None:
    if name not in _noticed:
        _noticed.add(name)
        log.info("request field `%s` (vLLM <= 0.11) is taken as %s", name, taken_as)

