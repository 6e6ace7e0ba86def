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
        """Run all prompts to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or self.default_sampling_params()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = f"offline-{next(self._ids)}"
                if p.output_kind != "final":
                    p = dataclasses.replace(p, output_kind="final")
                self.engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's default: the checkpoint's generation_config.json sampling fields."""
        return SamplingParams(**self.engine.generation_defaults)

    def stats(self) -> dict:
        return dataclasses.asdict(self.engine.stats())

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers now (else when the LLM is collected)."""
        self.engine.shutdown()
