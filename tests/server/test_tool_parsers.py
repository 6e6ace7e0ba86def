"""Tool-call parsers on fixed model texts, whole and streamed at every chunking.

Each fixture is a model output and the message it must parse into (content, and the
calls' names and arguments). Then the same text is streamed cut at every point, one
character at a time and at random points: the deltas, reassembled the way OpenAI
clients do (by `index`, concatenating `arguments`), must give exactly the
non-streamed message, ids included. The official `openai` client's own stream
accumulator is run over the chunks too.
"""

from __future__ import annotations

import itertools
import json
import string

import jsonschema
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pagefleet.server.api.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    NamedToolParser,
    RequiredToolParser,
    ToolChoiceError,
    get_tool_parser,
    parse_tools,
    parser_for_plan,
    plan_tool_choice,
)
from tests.server.helpers_chunks import chunkings


def counter_ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def reassemble(parser, chunks):
    """Feed chunks; rebuild (content, [(id, name, arguments)]) as a client would."""
    content, calls = [], []
    deltas = [parser.feed(c) for c in chunks] + [parser.finish()]
    for d in deltas:
        if d is None:
            continue
        if d.content is not None:
            assert d.content, "an empty content delta was sent"
            content.append(d.content)
        for t in d.tool_calls:
            if t.index == len(calls):             # a new call: id, type and name come first
                assert t.id and t.name, t
                assert t.to_openai()["type"] == "function"
                calls.append([t.id, t.name, t.arguments])
            else:
                assert t.index == len(calls) - 1, "pieces of an earlier call after a new one"
                assert t.id is None and t.name is None and t.arguments, t
                assert set(t.to_openai()) == {"index", "function"}
                calls[t.index][2] += t.arguments
    return "".join(content), [tuple(c) for c in calls]


def whole(cls, text, **kw):
    content, calls = cls.extract(text, id_factory=counter_ids(), **kw)
    return content, [(c.id, c.name, c.arguments) for c in calls]


def assert_streams_like_whole(cls, text, **kw):
    content, calls = whole(cls, text, **kw)
    want = (content or "", calls)
    for chunks in chunkings(text):
        got = reassemble(cls(id_factory=counter_ids(), **kw), chunks)
        assert got == want, f"chunks {chunks!r}"
    return content, calls


SAME = object()        # expected content: the text itself, unchanged


def check_fixture(cls, text, content, calls, **kw):
    if content is SAME:
        content = text
    got_content, got_calls = assert_streams_like_whole(cls, text, **kw)
    assert got_content == content
    assert [(name, args) for _, name, args in got_calls] == calls
    if not calls and cls is not RequiredToolParser:     # forced JSON is never content
        assert got_content == text, "with no call, content must be the text unchanged"


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'

HERMES = [
    # well-formed, as Qwen2.5 writes it
    (f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("get_weather", WEATHER_ARGS)]),
    # several calls, text before, between and after
    (f'Let me check both.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n'
     '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
     "Let me check both.", [("get_weather", WEATHER_ARGS),
                            ("get_time", '{"tz": "Europe/Paris"}')]),
    (f"Sure.\n<tool_call>{WEATHER}</tool_call>\nDone, see above.",
     "Sure.\n\nDone, see above.", [("get_weather", WEATHER_ARGS)]),
    # arguments holding the end tag, braces and escapes inside strings; nested values
    ('<tool_call>{"name": "run", "arguments": {"code": "print(\\"</tool_call>}{\\")", '
     '"opts": {"a": [1, {"b": null}], "u": "\\u00e9"}}}</tool_call>', None,
     [("run", '{"code": "print(\\"</tool_call>}{\\")", "opts": {"a": [1, {"b": null}], '
              '"u": "\\u00e9"}}')]),
    # keys in the other order; a call without arguments gets {}
    ('<tool_call>{"arguments": {"q": 1}, "name": "search"}</tool_call>', None,
     [("search", '{"q": 1}')]),
    ('<tool_call>{"name": "now"}</tool_call>', None, [("now", "{}")]),
    # malformed: content, verbatim
    ("<tool_call>not json at all</tool_call> sorry", SAME, []),
    ('<tool_call>{"name": get_weather}</tool_call>', SAME, []),
    ('<tool_call>{"name": 42, "arguments": {}}</tool_call>',
     '<tool_call>{"name": 42, "arguments": {}}</tool_call>', []),
    ('<tool_call>{"arguments": {"a": 1}}</tool_call>', SAME, []),
    ("<tool_call>{}</tool_call>", SAME, []),
    ("<tool_call>['get_weather']</tool_call>", SAME, []),
    ('<tool_call>{"name": "f', '<tool_call>{"name": "f', []),          # cut before the name ends
    # a call cut short after its name (max_tokens): kept, arguments as far as written
    ('<tool_call>{"name": "f", "arguments": {"city": "Par', None, [("f", '{"city": "Par')]),
    # the model closed the block without closing the JSON: arguments end at the tag
    ('<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>ok', "ok", [("f", '{"a": 1')]),
    # no call: untouched, including things that look like the start of a tag
    ("if a < b and c <tool_ then", SAME, []),
    ("ends with <tool_ca", SAME, []),
    ("", SAME, []),
    ("  \n", SAME, []),
    ("Trailing space kept  ", SAME, []),
]

