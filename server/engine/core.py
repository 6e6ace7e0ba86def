"""The engine core: scheduler, KV manager, runner and sampler behind three calls.

`add_request(CoreRequest)`, `abort(CoreAbort)` and `step() -> CoreOutputs`. The core
knows token ids only: tokenizing, stop strings and detokenizing happen where the
request came from (the API process, or `LLMEngine` for the offline `LLM`), and what a
step hands back are deltas: each request's new token ids, finish reasons, and the
events and gauges the API needs.

Async scheduling, for every kind of step: step N+1 is scheduled and its forward
queued on the device *before* step N's sampled tokens are read back. A request that
N samples counts that token as pending; N+1's decode for it reads the token on the
device. While N+1 computes, the host reads N's tokens, checks stop conditions and
builds the outputs; only then is N+1's sampling queued (it needs nothing from the
host but a few flags). Tokens computed for requests that N finished are dropped.

Isolation: a failure while adding, staging or finishing one request fails that
request (its blocks freed, a `CoreFailure` for its client) and never the engine.
What cannot be pinned on one request (a device fault, a bug in shared state) raises
out of `step()`: the process that runs the core must stop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pagefleet.server.config import SHORT_PROMPT_OVERTAKE_S, ConfigError, EngineConfig, resolve_limits
from pagefleet.server.engine import faults, warmup
from pagefleet.server.engine.kv_cache import CacheStats, KVCacheManager
from pagefleet.server.engine.protocol import (CoreAbort, CoreFailure, CoreOutput, CoreOutputs,
                                              CoreReady, CoreRequest, CoreStats, Logprobs)
from pagefleet.server.engine.request import Request
from pagefleet.server.engine.runner import StagedStep, resolve_device
from pagefleet.server.engine.sampler import PendingSample, Sampler, SamplerStep
from pagefleet.server.engine.scheduler import Scheduler, SchedulerOutput
from pagefleet.server.engine.staging import StagingOverflow
from pagefleet.server.ops import compile_watch
from pagefleet.server.engine.structured_requests import (GrammarDeadEnd, GrammarViolation,
                                                          StructuredRequests)
from pagefleet.server.engine.tp_executor import make_runner
from pagefleet.server.engine.validation import RequestRejected
from pagefleet.server.models.config import ModelConfig

log = logging.getLogger("pagefleet.engine")


def resolve_max_model_len(config: EngineConfig, model_cfg: ModelConfig) -> int:
    limit, how = model_cfg.context_limit()
    want = config.max_model_len or limit
    if want > limit:
        raise ConfigError(f"--max-model-len {want} exceeds the model's context length "
                          f"{limit} ({how}); use at most {limit}")
    window = model_cfg.sliding_window
    if window and want > window:
        raise ConfigError(f"--max-model-len {want} exceeds the model's sliding window "
                          f"({window}), which pagefleet does not implement; use at most {window}")
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < want:
        raise ConfigError(
            f"--max-num-batched-tokens ({config.max_num_batched_tokens}) is smaller than "
            f"--max-model-len ({want}) with chunked prefill off, so long prompts could "
            "never be scheduled. Raise --max-num-batched-tokens, lower --max-model-len, or "
            "use --enable-chunked-prefill.")
    return want


# A step computing this many prompt tokens runs long (~25 ms on an H200 for a 7B model,
# ~175 ms at 8,192 tokens), several times the host work (~20 ms to launch a prefill step,
# BENCHMARKS.md 2026-12-02) that scheduling its successor ahead of time would hide. But a
# successor scheduled before it ends is closed to every request that arrives meanwhile:
# those waited out both steps (a whole 8,192-token prefill step, ~175 ms, of time to first
# token in the 64-user run). So the server resolves such a step before scheduling again
# when the next step has room for arrivals (`Scheduler.room_for_arrivals`).
HOLD_AFTER_PROMPT_TOKENS = 1024


@dataclass
class _Launched:
    """A step whose forward is queued: what it runs, who samples, and the sample."""

    sched: SchedulerOutput
    sampling: list[Request]
    logits: torch.Tensor | None
    sampler_step: SamplerStep
    pending: PendingSample | None = None
    prompt_logprobs: object | None = None     # runner.PromptLogprobRows
    prompt_tokens: int = 0                    # prompt tokens it computes


class EngineCore:
    def __init__(self, config: EngineConfig, model_dir: str | Path,
                 eos_token_ids: tuple[int, ...] | None = None, usage: str = "offline") -> None:
        config.validate()
        compile_watch.mark_starting()
        device = resolve_device(config.device)
        gpu_mem = (torch.cuda.get_device_properties(device).total_memory
                   if device.type == "cuda" else None)
        capability = (torch.cuda.get_device_capability(device) if device.type == "cuda"
                      else None)
        note = resolve_limits(config, usage, gpu_mem, capability)
        if note:
            log.info("%s", note)
        self.config = config
        self.model_dir = Path(model_dir)
        self.model_cfg = ModelConfig.from_dir(self.model_dir, config.hf_overrides)
        self.max_model_len = resolve_max_model_len(config, self.model_cfg)
        self.eos_token_ids = tuple(eos_token_ids if eos_token_ids is not None
                                   else self.model_cfg.eos_token_ids)
        # One device: a ModelRunner. Tensor parallel: rank 0's driver, which starts the
        # other ranks' workers and has them execute every step with it (tp_executor.py).
        self.runner = make_runner(config, self.model_dir, self.model_cfg, self.max_model_len)
        try:
            self.device = self.runner.device
            self.sampler = Sampler(self.model_cfg.vocab_size, self.device, config.max_num_seqs,
                                   seed=config.seed)
            self.runner.init_kv_cache()
        except BaseException:
            self.shutdown()
            raise
        self.kv = KVCacheManager(self.runner.layout.num_blocks, config.block_size,
                                 config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   policy=config.scheduling_policy,
                                   max_model_len=self.max_model_len,
                                   long_prefill_token_threshold=config.long_prefill_token_threshold,
                                   short_prompt_tokens=config.short_prompt_tokens,
                                   short_overtake_s=SHORT_PROMPT_OVERTAKE_S)
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self.structured = StructuredRequests(config.tokenizer or self.model_dir,
                                             self.model_cfg.vocab_size, self.eos_token_ids,
                                             config.max_num_seqs, self.device)
        self._inflight: _Launched | None = None
        # Serving: no running ahead of a long prefill step while the next step has room
        # (see HOLD_AFTER_PROMPT_TOKENS). Offline every request is known from the start,
        # so there is nobody to wait for.
        self.hold_after_prompt_tokens = HOLD_AFTER_PROMPT_TOKENS if usage == "server" else None
        self.progressed = False   # the last step launched or resolved one (else: idle)
        self.num_steps = 0
        self.num_overlapped_steps = 0
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0
        self._last_step_tokens = 0
        try:
            warmup.warm_up(self)   # lazy compiles now, not in a user's step
        except BaseException:
            self.shutdown()
            raise
        if self.device.type == "cuda" and compile_watch.install():
            compile_watch.mark_ready()   # a compile from here on is logged as a stall

    def ready_info(self) -> CoreReady:
        return CoreReady(max_model_len=self.max_model_len, num_blocks=self.kv.num_blocks,
                         block_size=self.kv.block_size, vocab_size=self.model_cfg.vocab_size,
                         eos_token_ids=list(self.eos_token_ids), device=str(self.device),
                         max_num_seqs=self.config.max_num_seqs,
                         max_num_batched_tokens=self.config.max_num_batched_tokens,
                         memory_report={k: float(v) for k, v in
                                        getattr(self.runner, "memory_report", {}).items()})

    # -- requests --------------------------------------------------------------------
    def add_request(self, cr: CoreRequest) -> None:
        """Queue a request validated at the edge; raises RequestRejected if it can
        never run here (the caller answers its client, nothing else changes)."""
        if cr.request_id in self.scheduler.requests or cr.request_id in self.structured.waiting:
            raise RequestRejected(f"request id {cr.request_id!r} is already in use", "request_id")
        faults.check("add", cr.request_id)
        ids = cr.prompt_token_ids
        if not ids:
            raise RequestRejected("the prompt is empty", "prompt")
        p = cr.params
        need = self.kv.blocks_needed(len(ids) + p.max_tokens)
        if need > self.kv.num_blocks:
            raise RequestRejected(
                f"the request needs up to {len(ids) + p.max_tokens} tokens of KV cache but the "
                f"whole cache holds {self.kv.num_blocks * self.kv.block_size}; lower max_tokens",
                "max_tokens")
        req = Request(cr.request_id, ids, p, priority=cr.priority, arrival_time=cr.arrival_time,
                      eos_token_ids=self.eos_token_ids, prefix_leader=cr.prefix_leader)
        if p.seed is not None and not p.greedy:
            req.generator = torch.Generator(device=self.device).manual_seed(p.seed & (2**64 - 1))
        if p.grammar is not None:
            self.structured.submit(req)    # queued for scheduling once it has compiled
        else:
            self.scheduler.add(req)

    def abort(self, cmd: CoreAbort) -> CoreOutputs:
        if cmd.only_if_waiting:
            return self._expire(cmd.request_ids)
        out = CoreOutputs()
        for rid in cmd.request_ids:
            req = self.scheduler.requests.get(rid)
            if req is None:
                if self.structured.abort(rid) is not None:   # still compiling its grammar
                    out.outputs.append(CoreOutput(rid, [], finish_reason="abort"))
                continue
            self._finish(req, "abort")
            out.outputs.append(CoreOutput(rid, [], finish_reason="abort"))
        return out

    def _expire(self, request_ids: list[str]) -> CoreOutputs:
        """A queue timeout: `request_ids` are the open choices of one HTTP request, and
        the timeout is the request's. Decided here, not on the API side alone, because
        a choice can be scheduled while the API's message travels: then the request is
        being served and all of its choices stay."""
        out = CoreOutputs()
        reqs = [self.scheduler.requests.get(rid) for rid in request_ids]
        # Never scheduled: queued, or still compiling its grammar. A member the core no
        # longer holds has finished (served, or failed: that fails the HTTP request).
        if not all(rid in self.structured.waiting if req is None else not req.ever_scheduled
                   for rid, req in zip(request_ids, reqs)):
            return out
        for rid, req in zip(request_ids, reqs):
            if req is None:
                self.structured.abort(rid)
            else:
                self._finish(req, "abort")
            out.failed.append(CoreFailure(rid, "queue_timeout", "waited in the queue too long"))
        return out

    def has_unfinished_requests(self) -> bool:
        if self.scheduler.has_unfinished() or self.structured.waiting:
            return True
        step = self._inflight   # a launched step matters only while it serves someone
        return step is not None and any(not r.is_finished for r in step.sampling)

    def _finish(self, req: Request, reason: str, stop_reason: int | None = None) -> None:
        self.scheduler.finish(req, reason, stop_reason)
        self.structured.released(req)
        self._release_slot(req)

    def _release_slot(self, req: Request) -> None:
        if req.slot >= 0:
            self.sampler.slot_released(req)
            self._free_slots.append(req.slot)
            req.slot = -1

    def _fail(self, req: Request, exc: BaseException, out: CoreOutputs, stage: str) -> None:
        if not req.is_finished:
            self._finish(req, "abort")
        if isinstance(exc, GrammarDeadEnd):   # the request's own doing: its words, a 400
            out.failed.append(CoreFailure(req.request_id, "invalid", str(exc)))
            return
        log.warning("request %s failed while %s: %s: %s", req.request_id, stage,
                    type(exc).__name__, exc)
        out.failed.append(CoreFailure(req.request_id, "error",
                                      f"the request failed while {stage}: {type(exc).__name__}"))

    # -- stepping --------------------------------------------------------------------
    def step(self) -> CoreOutputs:
        """One engine step; returns what changed since the last one."""
        out = CoreOutputs()
        self._last_step_tokens = 0
        if self.structured.waiting:
            self._admit_compiled(out)
        prev = self._inflight
        if self._hold_for_arrivals(prev):
            # Let the long step finish before scheduling the next: requests that arrive
            # meanwhile (the caller drains them between steps) join the step right after
            # it instead of waiting out a second one.
            launched = None
        else:
            sched = self._schedule(out)
            launched = self._launch(sched, out) if not sched.is_empty else None
        self.progressed = launched is not None or prev is not None
        self._inflight = None
        if prev is not None:
            self._resolve(prev, out)
            if launched is not None:
                self.num_overlapped_steps += 1
        if launched is not None:
            self.scheduler.advance(launched.sched, pending=True)   # their tokens are known now
            self._sample(launched)
            if self.config.async_scheduling:
                self._inflight = launched
            else:
                self._resolve(launched, out)
        out.stats = self.stats()
        out.timestamp = time.time()
        return out

    def _hold_for_arrivals(self, prev: _Launched | None) -> bool:
        return (prev is not None and self.hold_after_prompt_tokens is not None
                and prev.prompt_tokens >= self.hold_after_prompt_tokens
                and self.scheduler.room_for_arrivals())

    def _admit_compiled(self, out: CoreOutputs) -> None:
        ready, failed = self.structured.take_ready()
        for req in ready:
            self.scheduler.add(req)
        for req, message in failed:
            out.failed.append(CoreFailure(req.request_id, "invalid", message))

    def _schedule(self, out: CoreOutputs) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        for r in sched.preempted:
            self._release_slot(r)
            out.preempted.append(r.request_id)
        out.scheduled.extend(r.request_id for r in sched.first_scheduled)
        if sched.resumed:
            out.resumed.extend(r.request_id for r in sched.resumed)
        return sched

    def _launch(self, sched: SchedulerOutput, out: CoreOutputs) -> _Launched | None:
        """Stage the step's inputs and queue its forward. Rows whose per-request host
        work fails are taken out of the step and failed alone."""
        if faults.active:
            faults.check_stall([s.request.request_id for s in sched.scheduled])
            faults.check_fatal(s.request.request_id for s in sched.scheduled)
            self._drop_faulty(sched, out, "preparing")
            if sched.is_empty:
                return None
        new: list[Request] = []
        for s in sched.scheduled:
            r = s.request
            if r.slot < 0:
                r.slot = self._free_slots.pop()
                self.sampler.slot_taken(r)
                new.append(r)
        staging = self.runner.staging
        tables = [self.kv.blocks_of(s.request.request_id) for s in sched.scheduled]
        sampling = [s.request for s in sched.scheduled if s.samples]
        while True:
            staging.begin()
            try:
                rstep: StagedStep = self.runner.stage(sched, tables)
                sstep = self.sampler.stage(staging, sampling, new)
                break
            except StagingOverflow as e:
                staging.grow(e)
        staging.commit()
        if rstep.prompt_logprobs is not None:   # staged once: a recompute skips them
            for r, first, n in rstep.prompt_logprobs.segments:
                r.prompt_logprobs_next = first + n
        logits = self.runner.execute(rstep)
        n_tok = n_prompt = 0
        for s in sched.scheduled:
            r, n = s.request, s.num_new_tokens
            n_tok += n
            n_prompt += max(0, min(r.num_computed_tokens + n, r.num_prompt_tokens)
                            - r.num_computed_tokens)
        self.prompt_tokens_computed += n_prompt
        self._last_step_tokens = n_tok
        self.scheduler.advance(sched, pending=False)
        for i, r in enumerate(sampling):
            r.num_pending += 1
            r.sample_row = i
        self.num_steps += 1
        return _Launched(sched, sampling, logits, sstep, prompt_logprobs=rstep.prompt_logprobs,
                         prompt_tokens=n_prompt)

    def _drop_faulty(self, sched: SchedulerOutput, out: CoreOutputs, stage: str) -> None:
        keep = []
        for s in sched.scheduled:
            try:
                faults.check("prepare", s.request.request_id)
                keep.append(s)
            except Exception as exc:  # noqa: BLE001 - isolate the one request
                self._fail(s.request, exc, out, stage)
        if len(keep) != len(sched.scheduled):
            sched.num_decodes = sum(1 for s in keep[:sched.num_decodes]
                                    if s.num_new_tokens == 1 and s.samples)
            sched.scheduled = keep

    def _sample(self, step: _Launched) -> None:
        staging = self.runner.staging
        if step.sampling:
            grammar = self.structured.stage_bitmask(step.sampling)
            step.pending = self.sampler.sample(step.logits, step.sampler_step, staging,
                                               self.runner.last_tokens, grammar)
        else:   # nobody samples, but new slots' parameters must still be written
            self.sampler.apply_updates(step.sampler_step, staging)
        step.logits = None

    def _resolve(self, step: _Launched, out: CoreOutputs) -> None:
        """Read a step's tokens back and update its requests. Requests that finished
        or were aborted meanwhile are skipped: their token is dropped."""
        prompt_lps: dict[str, Logprobs] = {}
        if step.prompt_logprobs is not None:
            for req, _, lps in step.prompt_logprobs.results():
                if not req.is_finished:
                    prompt_lps[req.request_id] = lps
        if step.pending is not None:
            result = step.pending.resolve()
            for req, token, lp in zip(step.sampling, result.token_ids, result.logprobs):
                req.num_pending -= 1
                if req.is_finished:
                    continue
                try:
                    faults.check("finish", req.request_id)
                    self._append(req, token, lp, out, prompt_lps.pop(req.request_id, None))
                except Exception as exc:  # noqa: BLE001 - isolate the one request
                    self._fail(req, exc, out, "finishing a step")
        for rid, lps in prompt_lps.items():   # chunks that did not sample yet
            out.outputs.append(CoreOutput(rid, [], prompt_logprobs=lps))

    def _append(self, req: Request, token: int, lp: Logprobs | None, out: CoreOutputs,
                prompt_lp: Logprobs | None = None) -> None:
        grammar = req.structured
        if grammar is not None and not grammar.accept(token):
            self._grammar_refused(req, out, prompt_lp)
            return
        req.all_token_ids.append(token)
        self.generation_tokens += 1
        p = req.params
        n_out = req.num_output_tokens
        cached = req.num_cached_tokens if n_out == 1 else -1
        finish, stop = None, None
        if grammar is not None and grammar.is_terminated():
            finish = "stop"     # the output is complete under its grammar
        if finish is None and n_out >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                finish = "stop"
            elif token in p.stop_token_ids:
                finish, stop = "stop", token
        if finish is None and (n_out >= req.max_tokens
                               or len(req.all_token_ids) >= self.max_model_len):
            finish = "length"
        if finish is not None:
            self._finish(req, finish, stop)
        out.outputs.append(CoreOutput(req.request_id, [token], lp, finish, stop, cached,
                                      prompt_lp))

    def _grammar_refused(self, req: Request, out: CoreOutputs,
                         prompt_lp: Logprobs | None) -> None:
        """The sampled token breaks the request's grammar: the sampler masked what the
        grammar allowed, so either only the grammar's end was left and the request's
        own min_tokens (or logit_bias) kept it out: the grammar wins, the request stops
        there, the token unused; or the grammar allows nothing at all (the client's
        grammar has a dead end: a 400); else the mask was not applied, a bug."""
        left = req.structured.next_allowed()
        if left == "stop":
            cached = req.num_cached_tokens if req.num_output_tokens == 0 else -1
            self._finish(req, "stop")
            out.outputs.append(CoreOutput(req.request_id, [], None, "stop", None, cached,
                                          prompt_lp))
        elif left == "none":
            raise GrammarDeadEnd(f"the request's structured-output constraint allows no "
                                 f"token after {req.num_output_tokens} generated tokens")
        else:
            raise GrammarViolation("the sampled token does not fit the request's grammar")

    # -- observability ---------------------------------------------------------------
    def stats(self) -> CoreStats:
        s = self.scheduler
        return CoreStats(
            num_running=len(s.running), num_waiting=len(s.waiting),
            kv_cache_usage=self.kv.usage, free_blocks=self.kv.num_free_blocks,
            total_blocks=self.kv.num_blocks, prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits, num_preemptions=s.num_preemptions,
            prompt_tokens=self.prompt_tokens_computed, generation_tokens=self.generation_tokens,
            num_steps=self.num_steps, step_tokens=self._last_step_tokens)

    def counters(self) -> dict:
        """Introspection for tests and utilities: what the core has computed."""
        return {"generation_tokens": self.generation_tokens, "num_steps": self.num_steps,
                "num_overlapped_steps": self.num_overlapped_steps,
                "running": sorted(self.scheduler.running),
                "waiting": sorted(r.request_id for r in self.scheduler.waiting),
                "free_blocks": self.kv.num_free_blocks, "total_blocks": self.kv.num_blocks}

    def parallel_info(self) -> dict:
        """The tensor-parallel ranks: pids, devices, loaded shards (tests, utilities)."""
        info = getattr(self.runner, "parallel_info", None)
        return info() if info is not None else {"tensor_parallel_size": 1}

    def reset_after_warm_up(self) -> None:
        """Forget the warm-up: its prefix-cache entries and every counter (metrics
        start from nothing). Only with no request in the engine."""
        assert not self.has_unfinished_requests()
        self.kv.reset_prefix_cache()
        self.reset_counters()

    def reset_counters(self) -> CoreStats:
        """Zero what the metrics count (prefix-cache lookups, preemptions, steps,
        tokens) and return the stats as they then stand. The API server calls it once,
        after its own warm-up request, before it takes any request."""
        self.kv.stats = CacheStats()
        self.scheduler.num_preemptions = 0
        self.num_steps = self.num_overlapped_steps = 0
        self.prompt_tokens_computed = self.generation_tokens = 0
        return self.stats()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one device)."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    def check_whole(self) -> dict:
        self.kv.check_whole()
        assert len(self._free_slots) == self.config.max_num_seqs, "row slots leaked"
        return {"ok": True}
