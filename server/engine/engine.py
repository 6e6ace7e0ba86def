"""The step loop: schedule -> run -> sample -> update.

`LLMEngine` is synchronous and single-threaded by design: the offline `LLM` drives it
directly and the HTTP server drives it from one engine thread. Requests enter with
`add_request`, leave finished (stop, length) or aborted; every step returns the
cumulative output of each request that made progress.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pagefleet.server.config import ConfigError, EngineConfig
from pagefleet.server.engine.detokenizer import DetokState, IncrementalDetokenizer, find_stop
from pagefleet.server.engine.kv_cache import KVCacheManager
from pagefleet.server.engine.outputs import CompletionOutput, RequestOutput
from pagefleet.server.engine.request import Request
from pagefleet.server.engine.runner import ModelRunner
from pagefleet.server.engine.sampler import Sampler
from pagefleet.server.engine.sampling_params import SamplingParams, SamplingParamsError
from pagefleet.server.engine.sampler import PendingSample
from pagefleet.server.engine.scheduler import Scheduler, SchedulerOutput
from pagefleet.server.models.config import ModelConfig, generation_defaults

log = logging.getLogger("pagefleet.engine")


class RequestRejected(ValueError):
    """A request that can never run as asked; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(RequestRejected):
    def __init__(self, prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
        completion = max_tokens or 0
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + completion} tokens ({prompt_len} in the messages, "
            f"{completion} in the completion). Please reduce the length of the messages or "
            "completion.", param="messages")
        self.prompt_len, self.max_tokens, self.max_model_len = prompt_len, max_tokens, max_model_len


@dataclass
class _Inflight:
    """A step whose forward is queued: what it runs, who samples, and the sample."""

    sched: SchedulerOutput
    sampling: list[Request]
    logits: torch.Tensor | None
    pending: PendingSample | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    free_blocks: int
    total_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


