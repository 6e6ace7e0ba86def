"""Streamed `/v1/responses`: the semantic SSE events, built from the chat path's deltas.

`ResponseEvents` is a pure state machine. The handler feeds it what each engine step
adds after the reasoning and tool parsers (`reasoning(text)`, `text(text)`,
`call(ToolCallDelta)`) and it answers with the events OpenAI sends, each with its
`sequence_number`:

    response.created, response.in_progress
    response.output_item.added            (reasoning | message | function_call)
      response.content_part.added         (message: output_text; reasoning: reasoning_text)
      response.output_text.delta ... / response.reasoning_text.delta ...
      response.function_call_arguments.delta ...
      response.output_text.done / response.reasoning_text.done
      response.content_part.done / response.function_call_arguments.done
    response.output_item.done
    response.completed                    (response.incomplete when cut by the limit)

An error once the stream has begun is an `error` event, then `response.failed` with the
items so far (the open one incomplete) and the response's `error`.

One item is open at a time: output of another kind (or a new tool call) closes it and
opens the next, so the items come in the order the model wrote them. The final
response carries exactly the items the events built.
"""

from __future__ import annotations

from pagefleet.server.api.responses_output import (function_call_item, message_item,
                                                   new_id, output_text_part, reasoning_item)


class ResponseEvents:
    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict] = []        # finished items, in output order
        self._open: dict | None = None     # {"kind", "id", "index", "text", ...}
        self._call_index: int | None = None

    def event(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self, response: dict) -> list[dict]:
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    # -- items -------------------------------------------------------------------------
    def _open_item(self, kind: str, item: dict, **state) -> list[dict]:
        index = len(self.items)
        self._open = {"kind": kind, "id": item["id"], "index": index, "text": "", **state}
        out = [self.event("response.output_item.added", output_index=index, item=item)]
        part = {"message": output_text_part(""),
                "reasoning": {"type": "reasoning_text", "text": ""}}.get(kind)
        if part is not None:
            out.append(self.event("response.content_part.added", item_id=item["id"],
                                  output_index=index, content_index=0, part=part))
        return out

    def close(self, status: str = "completed") -> list[dict]:
        """Close the open item, if any (its done events)."""
        o = self._open
        if o is None:
            return []
        self._open = None
        where = {"item_id": o["id"], "output_index": o["index"]}
        out = []
        if o["kind"] == "message":
            item = message_item(o["id"], o["text"], status)
            out.append(self.event("response.output_text.done", **where, content_index=0,
                                  text=o["text"], logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part=output_text_part(o["text"])))
        elif o["kind"] == "reasoning":
            item = reasoning_item(o["id"], o["text"], status)
            out.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                  text=o["text"]))
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part={"type": "reasoning_text", "text": o["text"]}))
        else:
            item = function_call_item(o["id"], o["call_id"], o["name"], o["text"], status)
            out.append(self.event("response.function_call_arguments.done", **where,
                                  name=o["name"], arguments=o["text"]))
        out.append(self.event("response.output_item.done", output_index=o["index"],
                              item=item))
        self.items.append(item)
        return out

    def _ensure(self, kind: str) -> list[dict]:
        if self._open is not None and self._open["kind"] == kind:
            return []
        out = self.close()
        if kind == "message":
            item = message_item(new_id("msg"), None, "in_progress")
        else:
            item = reasoning_item(new_id("rs"), "", "in_progress")
        return out + self._open_item(kind, item)

    # -- what the parsers produce ----------------------------------------------------------
    def _delta(self, kind: str, event: str, text: str, **extra) -> list[dict]:
        """`text` added to the open `kind` item (opened first if need be), as `event`."""
        if not text:
            return []
        out = self._ensure(kind)
        self._open["text"] += text
        return out + [self.event(event, item_id=self._open["id"],
                                 output_index=self._open["index"], content_index=0,
                                 delta=text, **extra)]

    def reasoning(self, text: str) -> list[dict]:
        return self._delta("reasoning", "response.reasoning_text.delta", text)

    def text(self, text: str) -> list[dict]:
        return self._delta("message", "response.output_text.delta", text, logprobs=[])

    def call(self, delta) -> list[dict]:
        """A piece of tool call `delta.index` (`ToolCallDelta`: its first piece names it)."""
        out = []
        o = self._open
        if o is None or o["kind"] != "function_call" or delta.index != self._call_index:
            out += self.close()
            self._call_index = delta.index
            item = function_call_item(new_id("fc"), delta.id or "", delta.name or "", "",
                                      "in_progress")
            out += self._open_item("function_call", item, call_id=item["call_id"],
                                   name=item["name"])
        if delta.arguments:
            self._open["text"] += delta.arguments
            out.append(self.event("response.function_call_arguments.delta",
                                  item_id=self._open["id"], output_index=self._open["index"],
                                  delta=delta.arguments))
        return out

    def ensure_output(self) -> list[dict]:
        """A response with no output at all still gets its (empty) message item."""
        if self.items or self._open is not None:
            return []
        return self._ensure("message")

    def fail(self, response: dict, status: int, message: str,
             param: str | None = None) -> list[dict]:
        """After an in-stream error: close the open item as incomplete and end with
        `response.failed`, its `error` set, so a client that waits for the terminal
        event (the Agents SDK does) sees the response end instead of a cut stream."""
        out = self.close("incomplete")
        code = ("rate_limit_exceeded" if status == 429 else
                "invalid_prompt" if 400 <= status < 500 else "server_error")
        response.update(status="failed", output=list(self.items),
                        error={"code": code, "message": message, "param": param})
        return out + [self.event("response.failed", response=response)]

    def finish(self, response: dict) -> list[dict]:
        """Close the open item and end with the final response (its `output` is set from
        the items built here)."""
        status = response["status"]
        out = self.close("incomplete" if status == "incomplete" else "completed")
        response["output"] = list(self.items)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return out + [self.event(kind, response=response)]
