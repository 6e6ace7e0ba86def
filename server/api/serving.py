"""The OpenAI endpoints: request -> prompt ids + SamplingParams -> engine -> response.

Every request fails before its response starts when it can: the body is validated,
the prompt tokenized and the context length checked before admission, and a streamed
response only sends its 200 header once the first token is out. So a queue timeout or
a full queue gets a real HTTP status (503/429) even for `stream: true`; only a failure
after the first token has to travel as an SSE `error` event.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pagefleet.server.api import protocol as P
from pagefleet.server.api.chat import LogprobFormatter, render_chat
from pagefleet.server.api.errors import APIError, bad_request, error_body, to_api_error
from pagefleet.server.engine.async_engine import AsyncEngine, RequestStream
from pagefleet.server.engine.validation import PromptTooLongError
from pagefleet.server.engine.validation import check_context as _check_context

log = logging.getLogger("pagefleet.api")
_seq = itertools.count()
# Bodies from this size on are parsed, templated and tokenized in the preparation thread.
OFFLOAD_BYTES = 64 << 10


def parse(model: type, body: bytes):
    """Bytes -> pydantic model; every failure is a 400 naming the field."""
    if not body.strip():
        raise bad_request("the request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise to_api_error(e) from None


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
    """vLLM's context-length rule, with its wording (PromptTooLongError builds it)."""
    try:
        _check_context(prompt_len, max_tokens, max_model_len)
    except PromptTooLongError as e:
        raise APIError(400, str(e), e.param) from None


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, coro) -> Response:
    """Run a handler, cancelling it if the client goes away first (its request is then
    aborted and its KV blocks freed). The body must already have been read."""
    handler = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        handler.cancel()
        watcher.cancel()
        raise
    if handler in done:
        watcher.cancel()
        return handler.result()
    handler.cancel()
    try:
        await handler
    except BaseException:  # noqa: BLE001 - the client is gone; nothing to report to
        pass
    log.info("request %s: client disconnected; aborted",
             getattr(request.state, "request_id", "-"))
    return Response(status_code=499)


