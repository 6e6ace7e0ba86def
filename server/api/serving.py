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
import dataclasses
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pagefleet.server.api import protocol as P
from pagefleet.server.api.chat import LogprobFormatter, render_chat
from pagefleet.server.api.errors import APIError, bad_request, error_body, to_api_error
from pagefleet.server.api.reasoning import REASONING_FIELDS, get_reasoning_parser, think_token_ids
from pagefleet.server.api.structured_outputs import grammar_spec_from_request, json_schema_spec
from pagefleet.server.api.tool_parsers import (ToolChoiceError, get_tool_parser, parser_for_plan,
                                               plan_tool_choice)
from pagefleet.server.engine.async_engine import AsyncEngine, RequestGroup, RequestStream
from pagefleet.server.engine.sampling_params import SamplingParams
from pagefleet.server.engine.structured_output import GrammarSpec
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


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int,
                  param: str = "messages") -> None:
    """vLLM's context-length rule, with its wording (PromptTooLongError builds it)."""
    try:
        _check_context(prompt_len, max_tokens, max_model_len, param)
    except PromptTooLongError as e:
        raise APIError(400, str(e), e.param) from None


def _clip(text: str, limit: int = 256) -> str:
    """A client's string quoted back in an error, cut short: a 60 KB model name must
    not come back as a 60 KB message."""
    return text if len(text) <= limit else text[:limit] + "..."


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


@dataclass
class Prepared:
    """One HTTP request, parsed and checked: its prompts and the choices per prompt."""

    req: Any
    prompts: list[list[int]]
    texts: list[Any]
    params: SamplingParams
    n: int                          # choices returned per prompt
    best_of: int                    # choices generated per prompt (>= n)
    prompt_text: str | None = None  # chat: the rendered prompt
    plan: Any = None                # chat: the tool-choice plan
    think: Any = None               # chat: reasoning tag ids
    in_reasoning: bool = False      # chat: the output starts inside the reasoning
    echo_only: bool = False         # completions: echo with max_tokens 0 (score the prompt)