LLAMA = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", '{"city": "Paris"}')]),
    ('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": [2, 3]}}', None,
     [("a", '{"x": 1}'), ("b", '{"y": [2, 3]}')]),
    ('{"type": "function", "name": "get_time", "parameters": {}}', None, [("get_time", "{}")]),
    ('{"name": "a", "arguments": {"k": "v"}}', None, [("a", '{"k": "v"}')]),
    ('\n {"parameters": {"z": "}"}, "name": "late"}', None, [("late", '{"z": "}"}')]),
    ('Checking.<|python_tag|>{"name": "a", "parameters": {}}', "Checking.", [("a", "{}")]),
    ('{"name": "a", "parameters": {}} and then some text', "and then some text", [("a", "{}")]),
    # JSON answers and prose are content
    ('{"name": "Ann", "age": 3}', '{"name": "Ann", "age": 3}', []),
    ('{"name": "Ann"}', SAME, []),
    ('Here: {"name": "a", "parameters": {}}', 'Here: {"name": "a", "parameters": {}}', []),
    ("<|python_tag|>print(1 + 1)", SAME, []),
    ('{"name": "a", "parameters": {"x": 1}}; not a call', "; not a call", [("a", '{"x": 1}')]),
    ("{", SAME, []),
    ("{ not json", SAME, []),
    ("", SAME, []),
]

MISTRAL = [
    # tokenizers v2-v7: one [TOOL_CALLS] and a JSON list
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
     [("get_weather", '{"city": "Paris"}')]),
    ('Let me look.[TOOL_CALLS] [{"name": "a", "arguments": {"x": [1, [2]]}}, '
     '{"name": "b", "arguments": {}}]', "Let me look.", [("a", '{"x": [1, [2]]}'), ("b", "{}")]),
    # v11+: one [TOOL_CALLS] per call, with [ARGS], with [CALL_ID], or with [ARGS] decoded away
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None,
     [("get_weather", '{"city": "Paris"}')]),
    ('[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{"y": "[TOOL_CALLS]"}', None,
     [("a", '{"x": 1}'), ("b", '{"y": "[TOOL_CALLS]"}')]),
    ('[TOOL_CALLS]get_weather{"city": "Paris"}', None, [("get_weather", '{"city": "Paris"}')]),
    ('Sure.[TOOL_CALLS]f{"a": 1} done', "Sure. done", [("f", '{"a": 1}')]),
    # malformed: content
    ("[TOOL_CALLS] I cannot call that", SAME, []),
    ("[TOOL_CALLS][]", SAME, []),
    ("[TOOL_CALLS][1, 2]", "[TOOL_CALLS][1, 2]", []),
    ("[TOOL_CALLS]f", SAME, []),
    ("no calls [TOOL", SAME, []),
]

REQUIRED = [
    ('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]', None,
     [("a", '{"x": 1}'), ("b", "{}")]),
    (' [ {"name": "a", "parameters": {"q": "]"}} ]\n', None, [("a", '{"q": "]"}')]),
    # Forced JSON is never content: a cut-off list leaves only its finished calls
    # (review finding 8: `, ` and `, {"name": "` came back as message.content).
    ("not a list", None, []),
    ('[{"name": "a", "parameters": {"x": 1}}, ', None, [("a", '{"x": 1}')]),
    ('[{"name": "a", "parameters": {"x": 1}}, {"name": "', None, [("a", '{"x": 1}')]),
    ('[{"na', None, []),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES)
