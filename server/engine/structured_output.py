"""Structured outputs, engine-core side: grammars compiled off the step loop and cached,
per-request matchers, and the token bitmask that travels host -> device every step.

Backend: xgrammar (the one vLLM defaults to). Its compile calls release the GIL
(measured: `benchmarks/grammar_gil.py`), so a compile in the pool's threads does not
stall the step loop's Python; a request whose grammar is not ready yet waits in the
queue, the engine does not.

The per-step path, for the rows of a batch that have a grammar:

    rows = fill(rows_and_states, bitmask_host)     # host: xgrammar writes packed rows
    bm, idx = buffers.upload(rows)                 # pinned -> device, non_blocking
    apply(logits, bm, idx)                         # device: -inf where not allowed

`BitmaskBuffers` owns the pinned host buffers and their device twins and does the three
in one call (`stage`). Nothing on the path reads a device value back.
"""

from __future__ import annotations

import enum
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xgrammar as xgr

from pagefleet.server.engine.xgrammar_workarounds import bounded_strings_as_patterns

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
GRAMMAR_SYNTAXES = ("ebnf", "lark")
JSON_OBJECT_SCHEMA = '{"type": "object"}'


# -- what to enforce -----------------------------------------------------------------
@dataclass(frozen=True)
class GrammarSpec:
    """One constraint, as plain strings: hashable (the compile cache key) and cheap to
    send from the API process to the engine core.

    kind: json_schema (`text` is the schema as canonical JSON), json_object (`text`
    unused: any JSON object), regex (`text` is the pattern), choice (`text` is a JSON
    array of the allowed strings), grammar (`text` is the source, `syntax` says EBNF
    (GBNF, root rule `root`) or Lark (root rule `start`)). `any_whitespace` lets JSON
    kinds put any whitespace between tokens (vLLM's default); False means compact JSON.
    """

    kind: str
    text: str = ""
    syntax: str = ""
    any_whitespace: bool = True

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}; one of {GRAMMAR_KINDS}")
        if (self.kind == "grammar") != (self.syntax in GRAMMAR_SYNTAXES):
            raise ValueError(f"syntax {self.syntax!r} does not fit kind {self.kind!r}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any], any_whitespace: bool = True) -> GrammarSpec:
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return cls("json_schema", text, any_whitespace=any_whitespace)

    @classmethod
    def json_object(cls, any_whitespace: bool = True) -> GrammarSpec:
        return cls("json_object", any_whitespace=any_whitespace)

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> GrammarSpec:
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def grammar(cls, source: str) -> GrammarSpec:
        return cls("grammar", source, syntax=grammar_syntax(source))

    @property
    def choices(self) -> list[str]:
        return json.loads(self.text) if self.kind == "choice" else []


def grammar_syntax(source: str) -> str:
    """EBNF if any rule is written `name ::= ...` (GBNF, as vLLM and llama.cpp take it),
    else Lark (`name: ...`): the same rule vLLM uses to tell them apart."""
    for line in source.splitlines():
        code = line.split("#", 1)[0].split("//", 1)[0]
        if "::=" in code:
            return "ebnf"
    return "lark"


def _ebnf_literal(text: str) -> str:
    """A GBNF string literal matching `text` exactly (every non-printable-ASCII char as
    a \\u / \\U escape, so no choice can break out of its quotes)."""
    out = []
    for ch in text:
        cp = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= cp < 0x7F:
            out.append(ch)
        elif cp <= 0xFFFF:
            out.append(f"\\u{cp:04x}")
        else:
            out.append(f"\\U{cp:08x}")
    return '"' + "".join(out) + '"'


def choice_ebnf(choices: Sequence[str]) -> str:
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def parse_grammar(spec: GrammarSpec, tokenizer_info: xgr.TokenizerInfo | None = None
                  ) -> xgr.Grammar:
    """Spec -> xgrammar Grammar. Tokenizer-independent and cheap (no token masks): the
    API process runs it to validate at the edge, the compiler to compile. Raises
    RuntimeError/ValueError with xgrammar's message for an invalid spec."""
    if spec.kind == "json_schema":
        schema = bounded_strings_as_patterns(json.loads(spec.text))
        return xgr.Grammar.from_json_schema(json.dumps(schema),
                                            any_whitespace=spec.any_whitespace,
                                            strict_mode=True)
    if spec.kind == "json_object":
        return xgr.Grammar.from_json_schema(JSON_OBJECT_SCHEMA,
                                            any_whitespace=spec.any_whitespace)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.text)
    if spec.kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(spec.choices))
    if spec.syntax == "lark":
        return xgr.Grammar.from_lark(spec.text, tokenizer_info=tokenizer_info)
    return xgr.Grammar.from_ebnf(spec.text)