class OpenAIServing:
    def __init__(self, async_engine: AsyncEngine, served, *, served_model_name: str,
                 model_root: str, chat_template: str | None, scheduling_policy: str,
                 enable_log_requests: bool = False, max_log_len: int = 200,
                 served_model_aliases: tuple[str, ...] = (),
                 tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
                 reasoning_parser: str | None = None,
                 enable_prompt_tokens_details: bool = False,
                 response_role: str = "assistant", defaults: dict | None = None,
                 trust_request_chat_template: bool = False) -> None:
        self.engine = async_engine
        self.tokenizer = served.tokenizer
        self.max_model_len = served.max_model_len
        self.defaults = dict(served.generation_defaults if defaults is None else defaults)
        self.vocab_size = served.ready.vocab_size
        self.served_model_name = served_model_name
        self.model_names = (served_model_name, *served_model_aliases)
        self.model_root = model_root
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template
        self.scheduling_policy = scheduling_policy
        self.log_requests = enable_log_requests
        self.max_log_len = max_log_len
        self.tool_call_parser = tool_call_parser
        self.auto_tools = enable_auto_tool_choice and tool_call_parser is not None
        self.reasoning = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        self.think = think_token_ids(self.reasoning, self.tokenizer) if self.reasoning else None
        self.prompt_tokens_details = enable_prompt_tokens_details
        self.response_role = response_role
        self.logprob_fmt = LogprobFormatter(self.tokenizer)
        self.created = int(time.time())
        self.offload_bytes = OFFLOAD_BYTES
        # Generation requests and the tokenizer endpoints never share a thread: /tokenize
        # is open without an API key (as in vLLM), and one 32 MB body is half a minute
        # of CPU that an authenticated request must not queue behind.
        self._prep = PrepThread(self.tokenizer, "pagefleet-prepare")
        self._tokenizer_prep = PrepThread(self.tokenizer, "pagefleet-tokenize")

    # -- shared checks ---------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name and name not in self.model_names:
            raise APIError(404, f"The model `{_clip(name)}` does not exist.", "model")

    def _common_checks(self, req: P._SamplingFields) -> tuple[int, int]:
        """Checks every generation request shares; returns (n, best_of)."""
        self.check_model(req.model)
        if (refused := P.unhonoured_field(req)) is not None:
            raise bad_request(f"{refused[0]}: {refused[1]}", refused[0])
        if req.truncate_prompt_tokens is not None and \
                req.truncate_prompt_tokens > self.max_model_len:
            raise bad_request(f"truncate_prompt_tokens: must be at most the context length "
                              f"({self.max_model_len}), or -1 for it", "truncate_prompt_tokens")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              "stream_options")
        if req.priority != 0 and self.scheduling_policy != "priority":
            raise bad_request("priority is only honoured with --scheduling-policy priority",
                              "priority")
        if req.stop_token_ids and any(t >= self.vocab_size for t in req.stop_token_ids):
            raise bad_request(f"stop_token_ids: ids must be < {self.vocab_size}", "stop_token_ids")
        n = req.n
        best_of = req.best_of if req.best_of is not None else n
        if best_of < n:
            raise bad_request(f"best_of ({best_of}) must be at least n ({n})", "best_of")
        if best_of > n and req.stream:
            raise bad_request("best_of > n cannot be streamed (the best choices are known "
                              "only at the end)", "best_of")
        top = self.engine.limits.max_logprobs
        if req.prompt_logprobs is not None and req.prompt_logprobs > top:
            raise bad_request(f"prompt_logprobs: must be in [0, {top}] (--max-logprobs)",
                              "prompt_logprobs")
        return n, best_of

    def _grammar(self, req) -> tuple | None:
        spec = grammar_spec_from_request(req.structured_fields())
        return None if spec is None else (spec.kind, spec.text, spec.syntax, spec.any_whitespace)

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

    def _submit(self, rid: str, prep: Prepared, priority: int) -> list[RequestStream]:
        """Admit all choices of one HTTP request, or none of them. Choice j of a prompt
        gets seed + j (choice 0 the request's seed, so n=1 and the first of n=3 agree);
        choices after the first share the prompt's KV blocks: they wait for the first
        one's prompt to be cached instead of computing it again. They form one
        `RequestGroup`: the queue timeout is the HTTP request's, so a 503 comes only
        while none of its choices runs, and siblings that queue behind the running ones
        (n above --max-num-seqs) are never cut off mid-request."""
        per = prep.best_of
        self.engine.check_admission(len(prep.prompts) * per,
                                    sum(len(ids) for ids in prep.prompts) * per)
        notify = asyncio.Event()
        group = RequestGroup()
        streams: list[RequestStream] = []
        arrival = time.time()
        params = prep.params
        try:
            for i, ids in enumerate(prep.prompts):
                text = prep.texts[i] if prep.texts and isinstance(prep.texts[i], str) else None
                leader = None
                for j in range(per):
                    p = params if j == 0 or params.seed is None else \
                        dataclasses.replace(params, seed=params.seed + j)
                    sid = f"{rid}.{next(_seq)}"
                    streams.append(self.engine.add(sid, ids, p, priority=priority,
                                                   notify=notify, arrival_time=arrival,
                                                   prompt=text, prefix_leader=leader,
                                                   group=group))
                    if per > 1 and leader is None:
                        leader = sid
        except BaseException:
            for s in streams:
                self.engine.abort(s.request_id)
            raise
        self.engine.listener.on_request(prep.n, params.max_tokens)
        return streams

    def _usage(self, prep: Prepared, accs: list["Accum"]) -> dict:
        generated = 0 if prep.echo_only else sum(a.num_tokens for a in accs)
        use = P.usage(sum(len(p) for p in prep.prompts), generated)
        if self.prompt_tokens_details:
            use["prompt_tokens_details"] = {"cached_tokens": sum(
                a.num_cached_tokens for k, a in enumerate(accs) if k % prep.best_of == 0)}
        return use

    @staticmethod
    def _pick_best(prep: Prepared, accs: list["Accum"]) -> list[tuple[int, "Accum"]]:
        """(choice index, output): all of them, or for best_of the n most likely of
        each prompt's candidates (cumulative logprob of the sampled tokens)."""
        if prep.best_of == prep.n:
            return list(enumerate(accs))
        out = []
        for i in range(len(prep.prompts)):
            group = accs[i * prep.best_of:(i + 1) * prep.best_of]
            best = sorted(group, key=lambda a: a.cumulative_logprob or 0.0, reverse=True)
            out += [(i * prep.n + j, a) for j, a in enumerate(best[:prep.n])]
        return out

    # -- /v1/completions -------------------------------------------------------------
    def _completion_prompts(self, prompt: Any, tok, truncate: int | None
                            ) -> tuple[list[list[int]], list[Any]]:
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
            ids = self._truncate(ids, truncate)
            if not ids:
                raise bad_request("prompt: must not be empty", "prompt")
            ids_list.append(ids)
            texts.append(p)
        return ids_list, texts

    def _truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep the last `keep` tokens (-1: the context)."""
        if keep is None:
            return ids
        keep = self.max_model_len if keep == -1 else keep
        return ids[-keep:] if keep else []

    def _prepare_completion(self, body: bytes, tok) -> Prepared:
        req = parse(P.CompletionRequest, body)
        n, best_of = self._common_checks(req)
        if req.suffix is not None:
            raise bad_request("suffix is not supported (no fill-in-the-middle model)", "suffix")
        top = self.engine.limits.max_logprobs
        if req.logprobs is not None and req.logprobs > top:
            raise bad_request(f"logprobs: must be in [0, {top}] (--max-logprobs)", "logprobs")
        # echo with max_tokens 0 returns the prompt (and its logprobs) alone, as vLLM does:
        # the prompt-scoring call. The engine still samples one token, which is dropped.
        echo_only = req.echo and req.max_tokens == 0
        if req.max_tokens is not None and req.max_tokens < 1 and not echo_only:
            raise bad_request(f"max_tokens: must be >= 1 (0 only with echo), got "
                              f"{req.max_tokens}", "max_tokens")
        max_tokens = 1 if echo_only else req.max_tokens
        prompts, texts = self._completion_prompts(req.prompt, tok, req.truncate_prompt_tokens)
        for ids in prompts:
            check_context(len(ids), max_tokens, self.max_model_len, "prompt")
        logprobs = req.logprobs
        if logprobs is None and best_of > n:
            logprobs = 0          # best_of ranks by the sampled tokens' logprobs
        prompt_lp = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            prompt_lp = max(prompt_lp or 0, req.logprobs)
        params = P.sampling_params(req, self.defaults, max_tokens=max_tokens, logprobs=logprobs)
        params = dataclasses.replace(params, prompt_logprobs=prompt_lp, grammar=self._grammar(req))
        return Prepared(req, prompts, texts, params, n, best_of, echo_only=echo_only)

    async def completions(self, body: bytes, rid: str) -> Response:
        prep = await self.prepared(self._prepare_completion, body)
        req = prep.req
        self._log_received(rid, "completion", prep.prompts, prep.texts, prep.params, req.stream)
        t0 = time.time()
        streams = self._submit(rid, prep, req.priority)
        gen = self.engine.outputs_many(streams)
        resp_id, created, model = f"cmpl-{rid}", int(time.time()), self.served_model_name
        keep = req.logprobs is not None or prep.best_of > prep.n or req.return_token_ids
        if not req.stream:
            accs = [Accum(keep_logprobs=keep) for _ in streams]
            async for i, out in gen:
                accs[i].add(out)
            self._log_finished(rid, accs, t0)
            choices = [self._completion_choice(prep, k, a) for k, a in self._pick_best(prep, accs)]
            return json_response(P.completion_body(resp_id, model, created, choices,
                                                   self._usage(prep, accs)))
        first = await gen.__anext__()
        opts = req.stream_options or P.StreamOptions()
        continuous = opts.include_usage and opts.continuous_usage_stats   # vLLM: both

        async def events() -> AsyncIterator[str]:
            accs = [Accum(keep_logprobs=False) for _ in streams]
            sent_prompt = [False] * len(streams)
            try:
                async for i, out in prepend(first, gen):
                    c = out.outputs[0]
                    accs[i].add(out)
                    if not c.text and not out.finished and not c.token_ids:
                        continue
                    text, lp, new_ids = c.text, None, c.token_ids
                    if prep.echo_only:
                        text, new_ids = "", []
                    p_idx = i // prep.best_of
                    if req.logprobs is not None:
                        lp = self._legacy_logprobs(new_ids, c.logprobs or [], req)
                    if req.echo and not sent_prompt[i]:
                        # the prompt, and its logprobs, lead the choice's first chunk
                        sent_prompt[i] = True
                        text = self._prompt_text(prep, p_idx) + text
                        if lp is not None:
                            lp = self._merge_logprobs(self._legacy_prompt_logprobs(
                                prep.prompts[p_idx], out.prompt_logprobs, req), lp)
                    if not text and not out.finished and lp is None:
                        continue
                    use = self._usage(prep, accs) if continuous else None
                    choice = P.completion_choice(i, text, c.finish_reason if out.finished
                                                 else None, c.stop_reason if out.finished
                                                 else None)
                    choice["logprobs"] = lp
                    if req.return_token_ids:
                        choice["token_ids"] = new_ids
                    yield sse(P.completion_chunk(resp_id, model, created, [choice], use))
                if opts.include_usage:
                    yield sse(P.completion_chunk(resp_id, model, created, [],
                                                 self._usage(prep, accs)))
                self._log_finished(rid, accs, t0)
            except Exception as exc:  # noqa: BLE001 - report in-band once streaming
                yield sse_error(rid, exc)
            yield SSE_DONE

        return streaming_response(events())

    def _prompt_text(self, prep: Prepared, p_idx: int) -> str:
        text = prep.texts[p_idx]
        if isinstance(text, str):
            return text
        return self.tokenizer.decode(prep.prompts[p_idx])

    def _completion_choice(self, prep: Prepared, index: int, a: "Accum") -> dict:
        req = prep.req
        p_idx = index // prep.n
        text, token_ids = ("", []) if prep.echo_only else (a.text, a.token_ids)
        ids = prep.prompts[p_idx]
        if req.echo:
            text = self._prompt_text(prep, p_idx) + text
        choice = P.completion_choice(index, text, a.finish_reason, a.stop_reason)
        if req.logprobs is not None:
            lp = self._legacy_logprobs(token_ids, a.logprobs, req)
            if req.echo:
                lp = self._merge_logprobs(self._legacy_prompt_logprobs(
                    ids, a.prompt_logprobs, req), lp)
            choice["logprobs"] = lp
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(ids, a.prompt_logprobs,
                                                                   a.prompt_ranks)
        if req.return_token_ids:
            choice["prompt_token_ids"] = ids
            choice["token_ids"] = token_ids
        return choice

    # OpenAI's legacy completion logprobs: tokens, token_logprobs, top_logprobs, text_offset.
    def _tok_str(self, tid: int, req) -> str:
        return f"token_id:{tid}" if req.return_tokens_as_token_ids else self.logprob_fmt.token(tid)

    def _legacy_logprobs(self, token_ids: list[int], logprobs: list[dict], req) -> dict:
        tokens, chosen, tops, offsets = [], [], [], []
        pos = 0
        for tid, d in zip(token_ids, logprobs):
            s = self._tok_str(tid, req)
            tokens.append(s)
            chosen.append(max(d.get(tid, float("-inf")), -9999.0))
            tops.append(self._legacy_top(tid, d, req))
            offsets.append(pos)
            pos += len(s)
        return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops,
                "text_offset": offsets}

    def _legacy_prompt_logprobs(self, ids: list[int], plp: list | None, req) -> dict:
        plp = plp or [None] * len(ids)
        tokens, chosen, tops = [], [], []
        for k, tid in enumerate(ids):
            tokens.append(self._tok_str(tid, req))
            d = plp[k] if k < len(plp) else None
            if d is None:
                chosen.append(None)
                tops.append(None)
                continue
            chosen.append(max(d.get(tid, float("-inf")), -9999.0))
            tops.append(self._legacy_top(tid, d, req))
        return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": tops,
                "text_offset": []}

    def _legacy_top(self, tid: int, d: dict, req) -> dict:
        """One position's `top_logprobs` as vLLM writes it: the token itself first (so
        `logprobs: 0` still names it), then the `logprobs` most likely."""
        top = {self._tok_str(tid, req): max(d.get(tid, float("-inf")), -9999.0)}
        for t, v in sorted(d.items(), key=lambda kv: kv[1], reverse=True)[:req.logprobs]:
            top.setdefault(self._tok_str(t, req), max(v, -9999.0))
        return top

    @staticmethod
    def _merge_logprobs(prompt: dict, gen: dict) -> dict:
        tokens = prompt["tokens"] + gen["tokens"]
        offsets, pos = [], 0
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        return {"tokens": tokens, "token_logprobs": prompt["token_logprobs"] + gen["token_logprobs"],
                "top_logprobs": prompt["top_logprobs"] + gen["top_logprobs"],
                "text_offset": offsets}

    def _vllm_prompt_logprobs(self, ids: list[int], plp: list | None,
                              token_ranks: list | None) -> list:
        """vLLM's `prompt_logprobs`: per prompt token (None for the first), the token and
        its top-N as {id: {logprob, rank, decoded_token}}; the token's rank is its rank in
        the whole vocabulary (the engine's), which may lie past the top-N."""
        out = []
        for k, d in enumerate((plp or [])[:len(ids)]):   # one per prompt token, never past
            if d is None:
                out.append(None)
                continue
            # The top-N hold ranks 1..N (the token sorts last when it is not among them).
            ranked = sorted(d.items(), key=lambda kv: kv[1], reverse=True)
            ranks = {t: r + 1 for r, (t, _) in enumerate(ranked)}
            if token_ranks and k < len(token_ranks) and token_ranks[k] is not None:
                ranks[ids[k]] = token_ranks[k]
            out.append({str(t): {"logprob": max(v, -9999.0), "rank": ranks[t],
                                 "decoded_token": self.logprob_fmt.token(t)}
                        for t, v in d.items()})
        return out

    # -- /v1/chat/completions --------------------------------------------------------
    def _request_template(self, req) -> str | None:
        """The request's own chat_template, refused unless the server trusts it (vLLM's
        --trust-request-chat-template: a Jinja template is code run on the server)."""
        template = getattr(req, "chat_template", None)
        if template is not None and not self.trust_request_chat_template:
            raise bad_request("chat_template: a chat template passed with the request is "
                              "refused unless the server runs with "
                              "--trust-request-chat-template", "chat_template")
        return template

    def chat_prompt_text(self, req, tok, tools: list | None = None) -> str:
        kwargs = dict(getattr(req, "chat_template_kwargs", None) or {})
        if tools:
            kwargs.setdefault("tools", tools)
        template = self._request_template(req)
        if template is None:
            template = self.chat_template
        effort = getattr(req, "reasoning_effort", None)
        if effort is not None:
            if "reasoning_effort" not in self._template_source(tok, template):
                raise bad_request("reasoning_effort: this model's chat template does not read "
                                  "it, so it cannot change the output (for a thinking switch, "
                                  "see chat_template_kwargs, e.g. enable_thinking)",
                                  "reasoning_effort")
            kwargs.setdefault("reasoning_effort", effort)
        return render_chat(tok, req.messages, template=template,
                           add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message, kwargs=kwargs,
                           documents=getattr(req, "documents", None))

    def _template_source(self, tok, template: str | None = None) -> str:
        template = template or self.chat_template or getattr(tok, "chat_template", None) or ""
        return template if isinstance(template, str) else " ".join(template.values())

    def chat_prompt_ids(self, req, tok, tools: list | None = None) -> list[int]:
        text = self.chat_prompt_text(req, tok, tools)
        add_special = req.add_special_tokens if req.add_special_tokens is not None else False
        return tok.encode(text, add_special_tokens=add_special)

    def _prepare_chat(self, body: bytes, tok) -> Prepared:
        return self.prepare_chat_request(parse(P.ChatCompletionRequest, body), tok)

    def prepare_chat_request(self, req: P.ChatCompletionRequest, tok) -> Prepared:
        """A parsed chat request -> prompt ids and SamplingParams (every check chat
        makes). /v1/responses maps its requests onto this too."""
        n, best_of = self._common_checks(req)
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
            top_max = self.engine.limits.max_logprobs
            if req.top_logprobs > top_max:
                raise bad_request(f"top_logprobs: must be in [0, {top_max}] (--max-logprobs)",
                                  "top_logprobs")
        try:
            plan = plan_tool_choice(req.tools, req.tool_choice, auto_enabled=self.auto_tools,
                                    parallel_tool_calls=req.parallel_tool_calls)
        except ToolChoiceError as e:
            raise bad_request(str(e), e.param) from None
        grammar = self._grammar(req)
        if plan.schema is not None:
            if grammar is not None:
                raise bad_request("a structured-output constraint cannot be combined with a "
                                  f"{plan.mode!r} tool_choice", "tool_choice")
            # Compact JSON: whitespace in a forced call is noise, and a weak model can
            # wander in it until max_tokens.
            spec = self._forced_call_spec(plan)
            grammar = (spec.kind, spec.text, spec.syntax, spec.any_whitespace)
        text = self.chat_prompt_text(req, tok, req.tools)
        add_special = req.add_special_tokens if req.add_special_tokens is not None else False
        ids = self._truncate(tok.encode(text, add_special_tokens=add_special),
                             req.truncate_prompt_tokens)
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
        if top is None and best_of > n:
            top = 0
        params = P.sampling_params(req, self.defaults, max_tokens=max_tokens, logprobs=top)
        # Where the output starts, decided once from the rendered prompt, for both the
        # text splitter and the engine's grammar (they must agree on what is content).
        in_reasoning = self.reasoning is not None and self.reasoning.starts_in_reasoning(text)
        reasoning_start = reasoning_end = None
        if grammar is not None and self.think is not None:
            # The grammar holds the answer, not the thinking: inside, it starts after
            # </think>; outside, the first token may be <think> (then likewise) and
            # any other first token begins the answer under the grammar.
            reasoning_end = self.think.end
            if not in_reasoning:
                reasoning_start = self.think.start
                if reasoning_start is None:      # no <think> token: no way to think
                    reasoning_end = None
        params = dataclasses.replace(
            params, prompt_logprobs=req.prompt_logprobs, grammar=grammar,
            reasoning_start_token_id=reasoning_start, reasoning_end_token_id=reasoning_end,
            skip_special_tokens=params.skip_special_tokens and not self._tags_are_special(plan))
        return Prepared(req, [ids], [text], params, n, best_of, prompt_text=text, plan=plan,
                        in_reasoning=in_reasoning)

    @staticmethod
    def _forced_call_spec(plan) -> GrammarSpec:
        """The grammar of a forced tool call, its schemas checked as response_format's
        are: each tool that can be called names itself in the 400, then the whole."""
        called = plan.tools if plan.mode == "required" else (plan.function,)
        for fn in called:
            json_schema_spec(fn.parameters, f"tools.{plan.tools.index(fn)}.function.parameters",
                             False)
        return json_schema_spec(plan.schema, "tools", False)

    def _tags_are_special(self, plan) -> bool:
        """Decode with special tokens kept when the tool format's tags are special
        tokens of this tokenizer (they would vanish from the text otherwise)."""
        if plan.mode == "none" or not self.tool_call_parser:
            return False
        tags = get_tool_parser(self.tool_call_parser).tags
        special = set(getattr(self.tokenizer, "all_special_tokens", ()))
        return any(t in special for t in tags)

    def _message_parsers(self, prep: Prepared):
        """Per choice: a reasoning splitter and a tool parser (each may be None)."""
        rparser = self.reasoning(in_reasoning=prep.in_reasoning) if self.reasoning else None
        tparser = parser_for_plan(prep.plan, self.tool_call_parser)
        return rparser, tparser

    def _chat_message(self, prep: Prepared, a: "Accum") -> tuple[dict, str | None]:
        """The whole message of one choice: reasoning, content, tool calls."""
        text = a.text
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text, in_reasoning=prep.in_reasoning)
        calls = []
        parser = parser_for_plan(prep.plan, self.tool_call_parser)
        if parser is not None:
            parser.feed(text or "")
            parser.finish()
            content, calls = parser.result()
        else:
            content = text
        msg: dict = {"role": self.response_role, "content": content}
        if self.reasoning is not None and prep.req.include_reasoning:
            for name in REASONING_FIELDS:
                msg[name] = reasoning
        if calls:
            msg["tool_calls"] = [c.to_openai() for c in calls]
        finish = a.finish_reason
        if calls and finish in ("stop", None):
            finish = "tool_calls"
        return msg, finish

    async def chat(self, body: bytes, rid: str) -> Response:
        prep = await self.prepared(self._prepare_chat, body)
        req = prep.req
        ids = prep.prompts[0]
        self._log_received(rid, "chat", [ids], [m.content for m in req.messages], prep.params,
                           req.stream)
        t0 = time.time()
        streams = self._submit(rid, prep, req.priority)
        gen = self.engine.outputs_many(streams)
        resp_id, created, model = f"chatcmpl-{rid}", int(time.time()), self.served_model_name
        fmt = self.logprob_fmt
        top = prep.params.logprobs if req.logprobs else None

        if not req.stream:
            accs = [Accum(keep_logprobs=bool(req.logprobs) or prep.best_of > prep.n
                          or req.return_token_ids) for _ in streams]
            async for i, out in gen:
                accs[i].add(out)
            self._log_finished(rid, accs, t0)
            choices = []
            for k, a in self._pick_best(prep, accs):
                msg, finish = self._chat_message(prep, a)
                lp = {"content": fmt.content(a.token_ids, a.logprobs, top or 0,
                                             req.return_tokens_as_token_ids)} \
                    if req.logprobs else None
                choice = {"index": k, "message": msg, "logprobs": lp, "finish_reason": finish,
                          "stop_reason": a.stop_reason}
                if req.return_token_ids:
                    choice["token_ids"] = a.token_ids
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._vllm_prompt_logprobs(
                        ids, a.prompt_logprobs, a.prompt_ranks)
                choices.append(choice)
            body = P.chat_body(resp_id, model, created, choices, self._usage(prep, accs))
            if req.return_token_ids:
                body["prompt_token_ids"] = ids
            return json_response(body)
        first = await gen.__anext__()
        opts = req.stream_options or P.StreamOptions()
        continuous = opts.include_usage and opts.continuous_usage_stats   # vLLM: both
        parsers = [self._message_parsers(prep) for _ in streams]

        def deltas(i: int, text: str, final: bool) -> tuple[dict, bool]:
            """The delta of choice i for new text (and the parsers' flush at the end)."""
            rparser, tparser = parsers[i]
            out: dict = {}
            content = text
            if rparser is not None:
                pieces = [rparser.feed(text)] + ([rparser.finish()] if final else [])
                content = ""
                for d in pieces:
                    if d is None:
                        continue
                    if d.reasoning_content and req.include_reasoning:
                        for name in REASONING_FIELDS:
                            out[name] = out.get(name, "") + d.reasoning_content
                    if d.content:
                        content += d.content
            called = False
            if tparser is not None:
                pieces = [tparser.feed(content)] + ([tparser.finish()] if final else [])
                content = ""
                for d in pieces:
                    if d is None:
                        continue
                    if d.content:
                        content += d.content
                    if d.tool_calls:
                        out.setdefault("tool_calls", []).extend(
                            c.to_openai() for c in d.tool_calls)
                called = bool(tparser.result().tool_calls) if final else False
            if content:
                out["content"] = content
            return out, called

        async def events() -> AsyncIterator[str]:
            accs = [Accum() for _ in streams]
            try:
                for i in range(len(streams)):
                    yield sse(P.chat_chunk(resp_id, model, created, [P.chat_delta_choice(
                        i, {"role": self.response_role, "content": ""})],
                        P.usage(len(ids), 0) if continuous else None))
                async for i, out in prepend(first, gen):
                    c = out.outputs[0]
                    accs[i].add(out)
                    delta, called = deltas(i, c.text, out.finished)
                    lp = {"content": fmt.content(c.token_ids, c.logprobs, top,
                                                 req.return_tokens_as_token_ids)} \
                        if req.logprobs and c.logprobs is not None else None
                    if not delta and not out.finished and not (lp and lp["content"]):
                        continue
                    finish = c.finish_reason if out.finished else None
                    if called and finish == "stop":
                        finish = "tool_calls"
                    use = self._usage(prep, accs) if continuous else None
                    choice = P.chat_delta_choice(i, delta, finish,
                                                 c.stop_reason if out.finished else None, lp)
                    if req.return_token_ids:
                        choice["token_ids"] = c.token_ids
                    yield sse(P.chat_chunk(resp_id, model, created, [choice], use))
                if opts.include_usage:
                    yield sse(P.chat_chunk(resp_id, model, created, [],
                                           self._usage(prep, accs)))
                self._log_finished(rid, accs, t0)
            except Exception as exc:  # noqa: BLE001 - report in-band once streaming
                yield sse_error(rid, exc)
            yield SSE_DONE

        return streaming_response(events())

    # -- preparation: parse, check, tokenize (off the event loop when large) -----------
    async def prepared(self, fn, body: bytes, thread: PrepThread | None = None):
        """`fn(body, tokenizer)` inline for small bodies; in a preparation thread for
        large ones, so tokenizing or templating megabytes never stalls other streams:
        `thread`, or the generation requests' own."""
        if len(body) < self.offload_bytes:
            return fn(body, self.tokenizer)
        return await (thread or self._prep).run(fn, body)

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
            ids = self.chat_prompt_ids(req, tok, req.tools)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    async def tokenize(self, body: bytes, rid: str) -> Response:
        return json_response(await self.prepared(self._tokenize, body, self._tokenizer_prep))

    def _detokenize(self, body: bytes, tok) -> dict:
        req = parse(P.DetokenizeRequest, body)
        self.check_model(req.model)
        if any(t >= self.vocab_size for t in req.tokens):
            raise bad_request(f"tokens: ids must be in [0, {self.vocab_size})", "tokens")
        return {"prompt": tok.decode(req.tokens)}

    async def detokenize(self, body: bytes, rid: str) -> Response:
        return json_response(await self.prepared(self._detokenize, body,
                                                 self._tokenizer_prep))

    def model_cards(self) -> list[dict]:
        return [P.model_card(name, self.model_root, self.max_model_len, self.created)
                for name in self.model_names]

    def models(self) -> Response:
        return json_response({"object": "list", "data": self.model_cards()})

    def model(self, model_id: str) -> Response:
        for card in self.model_cards():
            if card["id"] == model_id:
                return json_response(card)
        raise APIError(404, f"The model `{_clip(model_id)}` does not exist.", "model")


