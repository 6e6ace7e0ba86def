"""Bridge between the synchronous `LLMEngine` and asyncio.

Why a thread: `LLMEngine` is single-threaded by design, and a step is mostly torch work
that releases the GIL, so one engine thread that owns the engine keeps the event loop
free to parse, tokenize and stream. Nothing but that thread touches the engine: the
event loop hands it commands (add, abort) through a thread-safe queue that the thread
drains between steps, and the thread hands results back with one
`loop.call_soon_threadsafe` per iteration (outputs, acceptances and failures batched).

Each request gets a `RequestStream` mailbox on the event loop that holds the *latest*
cumulative output: a slow reader simply sees several tokens at once instead of a
growing backlog (vLLM's output collector merges the same way).

Also here, because they are decisions about the engine's queue:
- admission control: more than `max_num_queued_requests` accepted-but-never-scheduled
  requests -> `QueueFullError` (HTTP 429);
- queue timeout: a request never scheduled within `queue_timeout` seconds is aborted
  and fails with `QueueTimeoutError` (HTTP 503);
- draining for shutdown: `ServerDrainingError` for new requests, then the stragglers
  are aborted with `ServerShutdownError` so nothing accepted ends silently;
- engine death: every open request fails with `EngineDeadError`, and `is_alive` turns
  false (so /health says 503) instead of requests hanging forever.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagefleet.server.engine.outputs import RequestOutput
from pagefleet.server.engine.sampling_params import SamplingParams

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


@dataclass
class RequestStream:
    """One request's mailbox on the event loop: the latest cumulative output or an error."""

    request_id: str
    arrival_time: float                      # wall clock when the API received it
    notify: asyncio.Event
    accepted: asyncio.Future
    latest: RequestOutput | None = None
    error: BaseException | None = None
    finished: bool = False
    dirty: bool = False
    # Bookkeeping for metrics (event-loop side only).
    num_tokens: int = 0
    last_token_time: float | None = None
    first_token_time: float | None = None
    user: Any = None

    def take(self) -> RequestOutput | None:
        """The newest output not yet taken (None if nothing new); raises the error."""
        if self.error is not None:
            raise self.error
        if not self.dirty:
            return None
        self.dirty = False
        return self.latest


class StepListener:
    """Receives every output on the event loop, before mailboxes coalesce them (metrics)."""

    def on_output(self, stream: RequestStream, out: RequestOutput, now: float) -> None:
        pass

    def on_finished(self, stream: RequestStream, reason: str) -> None:
        pass


@dataclass
class _Add:
    request_id: str
    prompt: list[int] | str
    params: SamplingParams
    priority: int
    deadline: float | None


@dataclass
class _Abort:
    request_id: str
    error: BaseException | None = None


@dataclass
class _Events:
    """What one engine-thread iteration hands to the event loop."""

    now: float = 0.0
    outputs: list[RequestOutput] = field(default_factory=list)
    accepted: list[tuple[str, BaseException | None]] = field(default_factory=list)
    failed: list[tuple[str, BaseException]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.outputs or self.accepted or self.failed)


