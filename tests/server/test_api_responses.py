"""`POST /v1/responses` (OpenAI's Responses API) against a real uvicorn server on
loopback with a tiny model and the official `openai` client: it is served by the chat
path, so greedy (or seeded) output equals `/v1/chat/completions`' for the same
messages; tools, structured output, reasoning, streaming events, and a 400 naming the
field for everything that cannot be honoured."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.server.helpers_serve import API_KEY, ThreadServer

AUTH = {"Authorization": f"Bearer {API_KEY}"}
WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": WEATHER_PARAMS, "strict": True}
CHAT_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_PARAMS,
    "strict": True}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def srv(tools_model):
    server = ThreadServer(tools_model, api_key=API_KEY, max_model_len=1024, max_num_seqs=8,
                          enable_auto_tool_choice=True, tool_call_parser="hermes").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat(client, messages, **kw):
    return client.chat.completions.create(model="tiny", messages=messages, **kw)


def post(srv, body, path="/v1/responses"):
    return httpx.post(srv.url + path, json=body, headers=AUTH, timeout=60)


# -- text ---------------------------------------------------------------------------------
def test_greedy_text_and_usage_equal_chat(client):
    r = client.responses.create(model="tiny", input="The scheduler sends a batch",
                                max_output_tokens=12, temperature=0)
    c = chat(client, [{"role": "user", "content": "The scheduler sends a batch"}],
             max_tokens=12, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert r.output_text == c.choices[0].message.content and r.output_text
    msg = r.output[-1]
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].type == "output_text"
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.input_tokens_details.cached_tokens >= 0
    assert r.status == ("incomplete" if c.choices[0].finish_reason == "length" else "completed")
    assert r.temperature == 0 and r.max_output_tokens == 12 and r.store is False


def test_instructions_are_a_system_message_first(client):
    r = client.responses.create(model="tiny", instructions="Answer in French.",
                                input="Where is the cache?", max_output_tokens=10,
                                temperature=0)
    c = chat(client, [{"role": "system", "content": "Answer in French."},
                      {"role": "user", "content": "Where is the cache?"}],
             max_tokens=10, temperature=0)
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.instructions == "Answer in French."
    bare = client.responses.create(model="tiny", input="Where is the cache?",
                                   max_output_tokens=10, temperature=0)
    assert bare.usage.input_tokens < r.usage.input_tokens


def test_multi_turn_input_items_equal_the_chat_messages(client):
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Hi"},
                     {"type": "input_text", "text": "there"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "user", "content": "What is a block?"}]
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "Hi\nthere"},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "What is a block?"}]
    r = client.responses.create(model="tiny", input=items, max_output_tokens=10,
                                temperature=0)
    c = chat(client, messages, max_tokens=10, temperature=0)
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens


def test_max_output_tokens_is_incomplete(client):
    r = client.responses.create(model="tiny", input="Count to one hundred",
                                max_output_tokens=2, temperature=0,
                                metadata={"k": "v"}, user="u1")
    assert r.status == "incomplete", r
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2
    assert r.metadata == {"k": "v"} and r.user == "u1"


# -- tools --------------------------------------------------------------------------------
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_function_tool_round_trip(client, choice):
    r = client.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER],
                                tool_choice=choice, parallel_tool_calls=False,
                                temperature=1.0, max_output_tokens=200,
                                extra_body={"seed": 3})
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed", r
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    assert r.tools[0].name == "get_weather"

    # The same call in chat, with the same seed: the mapping is the chat path.
    chat_choice = choice if choice == "required" else {
        "type": "function", "function": {"name": "get_weather"}}
    c = chat(client, [{"role": "user", "content": "Weather in Paris?"}],
             tools=[CHAT_WEATHER], tool_choice=chat_choice, parallel_tool_calls=False,
             temperature=1.0, max_tokens=200, seed=3)
    assert [(t.function.name, t.function.arguments) for t in c.choices[0].message.tool_calls] \
        == [(x.name, x.arguments) for x in calls]

    # Feed the result back: function_call + function_call_output items are the
    # assistant tool call and the tool message.
    follow = [{"role": "user", "content": "Weather in Paris?"},
              {"type": "function_call", "call_id": call.call_id, "name": call.name,
               "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id,
               "output": "sunny, 21C"}]
    r2 = client.responses.create(model="tiny", input=follow, tools=[WEATHER],
                                 tool_choice="none", max_output_tokens=8, temperature=0)
    c2 = chat(client, [{"role": "user", "content": "Weather in Paris?"},
                       {"role": "assistant", "content": None, "tool_calls": [{
                           "id": call.call_id, "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}}]},
                       {"role": "tool", "tool_call_id": call.call_id,
                        "content": "sunny, 21C"}],
              tools=[CHAT_WEATHER], tool_choice="none", max_tokens=8, temperature=0)
    assert r2.output_text == c2.choices[0].message.content
    assert r2.usage.input_tokens == c2.usage.prompt_tokens > r.usage.input_tokens


def test_json_schema_text_format_parses_and_validates(client):
    fmt = {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}
    for seed in range(2):
        r = client.responses.create(model="tiny", input="a number", text={"format": fmt},
                                    temperature=1.0, max_output_tokens=200,
                                    extra_body={"seed": seed})
        assert r.status == "completed", r
        jsonschema.validate(json.loads(r.output_text), SCHEMA)
        c = chat(client, [{"role": "user", "content": "a number"}], temperature=1.0,
                 max_tokens=200, seed=seed, response_format={
                     "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                            "strict": True}})
        assert r.output_text == c.choices[0].message.content
        assert r.text.format.type == "json_schema"


# -- streaming ----------------------------------------------------------------------------
def test_stream_assembles_the_same_response(client):
    """A response that completes (the JSON grammar ends it): the client's stream
    helper assembles the non-streamed response from the events."""
    fmt = {"type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}
    kw = dict(model="tiny", input="a number", text={"format": fmt}, temperature=1.0,
              max_output_tokens=200, extra_body={"seed": 1})
    whole = client.responses.create(**kw)
    assert whole.status == "completed"
    with client.responses.stream(**kw) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas) == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.status == "completed"


def test_stream_events_of_a_response_cut_by_max_output_tokens(client):
    """OpenAI's event sequence, numbered; a response cut by the limit ends with
    `response.incomplete` (as OpenAI's does) carrying the same text."""
    kw = dict(model="tiny", input="The scheduler sends a batch", max_output_tokens=12,
              temperature=0)
    whole = client.responses.create(**kw)
    assert whole.status == "incomplete"
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-4].text == whole.output_text
    last = events[-1].response
    assert last.output_text == whole.output_text and last.status == "incomplete"
    assert last.incomplete_details.reason == "max_output_tokens"
    assert last.output[0].id == events[2].item.id == events[-2].item.id
    assert last.usage.output_tokens == 12


