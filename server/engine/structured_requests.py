"""The engine core's side of structured outputs: requests waiting for their grammar to
compile, each running request's matcher, and every step's token bitmask.

A request with a grammar is not queued for scheduling until its grammar has compiled
(in the compiler's threads, off the step loop); the engine goes on meanwhile. Once
running, each sampled token advances its matcher when the step is read back, and the
next step's bitmask is filled on the host (rows of the requests that enforce a
grammar) and copied to the device before that step's sampling is queued; the sampler
masks the logits first. Built on first use: a server that never sees a grammar never
loads xgrammar.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from pagefleet.server.engine.request import Request

log = logging.getLogger("pagefleet.engine")

COMPILE_TIMEOUT_S = 60.0


class GrammarViolation(RuntimeError):
    """A sampled token the grammar does not allow (the mask was not applied: a bug)."""


class GrammarDeadEnd(ValueError):
    """The request's grammar allows no token at all here (neither going on nor
    stopping): the client's constraint cannot be satisfied, a 400 for the request."""


class StructuredRequests:
    def __init__(self, tokenizer_path: str | Path, vocab_size: int, eos_token_ids,
                 max_rows: int, device: torch.device) -> None:
        self.tokenizer_path = str(tokenizer_path)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_rows = max_rows
        self.device = device
        self.waiting: dict[str, tuple[Request, Future, float]] = {}
        self.num_running = 0
        self._compiler = None
        self._buffers = None

    def _build(self) -> None:
        from pagefleet.server.engine.engine import load_tokenizer
        from pagefleet.server.engine.structured_output import (BitmaskBuffers, GrammarCompiler,
                                                               tokenizer_info)
        t0 = time.perf_counter()
        info = tokenizer_info(load_tokenizer(self.tokenizer_path), self.vocab_size,
                              self.eos_token_ids)
        self._compiler = GrammarCompiler(info)
        self._buffers = BitmaskBuffers(self.max_rows, self.vocab_size, self.device)
        log.info("structured outputs: grammar compiler ready in %.1f s",
                 time.perf_counter() - t0)

    def submit(self, req: Request) -> None:
        from pagefleet.server.engine.structured_output import GrammarSpec
        if self._compiler is None:
            self._build()
        kind, text, syntax, any_ws = req.params.grammar
        fut = self._compiler.submit(GrammarSpec(kind, text, syntax, any_ws))
        self.waiting[req.request_id] = (req, fut, time.monotonic())

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose grammar is ready (matcher attached) and those that failed."""
        from pagefleet.server.engine.structured_output import (GrammarStatus, StructuredState,
                                                               grammar_status)
        ready, failed = [], []
        now = time.monotonic()
        for rid, (req, fut, t0) in list(self.waiting.items()):
            status = grammar_status(fut, now - t0, COMPILE_TIMEOUT_S)
            if status is GrammarStatus.WAITING:
                continue
            del self.waiting[rid]
            if status is GrammarStatus.READY:
                p = req.params
                stops = list(p.stop_token_ids) + list(req.eos_token_ids)
                req.structured = StructuredState(fut.result(), stops, p.reasoning_end_token_id,
                                                 p.reasoning_start_token_id)
                self.num_running += 1
                ready.append(req)
            elif status is GrammarStatus.TIMED_OUT:
                failed.append((req, f"the grammar did not compile within {COMPILE_TIMEOUT_S:g}s"))
            else:
                failed.append((req, str(fut.exception())))
        return ready, failed

    def abort(self, request_id: str) -> Request | None:
        entry = self.waiting.pop(request_id, None)
        return entry[0] if entry else None

    def released(self, req: Request) -> None:
        if req.structured is not None:
            req.structured = None
            self.num_running -= 1

    def stage_bitmask(self, sampling: list[Request]):
        """This step's bitmask on the device for the rows that enforce a grammar:
        (bitmask, logits rows) for the sampler, or None."""
        if not self.num_running or self._buffers is None:
            return None
        rows = [(i, r.structured) for i, r in enumerate(sampling)
                if r.structured is not None and not r.is_finished
                and not r.structured.is_terminated()]
        return self._buffers.stage(rows) if rows else None