class OpenAIServing:
    def __init__(self, async_engine: AsyncEngine, served, *, served_model_name: str,
                 model_root: str, chat_template: str | None, scheduling_policy: str,
                 enable_log_requests: bool = False, max_log_len: int = 200) -> None:
        self.engine = async_engine
        self.tokenizer = served.tokenizer
        self.max_model_len = served.max_model_len
        self.defaults = dict(served.generation_defaults)
        self.vocab_size = served.ready.vocab_size
        self.served_model_name = served_model_name
        self.model_root = model_root
        self.chat_template = chat_template
        self.scheduling_policy = scheduling_policy
        self.log_requests = enable_log_requests
        self.max_log_len = max_log_len
        self.logprob_fmt = LogprobFormatter(self.tokenizer)
        self.created = int(time.time())
        self.offload_bytes = OFFLOAD_BYTES
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagefleet-prepare")
        self._worker_tokenizer = None

    # -- shared checks ---------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name and name != self.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    def _common_checks(self, req: P._SamplingFields) -> None:
        self.check_model(req.model)
        if req.n != 1:
            raise bad_request("n: only n=1 is supported", "n")
        if req.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              "stream_options")
        if req.priority != 0 and self.scheduling_policy != "priority":
            raise bad_request("priority is only honoured with --scheduling-policy priority",
                              "priority")
        if req.stop_token_ids and any(t >= self.vocab_size for t in req.stop_token_ids):
            raise bad_request(f"stop_token_ids: ids must be < {self.vocab_size}", "stop_token_ids")

    def _trunc(self, text: Any) -> str:
        s = text if isinstance(text, str) else str(text)
        return s[:self.max_log_len] + ("..." if len(s) > self.max_log_len else "")

    def _log_received(self, rid: str, kind: str, prompts: list[list[int]], texts: list[Any],
                      params, stream: bool) -> None:
        lens = ",".join(str(len(p)) for p in prompts)
        if self.log_requests:
            log.info("request %s: %s received, prompt_tokens=%s, max_tokens=%s, stream=%s, "
                     "params=%s, prompt=%r", rid, kind, lens, params.max_tokens, stream,
                     params, [self._trunc(t) for t in texts])
        else:
            log.info("request %s: %s received, prompt_tokens=%s, max_tokens=%s, stream=%s",
                     rid, kind, lens, params.max_tokens, stream)

    def _log_finished(self, rid: str, outs: list["Accum"], t0: float) -> None:
        reasons = ",".join(str(o.finish_reason) for o in outs)
        ntok = sum(o.num_tokens for o in outs)
        if self.log_requests:
            log.info("request %s: finished (%s), output_tokens=%d, %.3fs, output=%r", rid,
                     reasons, ntok, time.time() - t0, [self._trunc(o.text) for o in outs])
        else:
            log.info("request %s: finished (%s), output_tokens=%d, %.3fs", rid, reasons, ntok,
                     time.time() - t0)

    def _submit(self, rid: str, prompts: list[list[int]], params, priority: int,
                texts: list[Any] | None = None) -> list[RequestStream]:
        """Admit all prompts of one HTTP request, or none of them."""
        self.engine.check_admission(len(prompts))
        notify = asyncio.Event()
        streams: list[RequestStream] = []
        arrival = time.time()
        try:
            for i, ids in enumerate(prompts):
                text = texts[i] if texts and isinstance(texts[i], str) else None
                streams.append(self.engine.add(f"{rid}.{next(_seq)}", ids, params,
                                               priority=priority, notify=notify,
                                               arrival_time=arrival, prompt=text))
        except BaseException:
            for s in streams:
                self.engine.abort(s.request_id)
            raise
        return streams

    # -- /v1/completions -------------------------------------------------------------
    def _completion_prompts(self, prompt: Any, tok) -> tuple[list[list[int]], list[Any]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt: must not be empty", "prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        ids_list, texts = [], []
        for p in prompt:
            if isinstance(p, str):
                ids = tok.encode(p)
            else:
                ids = list(p)
                if any(t < 0 or t >= self.vocab_size for t in ids):
                    raise bad_request(f"prompt: token ids must be in [0, {self.vocab_size})",
                                      "prompt")
            if not ids:
                raise bad_request("prompt: must not be empty", "prompt")
            ids_list.append(ids)
            texts.append(p)
        return ids_list, texts

    # -- preparation: parse, check, tokenize (off the event loop when large) -----------
    async def prepared(self, fn, body: bytes):
        """`fn(body, tokenizer)` inline for small bodies; in the preparation thread (with
        its own tokenizer: HF tokenizers are not safe to share across threads) for large
        ones, so tokenizing or templating megabytes never stalls other streams."""
        if len(body) < self.offload_bytes:
            return fn(body, self.tokenizer)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._in_worker, fn, body)

    def _in_worker(self, fn, body: bytes):
        if self._worker_tokenizer is None:
            self._worker_tokenizer = copy.deepcopy(self.tokenizer)
        return fn(body, self._worker_tokenizer)

    def _prepare_completion(self, body: bytes, tok):
        req = parse(P.CompletionRequest, body)
        self._common_checks(req)
        for name, bad in (("echo", req.echo), ("logprobs", req.logprobs is not None),
                          ("suffix", req.suffix is not None),
                          ("best_of", req.best_of not in (None, 1))):
            if bad:
                raise bad_request(f"{name} is not supported by /v1/completions here", name)
        prompts, texts = self._completion_prompts(req.prompt, tok)
        for ids in prompts:
            check_context(len(ids), req.max_tokens, self.max_model_len)
        params = P.sampling_params(req, self.defaults, max_tokens=req.max_tokens, logprobs=None)
        return req, prompts, texts, params

    async def completions(self, body: bytes, rid: str) -> Response:
        req, prompts, texts, params = await self.prepared(self._prepare_completion, body)
        self._log_received(rid, "completion", prompts, texts, params, req.stream)
        t0 = time.time()
        streams = self._submit(rid, prompts, params, req.priority, texts)
        gen = self.engine.outputs_many(streams)
        resp_id, created, model = f"cmpl-{rid}", int(time.time()), self.served_model_name
        n_prompt = sum(len(p) for p in prompts)
        if not req.stream:
            acc = [Accum() for _ in streams]
            async for i, out in gen:
                acc[i].add(out)
            self._log_finished(rid, acc, t0)
            choices = [P.completion_choice(i, a.text, a.finish_reason, a.stop_reason)
                       for i, a in enumerate(acc)]
            return json_response(P.completion_body(resp_id, model, created, choices,
                                                   P.usage(n_prompt, sum(a.num_tokens for a in acc))))
        first = await gen.__anext__()
        opts = req.stream_options or P.StreamOptions()

        async def events() -> AsyncIterator[str]:
            acc = [Accum() for _ in streams]
            try:
                async for i, out in prepend(first, gen):
                    c = out.outputs[0]
                    acc[i].add(out)
                    if not c.text and not out.finished:
                        continue
                    use = P.usage(n_prompt, sum(a.num_tokens for a in acc)) \
                        if opts.continuous_usage_stats else None
                    yield sse(P.completion_chunk(resp_id, model, created, [P.completion_choice(
                        i, c.text, c.finish_reason if out.finished else None,
                        c.stop_reason if out.finished else None)], use))
                if opts.include_usage:
                    yield sse(P.completion_chunk(resp_id, model, created, [],
                                                 P.usage(n_prompt, sum(a.num_tokens for a in acc))))
                self._log_finished(rid, acc, t0)
            except Exception as exc:  # noqa: BLE001 - report in-band once streaming
                yield sse_error(rid, exc)
            yield SSE_DONE

        return streaming_response(events())

    # -- /v1/chat/completions --------------------------------------------------------
    def chat_prompt_ids(self, req, tok) -> list[int]:
        text = render_chat(tok, req.messages, template=self.chat_template,
                           add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message,
                           kwargs=getattr(req, "chat_template_kwargs", None))
        add_special = req.add_special_tokens if req.add_special_tokens is not None else False
        return tok.encode(text, add_special_tokens=add_special)

    def _prepare_chat(self, body: bytes, tok):
        req = parse(P.ChatCompletionRequest, body)
        self._common_checks(req)
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
            top_max = self.engine.limits.max_logprobs
            if req.top_logprobs > top_max:
                raise bad_request(f"top_logprobs: must be in [0, {top_max}] (--max-logprobs)",
                                  "top_logprobs")
        ids = self.chat_prompt_ids(req, tok)
        if not ids:
            raise bad_request("messages: the rendered prompt is empty", "messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        for name, v in (("max_completion_tokens", req.max_completion_tokens),
                        ("max_tokens", req.max_tokens)):
            if v is not None and v < 1:
                raise bad_request(f"{name}: must be >= 1, got {v}", name)
        check_context(len(ids), max_tokens, self.max_model_len)
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = P.sampling_params(req, self.defaults, max_tokens=max_tokens, logprobs=top)
        return req, ids, top, params

    async def chat(self, body: bytes, rid: str) -> Response:
        req, ids, top, params = await self.prepared(self._prepare_chat, body)
        self._log_received(rid, "chat", [ids], [m.content for m in req.messages], params,
                           req.stream)
        t0 = time.time()
        (stream,) = self._submit(rid, [ids], params, req.priority)
        gen = self.engine.outputs_many([stream])
        resp_id, created, model = f"chatcmpl-{rid}", int(time.time()), self.served_model_name
        fmt = self.logprob_fmt

        def logprobs_of(c) -> dict | None:
            if not req.logprobs or c.logprobs is None:
                return None
            return {"content": fmt.content(c.token_ids, c.logprobs, top)}

        if not req.stream:
            acc = Accum(keep_logprobs=bool(req.logprobs))
            async for _, out in gen:
                acc.add(out)
            self._log_finished(rid, [acc], t0)
            lp = {"content": fmt.content(acc.token_ids, acc.logprobs, top)} \
                if req.logprobs else None
            return json_response(P.chat_body(
                resp_id, model, created,
                [P.chat_choice(0, acc.text, acc.finish_reason, acc.stop_reason, lp)],
                P.usage(len(ids), acc.num_tokens)))
        first = await gen.__anext__()
        opts = req.stream_options or P.StreamOptions()

        async def events() -> AsyncIterator[str]:
            acc = Accum()
            try:
                yield sse(P.chat_chunk(resp_id, model, created, [P.chat_delta_choice(
                    0, {"role": "assistant", "content": ""})],
                    P.usage(len(ids), 0) if opts.continuous_usage_stats else None))
                async for _, out in prepend(first, gen):
                    c = out.outputs[0]
                    acc.add(out)
                    lp = logprobs_of(c)
                    if not c.text and not out.finished and not (lp and lp["content"]):
                        continue
                    use = P.usage(len(ids), acc.num_tokens) if opts.continuous_usage_stats else None
                    yield sse(P.chat_chunk(resp_id, model, created, [P.chat_delta_choice(
                        0, {"content": c.text} if c.text or not out.finished else {},
                        c.finish_reason if out.finished else None,
                        c.stop_reason if out.finished else None, lp)], use))
                if opts.include_usage:
                    yield sse(P.chat_chunk(resp_id, model, created, [],
                                           P.usage(len(ids), acc.num_tokens)))
                self._log_finished(rid, [acc], t0)
            except Exception as exc:  # noqa: BLE001 - report in-band once streaming
                yield sse_error(rid, exc)
            yield SSE_DONE

        return streaming_response(events())

    # -- tokenizer endpoints -----------------------------------------------------------
    def _tokenize(self, body: bytes, tok) -> dict:
        req = parse(P.TokenizeRequest, body)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if req.prompt is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = tok.encode(req.prompt, add_special_tokens=add)
        else:
            ids = self.chat_prompt_ids(req, tok)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    async def tokenize(self, body: bytes, rid: str) -> Response:
        return json_response(await self.prepared(self._tokenize, body))

    def _detokenize(self, body: bytes, tok) -> dict:
        req = parse(P.DetokenizeRequest, body)
        self.check_model(req.model)
        if any(t >= self.vocab_size for t in req.tokens):
            raise bad_request(f"tokens: ids must be in [0, {self.vocab_size})", "tokens")
        return {"prompt": tok.decode(req.tokens)}

    async def detokenize(self, body: bytes, rid: str) -> Response:
        return json_response(await self.prepared(self._detokenize, body))

    def models(self) -> Response:
        card = P.model_card(self.served_model_name, self.model_root, self.max_model_len,
                            self.created)
        return json_response({"object": "list", "data": [card]})


