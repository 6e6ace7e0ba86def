"""Offline API: `LLM(model_dir, ...).generate(prompts, params)`, vLLM's shape."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

from pagefleet.server.config import EngineConfig
from pagefleet.server.engine.engine import LLMEngine
from pagefleet.server.engine.outputs import RequestOutput
from pagefleet.server.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | Path, **kwargs) -> None:
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = set(kwargs) - names
        if unknown:
            raise TypeError(f"unknown LLM argument(s): {', '.join(sorted(unknown))}")
        self.config = EngineConfig(model=str(model), **kwargs)
        self.engine = LLMEngine(self.config, usage="offline")
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """Run all prompts to completion; outputs come back in prompt order, each with
        `params.n` sequences (vLLM's `outputs[j]`, `index` j). Sequence j of a prompt is
        sampled with seed + j (0: the request's seed, so n=1 and the first of n agree,
        as the HTTP server does) and shares the prompt's KV blocks with sequence 0."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or self.default_sampling_params()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        groups: list[list[str]] = []          # per prompt: its sequences' request ids
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                group: list[str] = []
                groups.append(group)
                for j in range(p.n):
                    rid = f"offline-{next(self._ids)}"
                    one = dataclasses.replace(
                        p, n=1, output_kind="final",
                        seed=p.seed + j if p.seed is not None and j else p.seed)
                    self.engine.add_request(rid, prompt, one,
                                            priority=priority[i] if priority else 0,
                                            prefix_leader=group[0] if group else None)
                    group.append(rid)
        except Exception:
            for rid in (r for g in groups for r in g):
                self.engine.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [self._merged([final[rid] for rid in group]) for group in groups]

    @staticmethod
    def _merged(outs: list[RequestOutput]) -> RequestOutput:
        """A prompt's sequences as one output: the first's fields, every sequence's
        completion with its index."""
        first = outs[0]
        if len(outs) == 1:
            return first
        seqs = [dataclasses.replace(o.outputs[0], index=j) for j, o in enumerate(outs)]
        return dataclasses.replace(first, outputs=seqs)

    def chat(self, messages: list[dict] | list[list[dict]],
             params: SamplingParams | list[SamplingParams] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of messages) or several, rendered
        with the model's chat template (or `chat_template`) and generated as the HTTP
        server's /v1/chat/completions would prompt them (no special tokens added)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        kwargs = dict(chat_template_kwargs or {})
        if tools is not None:
            kwargs["tools"] = tools
        prompts = [self.tokenizer.encode(
            self.tokenizer.apply_chat_template(
                conv, tokenize=False, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **kwargs),
            add_special_tokens=False) for conv in convs]
        return self.generate(prompts, params)

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's default: the checkpoint's generation_config.json sampling fields."""
        return SamplingParams(**self.engine.generation_defaults)

    def stats(self) -> dict:
        return dataclasses.asdict(self.engine.stats())

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers now (else when the LLM is collected)."""
        self.engine.shutdown()
