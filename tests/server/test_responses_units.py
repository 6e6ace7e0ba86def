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