class Accum:
    """One choice's output, gathered from its deltas (parts joined once, at the end)."""

    __slots__ = ("_parts", "token_ids", "logprobs", "num_tokens", "finish_reason",
                 "stop_reason", "_keep")

    def __init__(self, keep_logprobs: bool = False) -> None:
        self._parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.num_tokens = 0
        self.finish_reason = None
        self.stop_reason = None
        self._keep = keep_logprobs

    def add(self, out) -> None:
        c = out.outputs[0]
        if c.text:
            self._parts.append(c.text)
        self.num_tokens += len(c.token_ids)
        if self._keep:
            self.token_ids.extend(c.token_ids)
            self.logprobs.extend(c.logprobs or ())
        if out.finished:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""


async def prepend(first: Any, gen) -> AsyncIterator[Any]:
    """Yield an already-awaited first item, then the rest of `gen`; closing this closes
    `gen` too (which aborts unfinished requests)."""
    try:
        yield first
        async for item in gen:
            yield item
    finally:
        await gen.aclose()


def json_response(obj: dict, status: int = 200) -> Response:
    return Response(json.dumps(obj, separators=(",", ":")), status_code=status,
                    media_type="application/json")


def streaming_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


def sse_error(rid: str, exc: BaseException) -> str:
    err = to_api_error(exc)
    if err.status >= 500:
        log.warning("request %s failed mid-stream: %s", rid, err.message)
    return sse(error_body(err.status, err.message, err.param))