# -- tokenizer -----------------------------------------------------------------------
def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]
                   ) -> xgr.TokenizerInfo:
    """xgrammar's view of an HF tokenizer, padded to the model's `vocab_size` (the
    logits width, often larger than `len(tokenizer)`: the padded ids are never
    allowed). `stop_token_ids` are the model's EOS ids (generation_config's list):
    what a finished grammar allows."""
    stops = sorted({int(t) for t in stop_token_ids})
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=stops or None)


# -- compiling off the step loop -----------------------------------------------------
class GrammarCompileError(ValueError):
    """A spec that passed the edge's checks but did not compile (the request fails
    with this message; it is never the engine's failure)."""


class GrammarStatus(enum.Enum):
    READY = "ready"
    WAITING = "waiting"
    FAILED = "failed"
    TIMED_OUT = "timed_out"


@dataclass
class CompileStats:
    compiles: int = 0      # compiles started
    hits: int = 0          # submits answered from the cache (done or in flight)
    failures: int = 0


class GrammarCompiler:
    """Compiles GrammarSpecs on a thread pool, with an LRU cache of futures keyed by the
    spec: the same schema sent by a thousand requests compiles once, and a second
    request for a spec still compiling waits on the same future. Failed compiles are
    dropped from the cache (a retry compiles again)."""

    def __init__(self, info: xgr.TokenizerInfo, *, max_workers: int = 2,
                 compile_threads: int = 4, cache_size: int = 512) -> None:
        self.tokenizer_info = info
        self._xgr = xgr.GrammarCompiler(info, max_threads=compile_threads,
                                        cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.stats = CompileStats()

    def submit(self, spec: GrammarSpec) -> Future:
        """A future of the spec's `xgr.CompiledGrammar`; never blocks."""
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                self.stats.hits += 1
                return fut
            self.stats.compiles += 1
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        fut.add_done_callback(lambda f, s=spec: self._forget_failure(s, f))
        return fut

    def is_ready(self, spec: GrammarSpec) -> bool:
        with self._lock:
            fut = self._cache.get(spec)
        return (fut is not None and fut.done() and not fut.cancelled()
                and fut.exception() is None)

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            return self._xgr.compile_grammar(parse_grammar(spec, self.tokenizer_info))
        except Exception as exc:   # xgrammar raises RuntimeError, ValueError, TypeError
            raise GrammarCompileError(f"{spec.kind} did not compile: {exc}") from exc

    def _forget_failure(self, spec: GrammarSpec, fut: Future) -> None:
        if fut.cancelled() or fut.exception() is None:
            return
        with self._lock:
            self.stats.failures += 1
            if self._cache.get(spec) is fut:
                del self._cache[spec]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def grammar_status(fut: Future, waited_s: float, timeout_s: float | None) -> GrammarStatus:
    """Pure: where a waiting request's grammar stands. The engine schedules READY
    requests, keeps WAITING ones queued, and fails FAILED / TIMED_OUT ones with the
    future's error or a timeout message (a compile cannot be interrupted; its thread
    finishes on its own and the result is still cached for later requests)."""
    if fut.done():
        failed = fut.cancelled() or fut.exception() is not None
        return GrammarStatus.FAILED if failed else GrammarStatus.READY
    if timeout_s is not None and waited_s >= timeout_s:
        return GrammarStatus.TIMED_OUT
    return GrammarStatus.WAITING


# -- per-request matcher -------------------------------------------------------------
@dataclass
class StructuredState:
    """One request's position in its grammar.

    `reasoning_end_token_id`: when set, tokens pass freely (the bitmask is not applied)
    until that token (e.g. `</think>`) has been generated; the grammar constrains the
    tokens after it: the output starts inside the reasoning.
    `reasoning_start_token_id` (with the end token): the output starts outside the
    reasoning, and its first token decides, as `api.reasoning.ReasoningBoundary` does
    in token space: the first step allows the grammar's tokens and the start token
    (`<think>`); the start token opens the reasoning (free until the end token, then
    the grammar), any other token is the grammar's first. So a model that wants to
    think can, and one that does not answers under the grammar from its first token.
    A finished grammar allows only the stop tokens; accepting one terminates the
    matcher, and the engine finishes the request then, whatever `ignore_eos` says.
    """

    compiled: xgr.CompiledGrammar
    stop_token_ids: Sequence[int] | None = None
    reasoning_end_token_id: int | None = None
    reasoning_start_token_id: int | None = None
    matcher: xgr.GrammarMatcher = field(init=False, repr=False)
    _free: int = field(default=0, init=False)       # tokens seen before enforcing
    _matched: int = field(default=0, init=False)    # tokens fed to the matcher
    _phase: str = field(default="enforcing", init=False)

    def __post_init__(self) -> None:
        stops = sorted(set(self.stop_token_ids)) if self.stop_token_ids else None
        self.matcher = xgr.GrammarMatcher(self.compiled, override_stop_tokens=stops)
        if self.reasoning_start_token_id is not None and self.reasoning_end_token_id is None:
            raise ValueError("reasoning_start_token_id needs reasoning_end_token_id")
        self._phase = self._initial_phase()

    def _initial_phase(self) -> str:
        """"undecided" (outside; the first token may open the reasoning), "free"
        (inside the reasoning) or "enforcing"."""
        if self.reasoning_end_token_id is None:
            return "enforcing"
        return "undecided" if self.reasoning_start_token_id is not None else "free"

    @property
    def enforcing(self) -> bool:
        """The next token is masked (by the grammar, plus `<think>` while undecided)."""
        return self._phase != "free"

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False if the grammar does not allow it (the
        mask was not applied: the engine fails the request)."""
        if self._phase == "undecided":
            if token_id == self.reasoning_start_token_id:
                self._phase = "free"
                self._free += 1
                return True
            self._phase = "enforcing"
        if self._phase == "free":
            self._free += 1
            if token_id == self.reasoning_end_token_id:
                self._phase = "enforcing"
            return True
        if self.matcher.is_terminated() or not self.matcher.accept_token(int(token_id)):
            if self._matched == 0 and self._free == 0:
                self._phase = self._initial_phase()
            return False
        self._matched += 1
        return True

    def is_terminated(self) -> bool:
        return self._phase == "enforcing" and self.matcher.is_terminated()

    def next_allowed(self) -> str:
        """What the grammar allows next: "none" (a dead end: the grammar can neither go
        on nor stop), "stop" (only its stop tokens: it is complete) or "some". For the
        rare step whose sampled token the grammar refused, to tell the client's grammar
        or min_tokens from a bug; one host bitmask, never on the hot path."""
        if self._phase != "enforcing":
            return "some"                # free, or <think> is allowed
        if self.matcher.is_terminated():
            return "stop"
        bits = xgr.allocate_token_bitmask(1, self.compiled.tokenizer_info.vocab_size)
        self.matcher.fill_next_token_bitmask(bits, 0)
        words = bits[0].numpy().view(np.uint32)
        allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
        if allowed.size == 0:
            return "none"
        stops = set(self.stop_token_ids or ())
        return "stop" if stops and set(allowed.tolist()) <= stops else "some"

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the next token's allowed set into `bitmask[row]` (all allowed while
        free)."""
        if self._phase == "free":
            bitmask[row].fill_(-1)
            return
        self.matcher.fill_next_token_bitmask(bitmask, row)
        self.allow_extra(bitmask, row)

    def allow_extra(self, bitmask: torch.Tensor, row: int) -> None:
        """While undecided, set `<think>`'s bit next to the grammar's in `bitmask[row]`."""
        if self._phase == "undecided":
            tid = self.reasoning_start_token_id
            word, bit = divmod(tid, 32)
            if word < bitmask.shape[1]:
                value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
                bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative or discarded steps).
        The tokens are a free prefix (the reasoning, up to its end token) then the
        grammar's: rolling back into the prefix stops enforcing again, and back to the
        start restores the first token's choice."""
        if num_tokens < 0 or num_tokens > self._free + self._matched:
            raise ValueError(f"cannot roll back {num_tokens} of "
                             f"{self._free + self._matched} tokens")
        undo = min(num_tokens, self._matched)
        if undo:
            self.matcher.rollback(undo)
            self._matched -= undo
        rest = num_tokens - undo
        if rest:
            self._free -= rest
        if not self._free and not self._matched:
            self._phase = self._initial_phase()
        elif rest:                           # the end token went back: reasoning again
            self._phase = "free"