def test_hermes(text, content, calls):
    check_fixture(HermesToolParser, text, content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA)
def test_llama3_json(text, content, calls):
    check_fixture(Llama3JsonToolParser, text, content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), MISTRAL)
def test_mistral(text, content, calls):
    check_fixture(MistralToolParser, text, content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), REQUIRED)
def test_required(text, content, calls):
    check_fixture(RequiredToolParser, text, content, calls)


def test_well_formed_arguments_are_the_json_written():
    """Arguments are the model's JSON text: it loads back to what the model meant."""
    text = f"<tool_call>\n{WEATHER}\n</tool_call>"
    _, calls = HermesToolParser.extract(text)
    assert json.loads(calls[0].arguments) == json.loads(WEATHER)["arguments"]


def test_mistral_call_ids():
    _, calls = MistralToolParser.extract('[TOOL_CALLS]a{"x": 1}[TOOL_CALLS]b{"y": 2}')
    for c in calls:        # Mistral's templates refuse any other id when calls come back
        assert len(c.id) == 9 and all(ch in string.ascii_letters + string.digits for ch in c.id)
    assert calls[0].id != calls[1].id
    _, calls = MistralToolParser.extract('[TOOL_CALLS]a[CALL_ID]x1y2z3w4v[ARGS]{"x": 1}')
    assert [(c.id, c.name, c.arguments) for c in calls] == [("x1y2z3w4v", "a", '{"x": 1}')]


def test_default_ids_are_openai_shaped_and_unique():
    text = "".join(f'<tool_call>{{"name": "f{i}", "arguments": {{}}}}</tool_call>'
                   for i in range(5))
    _, calls = HermesToolParser.extract(text)
    ids = [c.id for c in calls]
    assert len(set(ids)) == 5
    assert all(i.startswith("call_") and len(i) == 29 for i in ids)


@pytest.mark.parametrize("text", [
    f"\n<tool_call>\n{WEATHER}\n</tool_call>",
    "Hmm.\n<tool_call>{\"name\": \"a\", \"arguments\": {\"k\": [1, 2]}}</tool_call>"
    "<tool_call>{\"name\": \"b\", \"arguments\": {}}</tool_call>",
])
def test_openai_client_accumulates_the_stream(text):
    """The official client's stream accumulator rebuilds the non-streamed message."""
    content, calls = HermesToolParser.extract(text, id_factory=counter_ids())

    def chunk(delta, finish=None):
        return ChatCompletionChunk.model_validate({
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    state = ChatCompletionStreamState()
    state.handle_chunk(chunk({"role": "assistant", "content": ""}))
    parser = HermesToolParser(id_factory=counter_ids())
    for piece in [text[i:i + 3] for i in range(0, len(text), 3)] + [None]:
        delta = parser.feed(piece) if piece is not None else parser.finish()
        if delta is not None:
            state.handle_chunk(chunk(delta.to_openai()))
    state.handle_chunk(chunk({}, "tool_calls"))
    msg = state.get_final_completion().choices[0].message
    assert (msg.content or None) == content
    assert [(t.id, t.function.name, t.function.arguments) for t in msg.tool_calls] == \
        [(c.id, c.name, c.arguments) for c in calls]
    # and the non-streamed shape is what the client's ChatCompletion type expects
    body = ChatCompletion.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": content,
            "tool_calls": [c.to_openai() for c in calls]}}]})
    assert body.choices[0].message.tool_calls[0].function.name == calls[0].name


def test_stream_holds_back_only_what_is_undecided():
    p = HermesToolParser(id_factory=counter_ids())
    assert p.feed("Hello wor").content == "Hello wor"
    assert p.feed("ld <tool") .content == "ld"        # " <tool" may start a tag
    d = p.feed('_call>{"name": "f", "arguments": {"a"')
    assert d.content is None
    assert [t.to_openai() for t in d.tool_calls] == [
        {"index": 0, "id": "call_0", "type": "function",
         "function": {"name": "f", "arguments": '{"a"'}}]
    d = p.feed(": 1}}</tool_call>")
    assert [t.to_openai() for t in d.tool_calls] == \
        [{"index": 0, "function": {"arguments": ": 1}"}}]
    assert p.finish() is None
    assert p.result().content == "Hello world"