def test_streamed_function_call_arguments(client):
    kw = dict(model="tiny", input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
              parallel_tool_calls=False, temperature=1.0, max_output_tokens=200,
              extra_body={"seed": 5})
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        args = "".join(e.delta for e in stream
                       if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    want = [(o.name, o.arguments) for o in whole.output if o.type == "function_call"]
    got = [(o.name, o.arguments) for o in final.output if o.type == "function_call"]
    assert got == want and args == want[0][1]


def raw_events(srv, body: dict) -> list[dict]:
    """The SSE events of a streamed request, as sent (`event:` name = its `type`)."""
    events, name = [], None
    with httpx.stream("POST", srv.url + "/v1/responses", json={**body, "stream": True},
                      headers=AUTH, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
                assert events[-1]["type"] == name
    return events


def without_ids(output: list[dict]) -> list[dict]:
    return [{k: v for k, v in o.items() if k not in ("id", "call_id")} for o in output]


STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.mark.parametrize("kw", [
    dict(input="The scheduler sends a batch", max_output_tokens=12, temperature=0),
    # several calls, the last one cut by the limit: only that one is incomplete
    dict(input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
         parallel_tool_calls=True, temperature=1.0, max_output_tokens=100, seed=7),
    dict(input="a number", temperature=1.0, max_output_tokens=200, seed=1,
         text={"format": {"type": "json_schema", "name": "x", "schema": SCHEMA,
                          "strict": True}}),
])
def test_strictly_valid_events_and_the_stream_ends_with_the_whole_output(srv, kw):
    """Every body validates (strictly) as the openai client's types; the events are
    numbered, their item ids and indexes agree, and `response.completed`/`incomplete`
    carries the output (statuses included) the non-streamed request returns."""
    body = {"model": "tiny", **kw}
    r = post(srv, body)
    assert r.status_code == 200, r.text
    whole = r.json()
    Response.model_validate(whole)
    events = raw_events(srv, body)
    for e in events:
        STREAM_EVENT.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    ids = {}
    for e in events:
        if e["type"] == "response.output_item.added":
            ids[e["output_index"]] = e["item"]["id"]
        elif "output_index" in e:
            assert ids[e["output_index"]] == e.get("item_id", e.get("item", {}).get("id")), e
    final = events[-1]["response"]
    Response.model_validate(final)
    if "tools" in kw:
        assert len(whole["output"]) >= 2 and whole["status"] == "incomplete", whole
        assert [o["status"] for o in whole["output"]][-2:] == ["completed", "incomplete"]
    assert without_ids(final["output"]) == without_ids(whole["output"])
    for k in ("status", "incomplete_details", "tools", "tool_choice", "text", "temperature",
              "top_p", "max_output_tokens", "parallel_tool_calls"):
        assert final[k] == whole[k], k
    assert final["usage"]["output_tokens"] == whole["usage"]["output_tokens"]


# -- what is refused ----------------------------------------------------------------------
@pytest.mark.parametrize("extra,param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"truncation": "auto"}, "truncation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.0.type"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools.0.type"),
    ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools.0.type"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "https://x/y.png"}]}]}, "input.0.content.0.type"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0.type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"reasoning": {"effort": "xhigh"}}, "reasoning.effort"),
    # the template does not read reasoning_effort: it could not change the output
    ({"reasoning": {"effort": "low"}}, "reasoning.effort"),
    ({"text": {"format": {"type": "text"}, "verbosity": "low"}}, "text.verbosity"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"tool_choice": "auto", "tools": [WEATHER], "max_output_tokens": 4,
      "input": [{"type": "function_call", "call_id": "c", "name": "f",
                 "arguments": "not json"}]}, "input.0.arguments"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 5000}, "input"),     # chat's context rule names the messages
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name"),
    ({"tools": [{**WEATHER, "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(?<=a)b"}}}}], "tool_choice": "required"},
     "tools.0.parameters"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"input": []}, "input"),
    ({"model": "gpt-4o"}, "model"),
])
def test_unsupported_is_a_400_naming_the_field(srv, extra, param):
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, **extra}
    r = post(srv, body)
    status = 404 if param == "model" else 400
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    if status == 400 and param != "input":
        assert err["message"].startswith(param.split(".")[0]), err


