"""`LLMEngine`: the engine core in-process, with the edge's work around it.

The offline `LLM` (and tests) drive the core directly, synchronously, on the same
delta path the server uses across its process boundary: requests are tokenized and
validated here, the core returns each step's new token ids, and the
`OutputProcessor` turns them into text outputs (stop strings included; a matched stop
string aborts the request in the core at once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from pagefleet.server.config import EngineConfig
from pagefleet.server.engine.core import EngineCore
from pagefleet.server.engine.output_processor import OutputProcessor
from pagefleet.server.engine.outputs import RequestOutput
from pagefleet.server.engine.protocol import CoreAbort, CoreOutputs
from pagefleet.server.engine.sampling_params import SamplingParams
from pagefleet.server.engine.validation import (EngineLimits, PromptTooLongError,  # noqa: F401
                                                RequestRejected)
from pagefleet.server.models.config import ModelConfig, generation_defaults

log = logging.getLogger("pagefleet.engine")


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


def eos_token_ids(model_cfg: ModelConfig, tokenizer) -> tuple[int, ...]:
    """EOS ids from the checkpoint's configs, plus the tokenizer's own."""
    eos = list(model_cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return tuple(eos)


class LLMEngine:
    def __init__(self, config: EngineConfig, model_dir: str | Path | None = None,
                 usage: str = "offline") -> None:
        self.config = config
        self.model_dir = Path(model_dir or config.model)
        self.model_cfg = ModelConfig.from_dir(self.model_dir, config.hf_overrides)
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_dir)
        self.generation_defaults = generation_defaults(self.model_dir)
        self.eos_token_ids = eos_token_ids(self.model_cfg, self.tokenizer)
        self.core = EngineCore(config, self.model_dir, self.eos_token_ids, usage=usage)
        self.max_model_len = self.core.max_model_len
        self.limits = EngineLimits(self.max_model_len, self.model_cfg.vocab_size,
                                   self.core.kv.num_blocks, self.core.kv.block_size,
                                   config.max_logprobs)
        self.processor = OutputProcessor(self.tokenizer)

    # The core's parts, for tests and benchmarks.
    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv(self):
        return self.core.kv

    @property
    def runner(self):
        return self.core.runner

    @property
    def sampler(self):
        return self.core.sampler

    @property
    def num_overlapped_steps(self) -> int:
        return self.core.num_overlapped_steps

    # -- requests --------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    *, priority: int = 0, arrival_time: float = 0.0,
                    prefix_leader: str | None = None) -> None:
        """Validate and queue a request; raises RequestRejected for what can never run."""
        if request_id in self.processor.states:
            raise RequestRejected(f"request id {request_id!r} is already in use", "request_id")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenize(prompt)
        else:
            text, ids = None, list(prompt)
        cr = self.limits.core_request(request_id, ids, params, priority=priority,
                                      arrival_time=arrival_time, prefix_leader=prefix_leader)
        self.processor.add(request_id, text, ids, params)
        try:
            self.core.add_request(cr)
        except BaseException:
            self.processor.remove(request_id)
            raise

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a queued or running request now; its blocks go back to the pool."""
        self.core.abort(CoreAbort([request_id]))
        return self.processor.finish(request_id, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (they also stop when this object
        is collected or the process exits)."""
        self.core.shutdown()

    def step(self) -> list[RequestOutput]:
        """One engine step: the outputs of requests that progressed (as each asked:
        delta, cumulative, or only when finished)."""
        core_out: CoreOutputs = self.core.step()
        results, stopped = self.processor.process(core_out.outputs)
        if stopped:
            self.core.abort(CoreAbort(stopped))
        for f in core_out.failed:
            log.warning("request %s failed in the engine: %s", f.request_id, f.message)
            out = self.processor.finish(f.request_id, "error")
            if out is not None:
                results.append(out)
        return results

    # -- observability -----------------------------------------------------------------
    def stats(self) -> EngineStats:
        s = self.core.stats()
        return EngineStats(
            num_running=s.num_running, num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage, free_blocks=s.free_blocks,
            total_blocks=s.total_blocks, prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits, num_preemptions=s.num_preemptions,
            prompt_tokens=s.prompt_tokens, generation_tokens=s.generation_tokens)