def test_long_outputs_stream_in_small_pieces():
    """A long answer and a long argument string go through token-sized pieces intact."""
    prose = "word < word > " * 4000
    code = "x = {'a': [1, 2]}\\n" * 3000
    text = f'{prose}<tool_call>{{"name": "write", "arguments": {{"code": "{code}"}}}}</tool_call>'
    content, calls = reassemble(HermesToolParser(id_factory=counter_ids()),
                                [text[i:i + 4] for i in range(0, len(text), 4)])
    assert content == prose.rstrip()
    assert json.loads(calls[0][2]) == {"code": code.replace("\\n", "\n")}


def test_named_parser():
    for text, args in [('{"city": "Paris"}', '{"city": "Paris"}'),
                       ('  \n{"a": [1,\n 2]} \n', '{"a": [1,\n 2]}')]:
        content, calls = assert_streams_like_whole(NamedToolParser, text,
                                                   function_name="get_weather")
        assert content is None
        assert [(n, a) for _, n, a in calls] == [("get_weather", args)]


def test_registry():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    assert get_tool_parser("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="choose from hermes, llama3_json, mistral"):
        get_tool_parser("qwen")


def test_feed_after_finish_is_an_error():
    p = HermesToolParser()
    p.finish()
    with pytest.raises(RuntimeError):
        p.feed("x")


# -- tool_choice --------------------------------------------------------------------------
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "book", "parameters": {
            "type": "object", "properties": {"slot": {"$ref": "#/$defs/slot"}},
            "required": ["slot"], "$defs": {"slot": {"type": "object", "properties": {
                "day": {"type": "string"}, "hour": {"type": "integer"}},
                "required": ["day", "hour"]}}}}},
    {"type": "function", "function": {"name": "now"}},
]


