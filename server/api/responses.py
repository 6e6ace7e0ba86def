"""`POST /v1/responses` (OpenAI's Responses API), served through the chat path.

The request is parsed (`responses_protocol`), mapped onto a chat request
(`responses_input`) and prepared, admitted and sampled by `OpenAIServing` exactly as
`/v1/chat/completions` is: same template rendering, sampling defaults, tool-call and
reasoning parsers, structured output, admission (429/503), metrics and errors. Only
the body differs: output items (`responses_output`) or the semantic SSE events
(`responses_stream`). Errors from the chat path name the field the way the Responses
request spells it (`max_output_tokens`, `text.format`, `input`, `tools.0.parameters`).

`GET /v1/responses/{id}` is always a 404: nothing is stored (see responses_protocol).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from starlette.responses import Response

from pagefleet.server.api.errors import APIError, to_api_error
from pagefleet.server.api.responses_input import to_chat_request, to_responses_error
from pagefleet.server.api.responses_output import output_items, response_body, status_of, usage
from pagefleet.server.api.responses_protocol import ResponsesRequest
from pagefleet.server.api.responses_stream import ResponseEvents
from pagefleet.server.api.serving import (Accum, OpenAIServing, Prepared, json_response, parse,
                                          prepend, streaming_response)


def _event(ev: dict) -> str:
    return f"event: {ev['type']}\ndata: {json.dumps(ev, separators=(',', ':'))}\n\n"


def not_found(response_id: str) -> APIError:
    shown = response_id if len(response_id) <= 256 else response_id[:256] + "..."
    return APIError(404, f"Response with id '{shown}' not found. Responses are not stored "
                         "on this server.", "response_id")


class ResponsesServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def _prepare(self, body: bytes, tok) -> tuple[ResponsesRequest, Prepared]:
        req = parse(ResponsesRequest, body)
        chat = to_chat_request(req)   # its errors already name the Responses fields
        try:
            return req, self.serving.prepare_chat_request(chat, tok)
        except APIError as e:
            raise to_responses_error(e) from None

    def _reasoning_tokens(self, prep: Prepared, a: Accum, reasoning: str | None) -> int:
        """Output tokens up to and including the end of the reasoning."""
        if not reasoning:
            return 0
        think = self.serving.think
        if think is not None and think.end is not None and think.end in a.token_ids:
            return a.token_ids.index(think.end) + 1
        return a.num_tokens

    def _usage(self, prep: Prepared, a: Accum, reasoning: str | None) -> dict:
        return usage(len(prep.prompts[0]), a.num_tokens, a.num_cached_tokens,
                     self._reasoning_tokens(prep, a, reasoning))

    async def create(self, body: bytes, rid: str) -> Response:
        s = self.serving
        req, prep = await s.prepared(self._prepare, body)
        chat = prep.req
        s._log_received(rid, "responses", prep.prompts, [m.content for m in chat.messages],
                        prep.params, req.stream)
        t0 = time.time()
        streams = s._submit(rid, prep, chat.priority)
        gen = s.engine.outputs_many(streams)
        resp_id, created, model = f"resp_{rid}", int(time.time()), s.served_model_name

        def body_of(status: str, details: dict | None, output: list, use: dict | None) -> dict:
            return response_body(resp_id, created, model, req, prep.params, status=status,
                                 output=output, usage=use, incomplete_details=details)

        if not req.stream:
            acc = Accum(keep_logprobs=True)
            async for _, out in gen:
                acc.add(out)
            s._log_finished(rid, [acc], t0)
            msg, _ = s._chat_message(prep, acc)
            reasoning = msg.get("reasoning_content")
            status, details = status_of(acc.finish_reason)
            items = output_items(reasoning, msg.get("content"), msg.get("tool_calls") or [],
                                 status == "incomplete")
            return json_response(body_of(status, details, items,
                                          self._usage(prep, acc, reasoning)))

        first = await gen.__anext__()
        rparser, tparser = s._message_parsers(prep)

        async def events() -> AsyncIterator[str]:
            ev = ResponseEvents()
            acc = Accum(keep_logprobs=True)
            reasoning_text = []
            try:
                for e in ev.start(body_of("in_progress", None, [], None)):
                    yield _event(e)
                async for _, out in prepend(first, gen):
                    acc.add(out)
                    text, final = out.outputs[0].text, out.finished
                    content = text
                    if rparser is not None:
                        content = ""
                        for d in [rparser.feed(text)] + ([rparser.finish()] if final else []):
                            if d is None:
                                continue
                            if d.reasoning_content:
                                reasoning_text.append(d.reasoning_content)
                                for e in ev.reasoning(d.reasoning_content):
                                    yield _event(e)
                            content += d.content or ""
                    if tparser is not None:
                        for d in [tparser.feed(content)] + ([tparser.finish()] if final
                                                            else []):
                            if d is None:
                                continue
                            for e in ev.text(d.content or ""):
                                yield _event(e)
                            for call in d.tool_calls:
                                for e in ev.call(call):
                                    yield _event(e)
                    else:
                        for e in ev.text(content):
                            yield _event(e)
                s._log_finished(rid, [acc], t0)
                for e in ev.ensure_output():
                    yield _event(e)
                status, details = status_of(acc.finish_reason)
                final_body = body_of(status, details, [],
                                     self._usage(prep, acc, "".join(reasoning_text)))
                for e in ev.finish(final_body):
                    yield _event(e)
            except Exception as exc:  # noqa: BLE001 - report in-band once streaming
                err = to_responses_error(to_api_error(exc))
                yield _event(ev.event("error", code=str(err.status), message=err.message,
                                      param=err.param))
                failed = body_of("failed", None, [], self._usage(prep, acc,
                                                                 "".join(reasoning_text)))
                for e in ev.fail(failed, err.status, err.message, err.param):
                    yield _event(e)

        return streaming_response(events())

    @staticmethod
    def not_found(response_id: str) -> APIError:
        return not_found(response_id)