class LLMEngine:
    def __init__(self, config: EngineConfig, model_dir: str | Path | None = None) -> None:
        config.validate()
        self.config = config
        self.model_dir = Path(model_dir or config.model)
        self.model_cfg = ModelConfig.from_dir(self.model_dir)
        self.max_model_len = self._max_model_len()
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"--max-num-batched-tokens ({config.max_num_batched_tokens}) is smaller than "
                f"--max-model-len ({self.max_model_len}) with chunked prefill off, so long "
                "prompts could never be scheduled. Raise --max-num-batched-tokens, lower "
                "--max-model-len, or use --enable-chunked-prefill.")
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_dir)
        self.generation_defaults = generation_defaults(self.model_dir)
        eos = list(self.model_cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(eos)
        self.runner = ModelRunner(config, self.model_dir, self.model_cfg, self.max_model_len)
        self.device = self.runner.device
        self.kv = KVCacheManager(self.runner.layout.num_blocks, config.block_size,
                                 config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   policy=config.scheduling_policy,
                                   max_model_len=self.max_model_len)
        self.sampler = Sampler(self.model_cfg.vocab_size, self.device)
        self.detokenizer = IncrementalDetokenizer(self.tokenizer)
        self._detok: dict[str, DetokState] = {}
        self._seed_rng = torch.Generator().manual_seed(config.seed)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._inflight: _Inflight | None = None    # a launched step not read back yet
        self.num_overlapped_steps = 0

    def _max_model_len(self) -> int:
        limit = self.model_cfg.max_position_embeddings
        want = self.config.max_model_len or limit
        if want > limit:
            raise ConfigError(f"--max-model-len {want} exceeds the model's "
                              f"max_position_embeddings ({limit}); use at most {limit}")
        window = self.model_cfg.sliding_window
        if window and want > window:
            raise ConfigError(f"--max-model-len {want} exceeds the model's sliding window "
                              f"({window}), which pagefleet does not implement; use at most {window}")
        return want

    # -- requests --------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    *, priority: int = 0, arrival_time: float | None = None,
                    stream: bool = True) -> Request:
        """Validate and queue a request; raises RequestRejected for what can never run.

        `stream=False` returns the request's output only once, when it finishes: the
        offline API needs no per-step outputs, and building them costs host time on
        every step."""
        if request_id in self.scheduler.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use", "request_id")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenize(prompt)
        else:
            text, ids = None, list(prompt)
        if not ids:
            raise RequestRejected("the prompt is empty", "prompt")
        vocab = self.model_cfg.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestRejected(f"token id {bad[0]!r} is out of range [0, {vocab})", "prompt")
        if len(ids) >= self.max_model_len or (
                params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len):
            raise PromptTooLongError(len(ids), params.max_tokens, self.max_model_len)
        if params.stop_token_ids and any(t >= vocab for t in params.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", f"ids must be < {vocab}")
        max_tokens = params.max_tokens or (self.max_model_len - len(ids))
        need = self.kv.blocks_needed(len(ids) + max_tokens)
        if need > self.kv.num_blocks:
            raise RequestRejected(
                f"the request needs up to {len(ids) + max_tokens} tokens of KV cache but the "
                f"whole cache holds {self.kv.num_blocks * self.kv.block_size}; lower max_tokens",
                "max_tokens")
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seed_rng).item())
        gen = torch.Generator(device=self.device).manual_seed(seed)
        req = Request(request_id, ids, params, prompt=text, priority=priority,
                      arrival_time=arrival_time, eos_token_ids=self.eos_token_ids, generator=gen,
                      stream=stream)
        req.max_tokens = max_tokens
        self._detok[request_id] = self.detokenizer.start(ids, params.skip_special_tokens)
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a queued or running request now; its blocks go back to the pool."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.finish(req, "abort")
        req.metrics.finished_time = time.time()
        return self._output(req)

    def is_waiting_unscheduled(self, request_id: str) -> bool:
        """True while the request has never been scheduled (for queue timeouts)."""
        req = self.scheduler.requests.get(request_id)
        return req is not None and req.metrics.first_scheduled_time is None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # -- stepping --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; returns the outputs of requests that progressed (streamed
        requests every step, the others when they finish).

        With async scheduling a pure-decode step is followed at once by its
        continuation: the next forward is queued on the device before this step's
        tokens are read back, and the host's per-request work (stop checks,
        detokenization, outputs) runs while the device computes. Outputs then come
        one step later; nothing else changes.
        """
        prev = self._inflight
        self._inflight = None
        if prev is None:
            sched = self.scheduler.schedule()
            if sched.is_empty:
                return []
            prev = self._launch(sched)
            self._sample(prev)
            if not self.config.async_scheduling:
                return self._finish(prev)
        pure_decode = len(prev.sampling) == len(prev.sched.scheduled) and \
            all(s.num_new_tokens == 1 for s in prev.sched.scheduled)
        nxt_sched = self.scheduler.schedule_continuation(prev.sched) if pure_decode else None
        if nxt_sched is None:
            return self._finish(prev)
        nxt = self._launch(nxt_sched, prev)
        self.num_overlapped_steps += 1
        outputs = self._finish(prev)
        self.scheduler.advance(nxt_sched)      # its input tokens are known now
        self._sample(nxt)
        self._inflight = nxt
        return outputs

    def _launch(self, sched: SchedulerOutput, prev: "_Inflight | None" = None) -> "_Inflight":
        """Queue a step's forward. A step whose inputs are all on the host counts them
        as computed right away; a continuation waits for `prev`'s tokens."""
        scheduled = sched.scheduled
        sampling = [s.request for s in scheduled if s.samples]
        blocks_of = self.kv.blocks_of
        tables = [blocks_of(s.request.request_id) for s in scheduled]
        if prev is None:
            logits = self.runner.execute(scheduled, tables)
            self.scheduler.advance(sched)
        else:
            row_of = {id(r): i for i, r in enumerate(prev.sampling)}
            logits = self.runner.execute(scheduled, tables, prev.pending.tokens,
                                         [row_of[id(s.request)] for s in scheduled])
        return _Inflight(sched, sampling, logits)

    def _sample(self, step: "_Inflight") -> None:
        step.pending = self.sampler.sample(step.logits, step.sampling) if step.sampling else None
        step.logits = None

    def _finish(self, step: "_Inflight") -> list[RequestOutput]:
        """Read a step's tokens back and update its requests. Requests that finished or
        were aborted meanwhile are skipped: their token is dropped."""
        if step.pending is None:
            return []
        result = step.pending.resolve()
        outputs = []
        now = time.time()
        check_stop, make_output = self._check_stop, self._output
        for req, token, lp in zip(step.sampling, result.token_ids, result.logprobs):
            if req.is_finished:
                continue
            req.append_token(token)
            self.generation_tokens_total += 1
            if lp is not None:
                req.logprobs.append(lp)
            metrics = req.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                self.prompt_tokens_total += req.num_prompt_tokens   # as vLLM counts them
            metrics.last_token_time = now
            check_stop(req, token)
            if req.is_finished:
                metrics.finished_time = now
                outputs.append(make_output(req))
            elif req.stream:
                outputs.append(make_output(req))
        return outputs

    def _check_stop(self, req: Request, token: int) -> None:
        p = req.params
        state = self._detok[req.request_id]
        before = len(state.text)
        self.detokenizer.step(state, token)
        n_out = len(req.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                return self.scheduler.finish(req, "stop", None)
            if p.stop_token_ids and token in p.stop_token_ids:
                return self.scheduler.finish(req, "stop", token)
            if p.stop_strings:
                longest = max(len(s) for s in p.stop_strings)
                hit = find_stop(state.text, p.stop_strings, before - longest + 1)
                if hit is not None:
                    idx, stop = hit
                    state.text = state.text[:idx + (len(stop) if p.include_stop_str_in_output else 0)]
                    return self.scheduler.finish(req, "stop", stop)
        if n_out >= req.max_tokens or req.num_tokens >= self.max_model_len:
            self.scheduler.finish(req, "length", None)

    def _output(self, req: Request) -> RequestOutput:
        state = self._detok[req.request_id]
        text = state.text
        if not req.is_finished and req.params.stop_strings:
            # Hold back what could still turn out to be the start of a stop string, so
            # streamed text never has to be taken back.
            hold = max(len(s) for s in req.params.stop_strings) - 1
            text = text[:max(len(text) - hold, 0)]
        if req.is_finished:
            self._detok.pop(req.request_id, None)
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            logprobs=list(req.logprobs) if req.logprobs is not None else None)
        return RequestOutput(request_id=req.request_id, prompt=req.prompt,
                             prompt_token_ids=req.prompt_token_ids, outputs=[completion],
                             finished=req.is_finished, num_cached_tokens=req.num_cached_tokens,
                             metrics=req.metrics)

    # -- observability -----------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage,
            free_blocks=self.kv.num_free_blocks,
            total_blocks=self.kv.num_blocks,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens_total,
            generation_tokens=self.generation_tokens_total,
        )