def test_required_schema_accepts_calls_and_parses_back():
    plan = plan_tool_choice(TOOLS, "required", auto_enabled=False)
    assert plan.mode == "required"
    schema = plan.schema
    jsonschema.Draft202012Validator.check_schema(schema)
    output = [{"name": "book", "parameters": {"slot": {"day": "Mon", "hour": 9}}},
              {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}},
              {"name": "now", "parameters": {}}]
    jsonschema.validate(output, schema)
    for bad in ([], [{"name": "nope", "parameters": {}}],
                [{"name": "book", "parameters": {"slot": {"day": "Mon"}}}],
                [{"name": "get_weather", "parameters": {"city": "x", "unit": "kelvin"}}],
                [{"name": "now", "parameters": {}, "extra": 1}], {"name": "now"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    content, calls = parser_for_plan(plan, "hermes").extract(json.dumps(output))
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == \
        [(o["name"], o["parameters"]) for o in output]


def test_required_schema_without_parallel_calls():
    schema = plan_tool_choice(TOOLS, "required", auto_enabled=True,
                              parallel_tool_calls=False).schema
    jsonschema.validate([{"name": "now", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "now", "parameters": {}}] * 2, schema)


def test_named_schema_is_the_parameters():
    plan = plan_tool_choice(TOOLS, {"type": "function", "function": {"name": "book"}},
                            auto_enabled=False)
    assert plan.mode == "named" and plan.function.name == "book"
    jsonschema.validate({"slot": {"day": "Tue", "hour": 3}}, plan.schema)
    parser = parser_for_plan(plan, None)
    parser.feed('{"slot": {"day": "Tue", "hour": 3}}')
    parser.finish()
    content, calls = parser.result()
    assert (content, [(c.name, c.arguments) for c in calls]) == \
        (None, [("book", '{"slot": {"day": "Tue", "hour": 3}}')])
    assert plan_tool_choice(TOOLS, {"type": "function", "function": {"name": "now"}},
                            auto_enabled=False).schema == {"type": "object", "properties": {}}


def test_plan_modes():
    assert plan_tool_choice(TOOLS, None, auto_enabled=True).mode == "auto"
    assert plan_tool_choice(TOOLS, None, auto_enabled=False).mode == "none"
    assert plan_tool_choice(None, None, auto_enabled=True).mode == "none"
    assert plan_tool_choice(TOOLS, "none", auto_enabled=False).mode == "none"
    assert parser_for_plan(plan_tool_choice(TOOLS, "none", auto_enabled=True), "hermes") is None
    assert isinstance(parser_for_plan(plan_tool_choice(TOOLS, "auto", auto_enabled=True),
                                      "llama3_json"), Llama3JsonToolParser)
    mistral_required = parser_for_plan(plan_tool_choice(TOOLS, "required", auto_enabled=True),
                                       "mistral")
    mistral_required.feed('[{"name": "now", "parameters": {}}]')
    mistral_required.finish()
    assert len(mistral_required.result().tool_calls[0].id) == 9


def test_auto_without_parallel_calls_keeps_the_first_call():
    """`parallel_tool_calls: false` with `auto`: a second call the model writes is parsed
    (its text is not content) and dropped, streamed or not."""
    text = ('Sure.\n<tool_call>{"name": "a", "arguments": {"k": 1}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    plan = plan_tool_choice(TOOLS, "auto", auto_enabled=True, parallel_tool_calls=False)
    whole = parser_for_plan(plan, "hermes")
    whole.feed(text)
    whole.finish()
    content, calls = whole.result()
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == [("a", '{"k": 1}')]
    for size in (1, 3, 7):
        streamed = parser_for_plan(plan, "hermes")
        got_content, got_calls = reassemble(streamed, [text[i:i + size]
                                                       for i in range(0, len(text), size)])
        assert got_content == "Sure." and [(n, a) for _, n, a in got_calls] == [("a", '{"k": 1}')]
    both = parser_for_plan(plan_tool_choice(TOOLS, "auto", auto_enabled=True), "hermes")
    both.feed(text)
    both.finish()
    assert [c.name for c in both.result().tool_calls] == ["a", "b"]


def test_required_with_an_empty_tools_list_is_none():
    """vLLM's check_tool_usage (OpenAI's behaviour): `tools: []` with "required" is
    "none", not a 400 (review finding 9)."""
    plan = plan_tool_choice([], "required", auto_enabled=True)
    assert plan.mode == "none" and plan.schema is None and plan.tools == ()


@pytest.mark.parametrize(("tools", "choice", "param"), [
    (TOOLS, "auto", "tool_choice"),                      # auto without the flags
    (None, "required", "tool_choice"),
    ([], "auto", "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice.function.name"),
    ("get_weather", "required", "tools"),
    ([{"type": "retrieval"}], "required", "tools.0.type"),
    ([{"type": "function", "function": {"description": "no name"}}], "required",
     "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "object"}}], "required",
     "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], "required",
     "tools.0.function.strict"),
    ([{"type": "function", "function": {"name": "a", "parameters": {
        "$defs": {"x": {"type": "string"}}}}},
      {"type": "function", "function": {"name": "b", "parameters": {
          "$defs": {"x": {"type": "integer"}}}}}],
     "required", "tools.1.function.parameters"),
])
def test_bad_tools_and_tool_choice_name_the_field(tools, choice, param):
    with pytest.raises(ToolChoiceError) as err:
        plan_tool_choice(tools, choice, auto_enabled=False)
    assert err.value.param == param
    assert isinstance(err.value, ValueError)


def test_parse_tools_defaults():
    tools = parse_tools([{"type": "function", "function": {"name": "f"}}])
    assert tools[0].parameters == {"type": "object", "properties": {}}
    assert tools[0].description is None


FRAGMENTS = ["<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]",
             "[CALL_ID]", "{", "}", "[", "]", '"name"', '"arguments"', '"parameters"', ":",
             ",", ";", '"f"', '"a\\"}"', "\\", '"', " ", "\n", "1", "true", "x", "<", "</"]


@pytest.mark.parametrize("cls", [HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                                 RequiredToolParser])
def test_random_texts_never_raise_and_stream_like_whole(cls):
    """Seeded random mixes of the formats' pieces: every outcome is well defined."""
    import random
    rng = random.Random(cls.__name__)
    calls_seen = 0
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 30)))
        if rng.random() < 0.5:          # and some that are nearly right
            text = rng.choice(["<tool_call>", "[TOOL_CALLS][", "", "["]) + \
                '{"name": "f", "arguments": ' + text
        elif rng.random() < 0.3:
            text = "[TOOL_CALLS]f" + rng.choice(["", "[ARGS]"]) + "{" + text
        content, calls = whole(cls, text)
        calls_seen += bool(calls)
        if cls is RequiredToolParser:
            assert content is None, "forced JSON is never content"
        elif not calls:
            assert content == text
        for chunks in list(chunkings(text, random_cuts=5))[::7]:
            assert reassemble(cls(id_factory=counter_ids()), chunks) == (content or "", calls)
    assert calls_seen > 0
