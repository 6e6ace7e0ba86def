"""The API process's engine: the core process behind it, the edge's work in front.

The engine core (scheduler, KV manager, runner, sampler) runs in its own process
(`core_process.py`), so nothing the HTTP side does (JSON, SSE, templating,
tokenizing, detokenizing, metrics) competes with the step loop for a GIL. This class
runs on the event loop:

- `add()` validates a request against the engine's limits (the edge: once, here),
  registers its detokenizer and stop strings with the `OutputProcessor`, and sends the
  core a `CoreRequest`;
- a reader task takes each step's `CoreOutputs` off the socket: new token ids become
  text deltas in each request's `RequestStream` mailbox (merged while the reader is
  slow, so a slow client sees several tokens at once, never a backlog); a stop string
  matched here aborts the request in the core at once;
- the gauges (`num_waiting`, `num_running`) move on admission, scheduling, preemption,
  resumption and finish events, so a scrape during a long prefill sees the real queue;
- admission control (429 past `--max-num-queued-requests` requests accepted and never
  scheduled; preempted ones do not count), queue timeouts (the core
  aborts a request that is still waiting: 503; timed per HTTP request, see
  `RequestGroup`), draining for shutdown, and engine
  death: the core process's sentinel fires the moment it exits, every open request
  fails with `EngineDeadError`, `/health` turns 503 and `on_dead` is called (the server
  then exits non-zero so Kubernetes restarts the pod).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pagefleet.server.config import CUDA_OOM_EXIT_CODE
from pagefleet.server.engine.output_processor import OutputProcessor
from pagefleet.server.engine.outputs import CompletionOutput, RequestOutput
from pagefleet.server.engine.protocol import (CoreAbort, CoreError, CoreOutputs, CoreReady,
                                              CoreStats, CoreUtility, CoreUtilityResult,
                                              FromCore)
from pagefleet.server.engine.sampling_params import SamplingParams
from pagefleet.server.engine.validation import EngineLimits, RequestRejected

log = logging.getLogger("pagefleet.engine.async")


class EngineUnavailableError(RuntimeError):
    """Base of the errors that say the request could not be served (not the client's fault)."""

    status = 503


class QueueFullError(EngineUnavailableError):
    status = 429


class QueueTimeoutError(EngineUnavailableError):
    status = 503


class ServerDrainingError(EngineUnavailableError):
    status = 503


class ServerShutdownError(EngineUnavailableError):
    status = 503


class EngineDeadError(EngineUnavailableError):
    status = 500


class RequestFailedError(EngineUnavailableError):
    """The engine failed this one request (isolated: the engine goes on)."""

    status = 500


@dataclass(eq=False)
class RequestGroup:
    """The engine requests (choices, prompts) of one HTTP request, which share its queue
    timeout.

    `--queue-timeout` promises a client that a request nobody has started serving gets
    a 503 instead of waiting forever. Timing each choice alone broke that promise for
    `n` above the free capacity: choices 0-1 run, choices 2-5 wait behind their own
    siblings, time out, and fail a request that was being served (in-band, after a
    200, when streamed). So the timer belongs to the group: it fires only if no member
    has been scheduled, and the first member scheduled disarms it; its siblings are
    then admitted work of a running request and wait as long as they need."""

    request_ids: list[str] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
    started: bool = False        # a member has been scheduled: the timeout no longer applies
    open: int = 0                # members not finished yet

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


@dataclass
class RequestStream:
    """One request's mailbox on the event loop: the deltas not taken yet, or an error."""

    request_id: str
    arrival_time: float                      # wall clock when the API received it
    notify: asyncio.Event
    prompt_len: int = 0
    max_tokens: int = 0
    error: BaseException | None = None
    finished: bool = False
    scheduled: bool = False
    # Deltas not taken yet, merged.
    _text: list[str] = field(default_factory=list)
    _ids: list[int] = field(default_factory=list)
    _logprobs: list | None = None
    _last: RequestOutput | None = None
    _prompt_logprobs: list | None = None
    _prompt_ranks: list | None = None
    _dirty: bool = False
    # Bookkeeping for metrics (event-loop side only).
    num_tokens: int = 0
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    group: RequestGroup = field(default_factory=RequestGroup)
    user: Any = None

    def push(self, out: RequestOutput) -> None:
        c = out.outputs[0]
        if c.text:
            self._text.append(c.text)
        self._ids.extend(c.token_ids)
        if c.logprobs is not None:
            if self._logprobs is None:
                self._logprobs = []
            self._logprobs.extend(c.logprobs)
        if out.prompt_logprobs is not None:
            self._prompt_logprobs = out.prompt_logprobs
            self._prompt_ranks = out.prompt_logprob_ranks
        self._last = out
        self._dirty = True

    def take(self) -> RequestOutput | None:
        """Everything new since the last take (None if nothing); then raises the error.
        Text produced before a failure is handed out first: a stream that fails after
        tokens (a grammar's dead end, the engine dying) shows what it had, then the error,
        however the core's messages happened to batch them."""
        if not self._dirty:
            if self.error is not None:
                raise self.error
            return None
        last = self._last
        c = last.outputs[0]
        merged = CompletionOutput(index=c.index, text="".join(self._text), token_ids=self._ids,
                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                  logprobs=self._logprobs, cumulative_logprob=c.cumulative_logprob)
        self._text, self._ids, self._logprobs, self._dirty = [], [], None, False
        prompt_lps, ranks = self._prompt_logprobs, self._prompt_ranks
        self._prompt_logprobs = self._prompt_ranks = None
        return RequestOutput(last.request_id, last.prompt, last.prompt_token_ids, [merged],
                             last.finished, last.num_cached_tokens, prompt_logprobs=prompt_lps,
                             prompt_logprob_ranks=ranks)


class StepListener:
    """Receives engine events on the event loop (metrics)."""

    def on_scheduled(self, stream: RequestStream, now: float) -> None:
        pass

    def on_output(self, stream: RequestStream, out: RequestOutput, now: float) -> None:
        pass

    def on_finished(self, stream: RequestStream, reason: str) -> None:
        pass

    def on_stats(self, stats: CoreStats) -> None:
        pass

    def on_request(self, n: int, max_tokens: int | None) -> None:
        """One HTTP request admitted (all of its choices)."""


class AsyncEngine:
    """Serves the core process to asyncio code."""

    def __init__(self, core, ready: CoreReady, tokenizer, *, max_num_queued_requests: int = 1024,
                 queue_timeout: float | None = None, listener: StepListener | None = None,
                 dead_exit_delay: float = 3.0, max_logprobs: int = 20) -> None:
        self.core = core
        self.info = ready
        self.limits = EngineLimits(ready.max_model_len, ready.vocab_size, ready.num_blocks,
                                   ready.block_size, max_logprobs)
        self.processor = OutputProcessor(tokenizer)
        self.max_num_queued_requests = max_num_queued_requests
        self.queue_timeout = queue_timeout
        self.listener = listener or StepListener()
        self.dead_exit_delay = dead_exit_delay
        self.on_dead: Callable[[int], None] | None = None
        self.stats: CoreStats | None = None
        self.num_waiting = 0
        self.num_running = 0
        # Accepted and never scheduled: what --max-num-queued-requests bounds. Unlike
        # the waiting gauge it leaves out preempted requests, which were admitted and
        # will resume; counting them made 429s follow the KV pressure of running work.
        self.num_unscheduled = 0
        self.unscheduled_blocks = 0   # their prompts' KV blocks (the burst credit's check)
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._dead: str | None = None
        self._core_error: CoreError | None = None
        self._draining = False
        self._stopping = False
        # Set when admission stops (drain or stop): bodies still arriving are refused at
        # once instead of being read for a request that would be refused anyway.
        self.closing = asyncio.Event()
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._dec = msgspec.msgpack.Decoder(FromCore)

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = zmq.asyncio.Socket.from_socket(self.core.out_sock)
        self._reader = asyncio.create_task(self._read(), name="pagefleet-core-reader")
        self._loop.add_reader(self.core.proc.sentinel, self._on_core_exit)

    async def stop(self) -> None:
        """Stop the core (after `drain`); open requests fail, none hang."""
        self._stopping = True
        self.closing.set()
        loop = asyncio.get_running_loop()
        try:
            loop.remove_reader(self.core.proc.sentinel)
        except (ValueError, OSError):
            pass
        if self._reader is not None:
            self._reader.cancel()
        await loop.run_in_executor(None, self.core.shutdown)
        self._fail_all(ServerShutdownError("the server is shutting down"))

    @property
    def is_alive(self) -> bool:
        return self._dead is None and not self._stopping

    @property
    def is_draining(self) -> bool:
        return self._draining

    @property
    def num_queued(self) -> int:
        """Requests the admission limit counts: accepted and never scheduled, less
        the ones the next step can take (`_burst_credit`)."""
        return max(0, self.num_unscheduled - self._burst_credit(0, 0))

    def _burst_credit(self, n: int, blocks: int) -> int:
        """How many never-scheduled requests (those accepted so far plus `n` more,
        whose prompts need `blocks` more KV blocks) the next step takes: the free batch
        rows, when the core had no backlog at its last step (else 0), and no more than
        the share of their prompts that the free KV blocks hold. A burst at an idle server sits in the core's queue
        only until that step, so it is not waiting for capacity (counting it made 7
        requests at once a 429 with 8 free rows and a cap of 6), while a server that
        the KV pool binds gives no credit and the cap holds."""
        st = self.stats
        if st is not None and st.num_waiting > 0:
            return 0      # the core left requests unscheduled: it is out of room
        free_rows = max(0, self.info.max_num_seqs - self.num_running)
        free_blocks = st.free_blocks if st is not None else self.info.num_blocks
        need = self.unscheduled_blocks + blocks
        if need <= free_blocks:
            return free_rows
        # The prompts outgrow the free blocks: about that share of them fits.
        return min(free_rows, (self.num_unscheduled + n) * free_blocks // need)

    @property
    def num_open(self) -> int:
        """Requests accepted and not finished yet (what a graceful shutdown waits for)."""
        return len(self._streams)

    async def drain(self, timeout: float) -> int:
        """Stop admitting, let open requests finish for up to `timeout` seconds, then
        abort the rest with `ServerShutdownError`. Returns how many were aborted."""
        self._draining = True
        self.closing.set()
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and self.is_alive:
            await asyncio.sleep(0.05)
        left = list(self._streams)
        for rid in left:
            self.abort(rid, ServerShutdownError(
                "the server is shutting down and the request did not finish within "
                "--shutdown-timeout"))
        return len(left)

    # -- requests --------------------------------------------------------------------
    def check_admission(self, n: int = 1, prompt_tokens: int = 0) -> None:
        """Raise if `n` more requests (`prompt_tokens` in all) cannot be admitted now."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine is not running: {self._dead}")
        if self._draining or self._stopping:
            raise ServerDrainingError("the server is shutting down and accepts no new requests")
        if n > self.max_num_queued_requests:
            raise RequestRejected(
                f"the request holds {n} prompts, more than the server's whole queue "
                f"(--max-num-queued-requests {self.max_num_queued_requests}); split it", "prompt")
        credit = self._burst_credit(n, self._blocks(prompt_tokens) if prompt_tokens else n)
        if max(0, self.num_unscheduled + n - credit) > self.max_num_queued_requests:
            raise QueueFullError(
                f"the server's queue is full ({self.num_queued} requests waiting, "
                f"--max-num-queued-requests {self.max_num_queued_requests}); retry later")

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.info.block_size)

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
            priority: int = 0, notify: asyncio.Event | None = None,
            arrival_time: float | None = None, prompt: str | None = None,
            prefix_leader: str | None = None, group: RequestGroup | None = None
            ) -> RequestStream:
        """Validate and queue a request; returns its mailbox. Raises the admission
        errors and RequestRejected / SamplingParamsError (400) before queueing.

        The requests of one HTTP request pass one `group`: they share its queue timeout
        (armed by the first member added). Without one the request is its own group."""
        self.check_admission(1, len(prompt_ids))
        if request_id in self._streams:
            raise RequestRejected(f"request id {request_id!r} is already in use", "request_id")
        arrival = arrival_time or time.time()
        cr = self.limits.core_request(request_id, prompt_ids, params, priority=priority,
                                      arrival_time=arrival, prefix_leader=prefix_leader)
        group = group if group is not None else RequestGroup()
        stream = RequestStream(request_id, arrival, notify or asyncio.Event(),
                               prompt_len=len(prompt_ids), max_tokens=cr.params.max_tokens,
                               group=group)
        self.processor.add(request_id, prompt, cr.prompt_token_ids, params)
        self._streams[request_id] = stream
        self.num_waiting += 1
        self.num_unscheduled += 1
        self.unscheduled_blocks += self._blocks(stream.prompt_len)
        group.request_ids.append(request_id)
        group.open += 1
        if self.queue_timeout and group.timer is None and not group.started:
            group.timer = self._loop.call_later(self.queue_timeout, self._expire, group)
        self.core.send(cr)
        return stream

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Abort a request (client gone, shutdown); its blocks go back to the pool.
        Safe to call for finished or unknown ids."""
        stream = self._streams.get(request_id)
        if stream is None or stream.finished:
            return
        try:
            self.core.send(CoreAbort([request_id]))
        except zmq.ZMQError:
            pass
        out = self.processor.finish(request_id, "abort")
        if error is not None:
            self._fail(stream, error, "abort")
        else:
            if out is not None:
                stream.push(out)
            self._finished(stream, "abort")

    def _expire(self, group: RequestGroup) -> None:
        """The group's queue timeout passed with none of it scheduled (as far as this
        side knows): ask the core to abort its open members, which it does only if it
        has not scheduled one of them meanwhile (the decision is the core's, so a
        member scheduled while this message travels keeps the whole group alive)."""
        group.timer = None
        if group.started:
            return
        rids = [rid for rid in group.request_ids
                if (s := self._streams.get(rid)) is not None and not s.finished]
        if rids:
            self.core.send(CoreAbort(rids, only_if_waiting=True))

    async def outputs_many(self, streams: list[RequestStream]
                           ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (index, delta) for several requests that share one notify event,
        until all finish. If the consumer goes away first (a client disconnect cancels
        it) or one of them fails, the unfinished ones are aborted, which frees their KV
        blocks."""
        pending = list(range(len(streams)))
        try:
            while pending:
                got = False
                for i in list(pending):
                    out = streams[i].take()
                    if out is None:
                        continue
                    got = True
                    if out.finished:
                        pending.remove(i)
                    yield i, out
                if not got:
                    # No await happened since the pass above, so nothing was missed.
                    streams[0].notify.clear()
                    await streams[0].notify.wait()
        finally:
            for s in streams:
                if not s.finished:
                    self.abort(s.request_id)

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       *, priority: int = 0) -> AsyncIterator[RequestOutput]:
        stream = self.add(request_id, prompt_ids, params, priority=priority)
        async for _, out in self.outputs_many([stream]):
            yield out

    async def call_utility(self, method: str, timeout: float = 30.0) -> dict:
        """Ask the core for `counters`, `check_whole` or `stats` (tests, debugging)."""
        call_id = next(self._call_ids)
        fut = self._loop.create_future()
        self._calls[call_id] = fut
        self.core.send(CoreUtility(call_id, method))
        try:
            res: CoreUtilityResult = await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)
        if res.error:
            raise RuntimeError(res.error)
        return res.result

    async def reset_counters(self) -> None:
        """Zero the core's counters (prefix-cache lookups, tokens, steps) and take the
        fresh stats: what ran so far (the warm-up) stays out of the metrics. Once, at
        startup, with no request open."""
        self.stats = CoreStats(**await self.call_utility("reset_counters"))

    # -- what the core sends -------------------------------------------------------------
    async def _read(self) -> None:
        sock, dec = self._sock, self._dec
        while True:
            data = await sock.recv(copy=False)
            try:
                self._dispatch(dec.decode(data.buffer))
            except Exception:  # noqa: BLE001 - one bad message must not stop the reader
                log.exception("failed to process a message from the engine core")

    def _dispatch(self, msg) -> None:
        if isinstance(msg, CoreOutputs):
            self._on_outputs(msg)
        elif isinstance(msg, CoreUtilityResult):
            fut = self._calls.get(msg.call_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, CoreError):
            self._core_error = msg
            log.error("engine core reports a %s error: %s", msg.kind, msg.message)

    def _on_outputs(self, msg: CoreOutputs) -> None:
        now = time.time()
        streams, listener = self._streams, self.listener
        if msg.stats is not None:
            self.stats = msg.stats
            self._safe(listener.on_stats, msg.stats)
        for rid in msg.scheduled:
            stream = streams.get(rid)
            if stream is not None and not stream.scheduled:
                stream.scheduled = True
                stream.scheduled_time = now
                self.num_waiting -= 1
                self.num_unscheduled -= 1
                self.unscheduled_blocks -= self._blocks(stream.prompt_len)
                self.num_running += 1
                stream.group.started = True
                stream.group.disarm()
                self._safe(listener.on_scheduled, stream, now)
        if msg.preempted or msg.resumed:
            self._move_preempted(msg.preempted, msg.resumed)
        results, stopped = self.processor.process(msg.outputs)
        if stopped:
            self.core.send(CoreAbort(stopped))
        for out in results:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            self._safe(listener.on_output, stream, out, now)
            stream.push(out)
            if out.finished:
                self._finished(stream, out.outputs[0].finish_reason or "abort")
            stream.notify.set()
        for f in msg.failed:
            stream = streams.get(f.request_id)
            if stream is None:
                continue
            self.processor.remove(f.request_id)
            if f.kind == "queue_timeout":
                exc: BaseException = QueueTimeoutError(
                    f"the request waited more than --queue-timeout {self.queue_timeout:g}s in "
                    "the queue without being scheduled")
                self._fail(stream, exc, "timeout")
            elif f.kind == "invalid":   # the request's own constraint (its grammar): a 400
                self._fail(stream, RequestRejected(f.message, "structured_outputs"), "error")
            else:
                self._fail(stream, RequestFailedError(f"the engine failed this request: "
                                                      f"{f.message}"), "error")

    def _on_core_exit(self) -> None:
        loop = self._loop
        try:
            loop.remove_reader(self.core.proc.sentinel)
        except (ValueError, OSError):
            pass
        if self._stopping:
            return
        self._drain_socket()
        self.core.proc.join(5)
        code = self.core.proc.exitcode
        err = self._core_error
        what = f"{err.kind} error: {err.message}" if err else f"exited with code {code}"
        self._dead = f"the engine core process died ({what})"
        log.error("%s; failing %d open request(s)", self._dead, len(self._streams))
        self._fail_all(EngineDeadError(self._dead))
        exit_code = CUDA_OOM_EXIT_CODE if (err and err.kind == "oom") or \
            code == CUDA_OOM_EXIT_CODE else 1
        if self.on_dead is not None:
            loop.call_later(self.dead_exit_delay, self.on_dead, exit_code)

    def _drain_socket(self) -> None:
        """Take what the core sent before it died (its CoreError, last outputs)."""
        sock = self.core.out_sock
        while True:
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            try:
                self._dispatch(self._dec.decode(data))
            except Exception:  # noqa: BLE001
                log.exception("failed to process a message from the engine core")

    # -- bookkeeping ---------------------------------------------------------------------
    def _move_preempted(self, preempted: list[str], resumed: list[str]) -> None:
        """Move the gauges for preemptions and resumptions. A message may merge several
        steps, which loses their order; but a request's preemptions and resumptions
        alternate, so their difference says where it ends: one more preemption,
        waiting; one more resumption, running; as many, where it was. (Before,
        resumptions were not reported: a preempted request counted as waiting until it
        finished, and vllm:num_requests_running read 0 while requests ran.)"""
        net: dict[str, int] = {}
        for rid in preempted:
            net[rid] = net.get(rid, 0) - 1
        for rid in resumed:
            net[rid] = net.get(rid, 0) + 1
        streams = self._streams
        for rid, d in net.items():
            stream = streams.get(rid)
            if stream is None or d == 0 or stream.scheduled_time is None:
                continue
            if d < 0 and stream.scheduled:
                stream.scheduled = False
                self.num_running -= 1
                self.num_waiting += 1
            elif d > 0 and not stream.scheduled:
                stream.scheduled = True
                self.num_running += 1
                self.num_waiting -= 1
    def _settle_counts(self, stream: RequestStream) -> None:
        if stream.scheduled:
            self.num_running -= 1
        else:
            self.num_waiting -= 1
        if stream.scheduled_time is None:
            self.num_unscheduled -= 1
            self.unscheduled_blocks -= self._blocks(stream.prompt_len)
        stream.group.open -= 1
        if stream.group.open == 0:
            stream.group.disarm()

    def _finished(self, stream: RequestStream, reason: str) -> None:
        if stream.finished:
            return
        stream.finished = True
        self._streams.pop(stream.request_id, None)
        self._settle_counts(stream)
        self._safe(self.listener.on_finished, stream, reason)
        stream.notify.set()

    def _fail(self, stream: RequestStream, exc: BaseException, reason: str) -> None:
        if stream.finished:
            return
        stream.error = exc
        self._finished(stream, reason)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in list(self._streams.values()):
            self.processor.remove(stream.request_id)
            self._fail(stream, exc, "error")

    def _safe(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - metrics must never break serving
            log.exception("engine listener failed")
