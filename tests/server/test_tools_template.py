"""The tools-capable ChatML template of the tiny models, rendered by transformers.

A tiny model built with `chat_template=TOOLS_CHAT_TEMPLATE` must render `tools`,
assistant `tool_calls` and `role: tool` results (with their `tool_call_id`) through
`apply_chat_template`, both directly and through the server's `render_chat` (which
passes unknown message fields such as `tool_calls` on to the template), and the calls
it renders must parse back with the `hermes` parser.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from pagefleet.server.api.chat import render_chat
from pagefleet.server.api.protocol import ChatMessage
from pagefleet.server.api.tool_parsers import HermesToolParser
from pagefleet.server.chat_templates import TOOLS_CHAT_TEMPLATE
from pagefleet.server.testing import CHAT_TEMPLATE, build_tiny_model

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Lyon?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "18C, rain"},
    {"role": "assistant", "content": "Paris is warmer."},
    {"role": "user", "content": "Thanks!"},
]

EXPECTED = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist "
    "with the user query.\n\nYou are provided with function signatures within <tools></tools> "
    "XML tags:\n<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>\n\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> XML "
    'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\nWeather in Paris and Lyon?<|im_end|>\n"
    "<|im_start|>assistant\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
    "<|im_end|>\n"
    '<|im_start|>user\n<tool_response id="call_1">\n22C, sunny\n</tool_response>\n'
    '<tool_response id="call_2">\n18C, rain\n</tool_response><|im_end|>\n'
    "<|im_start|>assistant\nParis is warmer.<|im_end|>\n"
    "<|im_start|>user\nThanks!<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("tools-model"), "qwen3", num_layers=1,
                            hidden_size=32, num_heads=2, num_kv_heads=1,
                            chat_template=TOOLS_CHAT_TEMPLATE)
    return AutoTokenizer.from_pretrained(str(path))


def test_renders_tools_calls_and_results(tokenizer):
    assert tokenizer.chat_template == TOOLS_CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False,
                                         add_generation_prompt=True)
    assert text == EXPECTED


def test_through_the_servers_render_chat(tokenizer):
    """The server's path: pydantic messages, extra fields kept, tools as a template kwarg."""
    messages = [ChatMessage.model_validate(m) for m in CONVERSATION]
    text = render_chat(tokenizer, messages, template=None, add_generation_prompt=True,
                       continue_final_message=False, kwargs={"tools": TOOLS})
    assert text == EXPECTED
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_rendered_calls_parse_back_with_hermes(tokenizer):
    """What the template shows the model as a call is what the hermes parser reads."""
    text = tokenizer.apply_chat_template(CONVERSATION[:3], tools=TOOLS, tokenize=False)
    turn = text.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    content, calls = HermesToolParser.extract(turn)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})]


def test_without_tools_it_is_plain_chatml(tokenizer, tmp_path):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                    "<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>assistant\n")
    # the default tiny model keeps its plain template
    plain = AutoTokenizer.from_pretrained(str(build_tiny_model(
        tmp_path, "qwen3", num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1)))
    assert plain.chat_template == CHAT_TEMPLATE
    assert plain.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == text


def test_thinking_switch_and_reasoning_history(tokenizer):
    user = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=True).endswith("<|im_start|>assistant\n")
    text = tokenizer.apply_chat_template(
        [*user, {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."}],
        tokenize=False)
    assert text.endswith("<|im_start|>assistant\n<think>\nGreet back.\n</think>\n\nHello."
                         "<|im_end|>\n")
    newer = tokenizer.apply_chat_template(
        [*user, {"role": "assistant", "content": "Hello.", "reasoning": "Greet back."}],
        tokenize=False)
    assert newer == text


def test_continue_final_message(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
        tokenize=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nHel")


# Excerpts of real templates that read a call's arguments as a mapping (review finding 1):
# Llama 3.1's and vLLM's tool_chat_template_llama3.1_json.jinja (`arguments | tojson`),
# and Qwen3-Coder's (`arguments | items`).
CALLS_TEMPLATE = (
    "{%- for message in messages -%}<|im_start|>{{ message.role }}\n"
    "{% if message.tool_calls -%}{%- for tc in message.tool_calls -%}"
    "{%- set tool_call = tc.function -%}CALL{%- endfor -%}"
    "{%- elif message.tool_calls is defined -%}EMPTY-LIST"
    "{%- else -%}{{ message.content }}{%- endif -%}<|im_end|>\n{% endfor -%}")
LLAMA_CALL = ('{"name": "{{ tool_call.name }}", "parameters": '
              '{{ tool_call.arguments | tojson }}}')
CODER_CALL = ("<function={{ tool_call.name }}>{%- for k, v in tool_call.arguments|items -%}"
              "<parameter={{ k }}>{{ v }}</parameter>{%- endfor -%}</function>")


def history(*arguments, calls=True):
    tool_calls = [{"id": f"call_{k}", "type": "function",
                   "function": {"name": "get_weather", **({} if a is None else
                                                          {"arguments": a})}}
                  for k, a in enumerate(arguments)] if calls else []
    return [ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": tool_calls},
        {"role": "tool", "tool_call_id": "call_0", "content": "21C"}]]


@pytest.mark.parametrize("call,expected", [
    (LLAMA_CALL, '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    (CODER_CALL, "<function=get_weather><parameter=city>Paris</parameter></function>"),
])
def test_history_arguments_reach_the_template_as_a_mapping(tokenizer, call, expected):
    """OpenAI clients send `arguments` as a JSON string; templates get the object, as
    vLLM's _postprocess_messages gives it (it was encoded twice, or a 400, before)."""
    template = CALLS_TEMPLATE.replace("CALL", call)
    text = render_chat(tokenizer, history('{"city": "Paris"}'), template=template,
                       add_generation_prompt=False, continue_final_message=False)
    assert f"<|im_start|>assistant\n{expected}<|im_end|>" in text, text
    # empty or missing arguments are {}; a dict stays as it is
    text = render_chat(tokenizer, history("", None, {"city": "Lima"}),
                       template=CALLS_TEMPLATE.replace("CALL", LLAMA_CALL),
                       add_generation_prompt=False, continue_final_message=False)
    assert text.count('"parameters": {}') == 2 and '"parameters": {"city": "Lima"}' in text
    # an empty tool_calls list is dropped: the template takes the plain assistant path
    text = render_chat(tokenizer, history(calls=False), template=template,
                       add_generation_prompt=False, continue_final_message=False)
    assert "EMPTY-LIST" not in text and "<|im_start|>assistant\n<|im_end|>" in text


def test_history_arguments_that_are_not_json_are_a_400(tokenizer):
    from pagefleet.server.api.errors import APIError
    with pytest.raises(APIError) as err:
        render_chat(tokenizer, history('{"city": "Par'), template=None,
                    add_generation_prompt=True, continue_final_message=False)
    assert err.value.status == 400
    assert err.value.param == "messages.1.tool_calls.0.function.arguments"