# -- the per-step bitmask ------------------------------------------------------------
_BATCH_FILLERS: dict[int, xgr.BatchGrammarMatcher] = {}


def fill(rows_and_states: Sequence[tuple[int, StructuredState]],
         bitmask_host: torch.Tensor, *, threads: int = 4) -> list[int]:
    """Fill the compact host bitmask for the next token: `bitmask_host[i]` gets the
    i-th enforcing state's mask; returns the logits row of each filled bitmask row.
    States not enforcing yet (still reasoning) are left out: their logits stay as they
    are. Terminated states must not be passed (the engine finished them)."""
    enforcing = [(row, st) for row, st in rows_and_states if st.enforcing]
    if not enforcing:
        return []
    if len(enforcing) > bitmask_host.shape[0]:
        raise ValueError(f"{len(enforcing)} rows do not fit a bitmask of "
                         f"{bitmask_host.shape[0]}")
    if len(enforcing) == 1:
        enforcing[0][1].matcher.fill_next_token_bitmask(bitmask_host, 0)
    else:
        filler = _BATCH_FILLERS.get(threads)
        if filler is None:
            filler = _BATCH_FILLERS.setdefault(threads, xgr.BatchGrammarMatcher(threads))
        filler.batch_fill_next_token_bitmask([st.matcher for _, st in enforcing],
                                             bitmask_host)
    for i, (_, st) in enumerate(enforcing):
        st.allow_extra(bitmask_host, i)       # <think> on an undecided first step
    return [row for row, _ in enforcing]