def test_store_false_and_empty_include_pass(srv):
    r = post(srv, {"model": "tiny", "input": "hi", "max_output_tokens": 2, "store": False,
                   "include": [], "truncation": "disabled"})
    assert r.status_code == 200, r.text
    assert r.json()["store"] is False


def test_openai_client_raises_bad_request_and_server_stays_healthy(srv, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_x")
    assert "previous_response_id" in str(e.value)
    for body in (b"", b"{", b'{"input": 3}', b'{"input": [1]}', b'{"input": [{"type": 5}]}',
                 b'{"input": "x", "tools": [{"type": "function"}]}'):
        r = httpx.post(srv.url + "/v1/responses", content=body,
                       headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 400, (body, r.text)
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
    assert client.responses.create(model="tiny", input="hi", max_output_tokens=2).output_text \
        is not None


@pytest.mark.parametrize("item,param", [
    ({"type": "reasoning", "content": 5}, "input.0.content"),
    ({"type": "reasoning", "summary": True}, "input.0.summary"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 100_000},
     "input.0.arguments"),
])
def test_malformed_input_items_are_400s_not_500s(srv, item, param):
    r = post(srv, {"model": "tiny", "input": [item, {"role": "user", "content": "hi"}],
                   "max_output_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    if item["type"] == "function_call":
        # the chat path the item maps onto checks a tool call's arguments the same way
        c = httpx.post(srv.url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
            "model": "tiny", "max_tokens": 2, "messages": [
                {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                      "function": {"name": "f",
                                                                   "arguments": item["arguments"]}}]},
                {"role": "user", "content": "hi"}]})
        assert c.status_code == 400, c.text
        assert c.json()["error"]["param"] == "messages.0.tool_calls.0.function.arguments"
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_an_output_for_no_call_is_a_400_naming_its_call_id(srv):
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    answer = {"type": "function_call_output", "call_id": "c2", "output": "x"}
    r = post(srv, {"model": "tiny", "max_output_tokens": 2, "input": [
        {"role": "user", "content": "hi"}, call, answer]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input.2.call_id" and "'c2'" in err["message"], err
    # an output before its call is as unanswerable
    r = post(srv, {"model": "tiny", "max_output_tokens": 2, "input": [
        {"role": "user", "content": "hi"}, dict(answer, call_id="c1"), call]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.1.call_id", r.text
    r = post(srv, {"model": "tiny", "max_output_tokens": 2, "input": [
        {"role": "user", "content": "hi"}, call, dict(answer, call_id="c1")]})
    assert r.status_code == 200, r.text


def test_too_long_input_names_the_input_not_messages(srv):
    r = post(srv, {"model": "tiny", "input": "word " * 3000, "max_output_tokens": 4})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input" and "maximum context length is 1024" in err["message"]
    assert "messages" not in err["message"] and "in the input" in err["message"], err


def test_an_error_after_the_stream_began_ends_with_response_failed(srv):
    """A grammar dead end after three forced tokens (`"ab`): the stream has begun, so the error comes
    in-band, then `response.failed` carrying the text so far (its item incomplete) and
    the error; every event valid as the client's types."""
    schema = {"type": "string", "pattern": "^ab[^\\s\\S]"}
    events = raw_events(srv, {"model": "tiny", "input": "x", "max_output_tokens": 30,
                              "text": {"format": {"type": "json_schema", "name": "s",
                                                  "schema": schema, "strict": True}}})
    for e in events:
        STREAM_EVENT.validate_python(e)
    kinds = [e["type"] for e in events]
    assert kinds[-5:] == ["error", "response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.failed"], kinds
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "failed" and final.error.code == "invalid_prompt", final
    assert final.error.message == events[-5]["message"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text and final.output[0].status == "incomplete"
    assert final.output[0].content[0].text == text
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_retrieve_is_an_openai_404_and_the_key_is_required(srv, client):
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_abc")
    r = httpx.get(srv.url + "/v1/responses/resp_abc", headers=AUTH, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    assert "resp_abc" in r.json()["error"]["message"] and "not stored" in r.text
    assert httpx.post(srv.url + "/v1/responses", json={"input": "hi"},
                      timeout=10).status_code == 401
    assert httpx.get(srv.url + "/v1/responses/resp_abc", timeout=10).status_code == 401


# -- reasoning ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def r1_srv(tools_model):
    server = ThreadServer(tools_model, max_model_len=1024, reasoning_parser="deepseek_r1").start()
    yield server
    server.stop()


def test_reasoning_item_equals_chat_reasoning_content(r1_srv):
    c = openai.OpenAI(base_url=r1_srv.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model="tiny", input="why?", max_output_tokens=16, temperature=0)
    r = c.responses.create(**kw)
    msg = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "why?"}],
                                    max_tokens=16, temperature=0).choices[0].message
    chat_reasoning = msg.model_extra.get("reasoning_content")
    items = {o.type: o for o in r.output}
    assert chat_reasoning, msg          # the r1 prompt starts inside the reasoning
    assert items["reasoning"].content[0].text == chat_reasoning
    assert r.output_text == (msg.content or "")
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens
    with c.responses.stream(**kw) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
    assert deltas == chat_reasoning


def test_vllm_sampling_extras_are_honoured_and_chat_names_are_refused(client, srv):
    """vLLM's sampling extras (not OpenAI's Responses fields) reach the sampler as on
    chat: a stop string cuts the text where chat's does, a penalty changes what chat's
    does; chat's own names for Responses fields are 400s naming the field to use."""
    prompt = "The scheduler sends a batch"
    free = chat(client, [{"role": "user", "content": prompt}], max_tokens=16, temperature=0)
    text = free.choices[0].message.content
    stop = text.strip()[len(text.strip()) // 2:][:2]
    assert stop
    for extra in ({"stop": [stop]}, {"repetition_penalty": 1.8, "top_k": 3},
                  {"frequency_penalty": 1.5, "min_tokens": 4}):
        r = client.responses.create(model="tiny", input=prompt, max_output_tokens=16,
                                    temperature=0, extra_body=extra)
        c = chat(client, [{"role": "user", "content": prompt}], max_tokens=16, temperature=0,
                 extra_body=extra)
        assert r.output_text == c.choices[0].message.content, extra
    cut = client.responses.create(model="tiny", input=prompt, max_output_tokens=16,
                                  temperature=0, extra_body={"stop": [stop]})
    assert stop not in cut.output_text and len(cut.output_text) < len(text)
    bad = post(srv, {"model": "tiny", "input": prompt, "top_k": -5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_k", bad.text
    for field, value, hint in (("max_tokens", 8, "max_output_tokens"),
                               ("messages", [{"role": "user", "content": "x"}], "input"),
                               ("response_format", {"type": "json_object"}, "text.format"),
                               ("n", 2, "n > 1"), ("logprobs", True, "/v1/chat/completions")):
        r = post(srv, {"model": "tiny", "input": prompt, field: value})
        assert r.status_code == 400, (field, r.text)
        err = r.json()["error"]
        assert err["param"] == field and hint in err["message"], err
    ok = post(srv, {"model": "tiny", "input": prompt, "n": 1, "logprobs": False,
                    "max_output_tokens": 2})
    assert ok.status_code == 200, ok.text