class PrepThread:
    """One thread that prepares large bodies, one at a time, with its own copy of the
    tokenizer (HF tokenizers are not safe to share across threads; the copy is made in
    the thread, on first use, so startup does not pay for it)."""

    def __init__(self, tokenizer, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._source = tokenizer
        self._tokenizer = None

    async def run(self, fn, body: bytes):
        """`fn(body, tokenizer)` in this thread, after whatever it holds already."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._call, fn,
                                                                body)

    def _call(self, fn, body: bytes):
        if self._tokenizer is None:
            self._tokenizer = copy.deepcopy(self._source)
        return fn(body, self._tokenizer)


class Accum:
    """One choice's output, gathered from its deltas (parts joined once, at the end)."""

    __slots__ = ("_parts", "token_ids", "logprobs", "num_tokens", "finish_reason",
                 "stop_reason", "_keep", "cumulative_logprob", "prompt_logprobs", "prompt_ranks",
                 "num_cached_tokens")

    def __init__(self, keep_logprobs: bool = False) -> None:
        self._parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.num_tokens = 0
        self.finish_reason = None
        self.stop_reason = None
        self._keep = keep_logprobs
        self.cumulative_logprob: float | None = None
        self.prompt_logprobs: list | None = None
        self.prompt_ranks: list | None = None
        self.num_cached_tokens = 0

    def add(self, out) -> None:
        c = out.outputs[0]
        if c.text:
            self._parts.append(c.text)
        self.num_tokens += len(c.token_ids)
        if self._keep:
            self.token_ids.extend(c.token_ids)
            self.logprobs.extend(c.logprobs or ())
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
            self.prompt_ranks = out.prompt_logprob_ranks
        if c.cumulative_logprob is not None:
            self.cumulative_logprob = c.cumulative_logprob
        if out.finished:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason
            self.num_cached_tokens = out.num_cached_tokens

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