def apply(logits: torch.Tensor, bitmask_dev: torch.Tensor,
          row_indices: torch.Tensor | None) -> None:
    """Mask `logits` in place on its device: `logits[row_indices[i]]` keeps only the
    tokens allowed by `bitmask_dev[i]` (None: bitmask row i is logits row i). CUDA runs
    the Triton kernel (`ops/triton_bitmask.py`), anything else its torch twin; neither
    syncs with the host."""
    if bitmask_dev.shape[0] == 0:
        return
    if logits.is_cuda:
        from pagefleet.server.ops.triton_bitmask import apply_token_bitmask
    else:
        from pagefleet.server.ops.bitmask import apply_token_bitmask
    apply_token_bitmask(logits, bitmask_dev, row_indices)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class BitmaskBuffers:
    """Preallocated bitmask buffers for one engine: two pinned host sets (used in turn,
    so the host never rewrites a buffer whose copy may still be in flight) and their
    device twins. On a CPU engine the host buffer is used directly."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device | str,
                 *, fill_threads: int = 4) -> None:
        self.device = torch.device(device)
        self.max_rows, self.words = max_rows, bitmask_words(vocab_size)
        self.fill_threads = fill_threads
        pin = self.device.type == "cuda"
        self._host = [torch.full((max_rows, self.words), -1, dtype=torch.int32,
                                 pin_memory=pin) for _ in range(2)]
        self._host_rows = [torch.zeros(max_rows, dtype=torch.int32, pin_memory=pin)
                           for _ in range(2)]
        if pin:
            self._dev = torch.empty((max_rows, self.words), dtype=torch.int32,
                                    device=self.device)
            self._dev_rows = torch.empty(max_rows, dtype=torch.int32, device=self.device)
            self._events: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.waits = 0

    def stage(self, rows_and_states: Sequence[tuple[int, StructuredState]]
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Fill and upload this step's bitmask: returns `(bitmask_dev, rows_dev)` for
        `apply`, or None when no row needs masking. Copies are non_blocking from pinned
        memory, ordered on the current stream before the sampler's kernels."""
        k = self._turn
        self._turn ^= 1
        event = self._events[k] if self.device.type == "cuda" else None
        if event is not None and not event.query():
            # The copy from two steps ago is still in flight: never seen when the
            # engine reads each step's tokens before filling the next (it has then
            # waited for that stream past this copy); counted so a GPU run can show it.
            self.waits += 1
            event.synchronize()
        host, host_rows = self._host[k], self._host_rows[k]
        rows = fill(rows_and_states, host, threads=self.fill_threads)
        n = len(rows)
        if n == 0:
            return None
        host_rows[:n] = torch.tensor(rows, dtype=torch.int32)
        if self.device.type != "cuda":
            return host[:n], host_rows[:n]
        self._dev[:n].copy_(host[:n], non_blocking=True)
        self._dev_rows[:n].copy_(host_rows[:n], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[k] = event
        return self._dev[:n], self._dev_rows[:n]