class AsyncEngine:
    """Runs an `LLMEngine` in its own thread and serves it to asyncio code."""

    def __init__(self, engine, *, max_num_queued_requests: int = 1024,
                 queue_timeout: float | None = None,
                 listener: StepListener | None = None) -> None:
        self.engine = engine
        self.max_num_queued_requests = max_num_queued_requests
        self.queue_timeout = queue_timeout
        self.listener = listener or StepListener()
        self.stats = engine.stats()              # refreshed by the engine thread
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}
        self._dead: BaseException | None = None
        self._draining = False
        # Accepted-but-never-scheduled count, as two monotonic counters so that each
        # thread only ever writes its own: queued = admitted - dequeued.
        self._admitted = 0
        self._dequeued = 0
        self._unscheduled: dict[str, float | None] = {}   # engine thread only: id -> deadline

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagefleet-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the engine thread (after `drain`); open requests fail, none hang."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
        self._fail_all(ServerShutdownError("the server is shutting down"))

    @property
    def is_alive(self) -> bool:
        return (self._dead is None and self._thread is not None and self._thread.is_alive()
                and not self._stop)

    @property
    def is_draining(self) -> bool:
        return self._draining

    @property
    def num_queued(self) -> int:
        return self._admitted - self._dequeued

    @property
    def num_open(self) -> int:
        """Requests accepted and not finished yet (what a graceful shutdown waits for)."""
        return len(self._streams)

    async def drain(self, timeout: float) -> int:
        """Stop admitting, let open requests finish for up to `timeout` seconds, then
        abort the rest with `ServerShutdownError`. Returns how many were aborted."""
        self._draining = True
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline and self.is_alive:
            await asyncio.sleep(0.05)
        left = list(self._streams)
        for rid in left:
            self.abort(rid, ServerShutdownError(
                "the server is shutting down and the request did not finish within "
                "--shutdown-timeout"))
        while self._streams and self.is_alive and time.monotonic() < deadline + 5:
            await asyncio.sleep(0.01)
        return len(left)

    # -- requests (event loop side) --------------------------------------------------
    def check_admission(self, n: int = 1) -> None:
        """Raise if `n` more requests cannot be admitted right now."""
        if self._dead is not None or (self._thread is not None and not self._thread.is_alive()):
            raise EngineDeadError(f"the engine loop is not running ({self._dead!r})")
        if self._draining or self._stop:
            raise ServerDrainingError("the server is shutting down and accepts no new requests")
        if self.num_queued + n > self.max_num_queued_requests:
            raise QueueFullError(
                f"the server's queue is full ({self.num_queued} requests waiting, "
                f"--max-num-queued-requests {self.max_num_queued_requests}); retry later")

    async def add(self, request_id: str, prompt: list[int] | str, params: SamplingParams, *,
                  priority: int = 0, notify: asyncio.Event | None = None,
                  arrival_time: float | None = None) -> RequestStream:
        """Queue a request; returns its mailbox once the engine has accepted it.

        Raises QueueFullError / ServerDrainingError / EngineDeadError before queueing,
        and the engine's own RequestRejected (400) if it refuses the request.
        """
        self.check_admission()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, arrival_time or time.time(), notify or asyncio.Event(),
                               loop.create_future())
        self._streams[request_id] = stream
        self._admitted += 1
        deadline = time.monotonic() + self.queue_timeout if self.queue_timeout else None
        self._commands.put(_Add(request_id, prompt, params, priority, deadline))
        self._wake.set()
        try:
            await asyncio.shield(stream.accepted)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Abort a request (client gone, shutdown); its blocks go back to the pool.
        Safe to call for finished or unknown ids."""
        stream = self._streams.get(request_id)
        if stream is None or stream.finished:
            return
        self._commands.put(_Abort(request_id, error))
        self._wake.set()

    async def outputs(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        """Yield one request's cumulative outputs until it finishes (see `outputs_many`)."""
        async for _, out in self.outputs_many([stream]):
            yield out

    async def outputs_many(self, streams: list[RequestStream]
                           ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (index, cumulative output) for several requests that share one notify
        event, until all finish. If the consumer goes away first (a client disconnect
        cancels it) or one of them fails, the unfinished ones are aborted, which frees
        their KV blocks."""
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

    async def generate(self, request_id: str, prompt: list[int] | str, params: SamplingParams,
                       *, priority: int = 0) -> AsyncIterator[RequestOutput]:
        stream = await self.add(request_id, prompt, params, priority=priority)
        async for out in self.outputs(stream):
            yield out

    # -- event loop side of the hand-over ----------------------------------------------
    def _deliver(self, ev: _Events) -> None:
        for rid, exc in ev.accepted:
            stream = self._streams.get(rid)
            if stream is None or stream.accepted.done():
                continue
            if exc is None:
                stream.accepted.set_result(None)
            else:
                stream.finished = True
                self._streams.pop(rid, None)
                stream.accepted.set_exception(exc)
        for out in ev.outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            try:
                self.listener.on_output(stream, out, ev.now)
            except Exception:  # metrics must never break serving
                log.exception("metrics listener failed")
            stream.latest, stream.dirty = out, True
            if out.finished:
                stream.finished = True
                del self._streams[out.request_id]
                self._safe_finished(stream, out.outputs[0].finish_reason or "abort")
            stream.notify.set()
        for rid, exc in ev.failed:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                self._fail(stream, exc)

    def _fail(self, stream: RequestStream, exc: BaseException) -> None:
        stream.finished = True
        stream.error = exc
        if not stream.accepted.done():
            stream.accepted.set_exception(exc)
            stream.accepted.exception()          # mark retrieved
        self._safe_finished(stream, "error" if isinstance(exc, EngineDeadError) else "abort")
        stream.notify.set()

    def _safe_finished(self, stream: RequestStream, reason: str) -> None:
        try:
            self.listener.on_finished(stream, reason)
        except Exception:
            log.exception("metrics listener failed")

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            self._fail(stream, exc)

    def _post(self, ev: _Events) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._deliver, ev)
        except RuntimeError:    # loop closed under us during shutdown
            pass

    # -- engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                self._wake.clear()
                ev = _Events()
                self._process_commands(ev)
                self._expire_queue(ev)
                engine = self.engine
                stepped = False
                if engine.has_unfinished_requests():
                    ev.outputs.extend(engine.step())
                    ev.now = time.time()
                    self._note_scheduled()
                    stepped = True
                self.stats = stats = engine.stats()
                if stepped and not ev.outputs and stats.num_running == 0:
                    self._wake.wait(0.002)   # nothing could be scheduled; don't spin hot
                if ev:
                    self._post(ev)
                if not engine.has_unfinished_requests() and not self._stop:
                    self._wake.wait()
        except BaseException as exc:     # noqa: BLE001 - report any death, then stop
            log.exception("engine loop died")
            self._dead = exc
            err = EngineDeadError(f"the engine loop died: {type(exc).__name__}: {exc}")
            loop = self._loop
            if loop is not None and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(self._fail_all, err)
                except RuntimeError:
                    pass

    def _process_commands(self, ev: _Events) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                try:
                    self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params,
                                            priority=cmd.priority)
                except Exception as exc:  # noqa: BLE001 - rejection goes back to the caller
                    self._dequeued += 1
                    ev.accepted.append((cmd.request_id, exc))
                    continue
                self._unscheduled[cmd.request_id] = cmd.deadline
                ev.accepted.append((cmd.request_id, None))
            else:
                out = self.engine.abort_request(cmd.request_id)
                if cmd.request_id in self._unscheduled:
                    del self._unscheduled[cmd.request_id]
                    self._dequeued += 1
                if out is None:
                    continue
                if cmd.error is not None:
                    ev.failed.append((cmd.request_id, cmd.error))
                else:
                    ev.outputs.append(out)
                    ev.now = time.time()

    def _expire_queue(self, ev: _Events) -> None:
        if self.queue_timeout is None or not self._unscheduled:
            return
        now = time.monotonic()
        expired = []
        for rid, deadline in self._unscheduled.items():   # arrival order = deadline order
            if deadline is None or deadline > now:
                break
            expired.append(rid)
        for rid in expired:
            del self._unscheduled[rid]
            self._dequeued += 1
            if self.engine.abort_request(rid) is not None:
                ev.failed.append((rid, QueueTimeoutError(
                    f"the request waited more than --queue-timeout {self.queue_timeout:g}s "
                    "in the queue without being scheduled")))

    def _note_scheduled(self) -> None:
        if not self._unscheduled:
            return
        done = [rid for rid in self._unscheduled if not self.engine.is_waiting_unscheduled(rid)]
        for rid in done:
            del self._unscheduled[rid]
        self._dequeued += len(done)
