"""`tools` / `tool_choice` validation, and the JSON schemas that force a call.

With `tool_choice="required"` or a named function the model's output is held by
structured decoding to a JSON schema built here, so that it always parses back into
calls (the `forced.py` parsers), whatever the model would have written on its own.
vLLM does the same, with the same two shapes:

- `required`: a list of one or more `{"name": <one of the tools>, "parameters":
  <that tool's parameters>}` objects (at most one when `parallel_tool_calls` is
  false). `$defs`/`definitions` of the tools' schemas are lifted to the root, where
  their `#/$defs/...` references resolve;
- named `f`: `f`'s parameters schema; the output is the arguments object itself.

Everything a client can get wrong raises `ToolChoiceError` with the field's path in
`param`, for a 400.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

EMPTY_PARAMETERS: dict = {"type": "object", "properties": {}}


class ToolChoiceError(ValueError):
    """A bad `tools` / `tool_choice`; `param` names the field (the server answers 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str | None
    parameters: dict
    strict: bool | None = None


@dataclass(frozen=True)
class ToolChoicePlan:
    """What a request asks for: `mode`, the named `function`, and the `schema` to force."""
    mode: Literal["none", "auto", "required", "named"]
    tools: tuple[FunctionTool, ...]
    function: FunctionTool | None = None
    schema: dict | None = None
    parallel_tool_calls: bool = True     # False: at most one call (auto; forced by schema)


def parse_tools(tools: Any) -> list[FunctionTool]:
    """OpenAI `tools` (a list of `{"type": "function", "function": {...}}`) -> FunctionTools."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolChoiceError("tools must be a list of tool objects", "tools")
    out = []
    for k, tool in enumerate(tools):
        where = f"tools.{k}"
        if not isinstance(tool, dict):
            raise ToolChoiceError(f"{where} must be an object", where)
        if tool.get("type", "function") != "function":
            raise ToolChoiceError(f"{where}.type: only 'function' tools are supported, got "
                                  f"{tool.get('type')!r}", f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolChoiceError(f"{where}.function must be an object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ToolChoiceError(f"{where}.function.name must be a non-empty string",
                                  f"{where}.function.name")
        params = fn.get("parameters")
        if params is None:
            params = EMPTY_PARAMETERS
        elif not isinstance(params, dict):
            raise ToolChoiceError(f"{where}.function.parameters must be a JSON schema object",
                                  f"{where}.function.parameters")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolChoiceError(f"{where}.function.description must be a string",
                                  f"{where}.function.description")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ToolChoiceError(f"{where}.function.strict must be a boolean",
                                  f"{where}.function.strict")
        out.append(FunctionTool(name, desc, params, strict))
    return out


def plan_tool_choice(tools: Any, tool_choice: Any, *, auto_enabled: bool,
                     parallel_tool_calls: bool | None = True) -> ToolChoicePlan:
    """Validate `tools` + `tool_choice` and decide how the output will be handled.

    `auto_enabled` is `--enable-auto-tool-choice` with a `--tool-call-parser`: vLLM
    refuses `"auto"` without them (a 400), and so does this. Without `tool_choice`,
    the choice is `"auto"` when tools are given (and auto is enabled), else `"none"`,
    which is vLLM's default.
    """
    funcs = parse_tools(tools)
    if tool_choice == "required" and isinstance(tools, list) and not tools:
        # vLLM (protocol.check_tool_usage): "required" with an empty `tools` list is
        # "none", as OpenAI has it; agent frameworks send `tools: []` with no tool on.
        return ToolChoicePlan("none", ())
    if tool_choice is None:
        tool_choice = "auto" if funcs and auto_enabled else "none"
    if isinstance(tool_choice, str):
        if tool_choice == "none":
            return ToolChoicePlan("none", tuple(funcs))
        if tool_choice not in ("auto", "required"):
            raise ToolChoiceError(f"tool_choice must be 'none', 'auto', 'required' or "
                                  f"{{'type': 'function', 'function': {{'name': ...}}}}, got "
                                  f"{tool_choice!r}", "tool_choice")
        if not funcs:
            raise ToolChoiceError(f"tool_choice {tool_choice!r} needs `tools`", "tool_choice")
        if tool_choice == "auto":
            if not auto_enabled:
                raise ToolChoiceError('"auto" tool choice requires --enable-auto-tool-choice '
                                      "and --tool-call-parser to be set", "tool_choice")
            return ToolChoicePlan("auto", tuple(funcs),
                                  parallel_tool_calls=parallel_tool_calls is not False)
        return ToolChoicePlan("required", tuple(funcs),
                              schema=required_schema(funcs, parallel_tool_calls))
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" \
            or not isinstance(tool_choice.get("function"), dict) \
            or not isinstance(tool_choice["function"].get("name"), str):
        raise ToolChoiceError("a named tool_choice must be {'type': 'function', 'function': "
                              "{'name': ...}}", "tool_choice")
    name = tool_choice["function"]["name"]
    for fn in funcs:
        if fn.name == name:
            return ToolChoicePlan("named", tuple(funcs), fn, named_schema(fn))
    raise ToolChoiceError(f"tool_choice names the function {name!r}, which is not in `tools`",
                          "tool_choice.function.name")


def named_schema(fn: FunctionTool) -> dict:
    """A named call's output is its arguments object: the function's parameters schema."""
    return copy.deepcopy(fn.parameters)


def required_schema(funcs: list[FunctionTool], parallel_tool_calls: bool | None = True) -> dict:
    """A list of 1+ `{"name", "parameters"}` objects, one alternative per function."""
    defs: dict[str, dict] = {}
    alternatives = []
    for k, fn in enumerate(funcs):
        params = copy.deepcopy(fn.parameters)
        for key in ("$defs", "definitions"):
            lifted = params.pop(key, None)
            if lifted is None:
                continue
            if not isinstance(lifted, dict):
                raise ToolChoiceError(f"tools.{k}.function.parameters.{key} must be an object",
                                      f"tools.{k}.function.parameters")
            target = defs.setdefault(key, {})
            for dname, dschema in lifted.items():
                if dname in target and target[dname] != dschema:
                    raise ToolChoiceError(
                        f"tools.{k}.function.parameters: {key} {dname!r} is defined "
                        "differently by another tool; tool_choice 'required' needs one "
                        "definition per name", f"tools.{k}.function.parameters")
                target[dname] = dschema
        alternatives.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [fn.name]},
                           "parameters": params},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    items = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    schema: dict = {"type": "array", "minItems": 1, "items": items}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema
