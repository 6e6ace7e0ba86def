"""Pure parts of /v1/responses: input items -> chat messages, errors renamed to the
Responses fields, and the streamed event state machine."""

from __future__ import annotations

import pytest

from pagefleet.server.api.errors import APIError
from pagefleet.server.api.responses_input import (input_messages, to_chat_request,
                                                  to_responses_error)
from pagefleet.server.api.responses_protocol import ResponsesRequest
from pagefleet.server.api.responses_stream import ResponseEvents
from pagefleet.server.api.tool_parsers import ToolCallDelta


def req(**kw) -> ResponsesRequest:
    return ResponsesRequest.model_validate(kw)


def test_items_become_chat_turns():
    msgs = input_messages(req(instructions="sys", input=[
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "let me look"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a":1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "two"}]}]))
    assert msgs == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "let me look", "reasoning_content": "think",
         "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
             {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"a":1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"}]


def test_flat_tools_choice_and_format_map_onto_chat():
    chat = to_chat_request(req(
        input="x", max_output_tokens=7, tools=[{"type": "function", "name": "f",
                                                 "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "f"}, parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}}))
    assert chat.max_completion_tokens == 7 and chat.parallel_tool_calls is False
    assert chat.tools == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.response_format == {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object"}}}


@pytest.mark.parametrize("chat_param,param", [
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("tools.1.function.parameters", "tools.1.parameters"),
    ("tool_choice.function.name", "tool_choice.name"), ("messages", "input"),
    ("temperature", "temperature")])
def test_chat_errors_name_the_responses_field(chat_param, param):
    err = to_responses_error(APIError(400, f"{chat_param}: bad", chat_param))
    assert (err.param, err.message) == (param, f"{param}: bad")


def test_events_open_one_item_at_a_time_in_output_order():
    ev = ResponseEvents()
    out = ev.start({"id": "resp_1", "status": "in_progress", "output": []})
    out += ev.reasoning("hm") + ev.reasoning("m") + ev.text("Hi") + ev.text("!")
    out += ev.call(ToolCallDelta(0, id="call_a", name="f", arguments='{"a"'))
    out += ev.call(ToolCallDelta(0, arguments=":1}"))
    out += ev.call(ToolCallDelta(1, id="call_b", name="g", arguments="{}"))
    out += ev.finish({"id": "resp_1", "status": "completed"})
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    final = out[-1]["response"]["output"]
    assert [i["type"] for i in final] == ["reasoning", "message", "function_call",
                                         "function_call"]
    assert final[0]["content"][0]["text"] == "hmm"
    assert final[1]["content"][0]["text"] == "Hi!"
    assert (final[2]["call_id"], final[2]["name"], final[2]["arguments"]) == \
        ("call_a", "f", '{"a":1}')
    assert (final[3]["call_id"], final[3]["arguments"]) == ("call_b", "{}")
    added = [e for e in out if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1, 2, 3]
    assert [e["item"]["id"] for e in added] == [i["id"] for i in final]


def test_a_cut_response_ends_incomplete_and_an_empty_one_has_a_message():
    ev = ResponseEvents()
    out = ev.text("ab") + ev.finish({"status": "incomplete"})
    assert out[-1]["type"] == "response.incomplete"
    assert out[-1]["response"]["output"][0]["status"] == "incomplete"
    ev = ResponseEvents()
    out = ev.ensure_output() + ev.finish({"status": "completed"})
    assert out[-1]["response"]["output"][0]["content"][0]["text"] == ""


def test_an_output_must_answer_an_earlier_call():
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    with pytest.raises(APIError) as e:
        input_messages(req(input=[{"type": "function_call_output", "call_id": "c1",
                                   "output": "x"}, call]))
    assert (e.value.status, e.value.param) == (400, "input.0.call_id")
    assert "'c1'" in e.value.message


def test_context_length_wording_speaks_of_the_input():
    from pagefleet.server.engine.validation import PromptTooLongError
    for max_tokens in (None, 10):
        chat = PromptTooLongError(2000, max_tokens, 1024)
        err = to_responses_error(APIError(400, str(chat), chat.param))
        assert err.param == "input" and "messages" not in err.message, err.message
        assert "maximum context length is 1024" in err.message


def test_fail_closes_the_open_item_incomplete_and_ends_failed():
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter
    body = {"id": "resp_1", "object": "response", "created_at": 0, "status": "in_progress",
            "model": "m", "output": [], "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": [], "error": None, "incomplete_details": None, "instructions": None,
            "metadata": {}, "temperature": 1.0, "top_p": 1.0}
    ev = ResponseEvents()
    out = ev.start(dict(body)) + ev.text("ab")
    out += ev.fail(dict(body), 400, "no token allowed", None)
    assert [e["type"] for e in out][-4:] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.failed"]
    adapter = TypeAdapter(ResponseStreamEvent)
    for e in out:
        adapter.validate_python(e)
    final = Response.model_validate(out[-1]["response"])
    assert final.status == "failed" and final.error.code == "invalid_prompt"
    assert final.output[0].status == "incomplete" and final.output[0].content[0].text == "ab"
    assert ev.fail(dict(body), 503, "engine died")[-1]["response"]["error"]["code"] \
        == "server_error"
    assert ev.fail(dict(body), 429, "busy")[-1]["response"]["error"]["code"] \
        == "rate_limit_exceeded"
