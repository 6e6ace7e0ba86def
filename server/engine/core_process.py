"""The engine core in its own process, and the API process's handle on it.

The API process binds two ZeroMQ sockets on IPC paths (requests out, step outputs
in) and spawns the core process, which connects to both. Messages are the msgspec
Structs of `protocol.py`, encoded as msgpack. The core's loop: take every waiting
message (add, abort, utility), run a step if it has work, send the step's deltas;
block on the input socket when idle.

Lifecycle:
- startup: the core sends `CoreReady`, or a `CoreError` (kind "config" for a flag
  that must change, "startup", "oom") before exiting non-zero;
- the core ignores SIGINT/SIGTERM: the API process drains first, then sends a
  `shutdown` utility call (or kills it);
- the core exits when its parent is gone (checked every second while idle, every
  step while busy), so a crashed API process leaves no engine holding the GPU;
- a fatal error in the core (one no request can be blamed for) is sent as a
  `CoreError` and the process exits (a CUDA out-of-memory with CUDA_OOM_EXIT_CODE);
  the API process notices through the process sentinel at once.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from pagefleet.server.config import CUDA_OOM_EXIT_CODE, ConfigError, EngineConfig
from pagefleet.server.engine.protocol import (CoreAbort, CoreError, CoreFailure, CoreOutputs,
                                              CoreReady, CoreRequest, CoreUtility,
                                              CoreUtilityResult, FromCore, ToCore)

log = logging.getLogger("pagefleet.engine.core")

SHUTDOWN = "shutdown"
UTILITIES = ("counters", "check_whole", "stats", "parallel_info", "reset_counters")


class CoreStartupError(RuntimeError):
    """The core process failed to start; `kind` is CoreError's."""

    def __init__(self, kind: str, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.kind, self.exit_code = kind, exit_code


def _is_cuda_oom(exc: BaseException) -> bool:
    return type(exc).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(exc)


# -- the core process ---------------------------------------------------------------------

def core_main(config: EngineConfig, model_dir: str, eos_token_ids: tuple[int, ...], usage: str,
              to_core: str, from_core: str, parent_pid: int) -> None:
    """Entry point of the core process (multiprocessing, spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from pagefleet.server.api.serve import setup_logging

    setup_logging()
    ctx = zmq.Context(io_threads=1)
    inp = ctx.socket(zmq.PULL)
    inp.setsockopt(zmq.RCVHWM, 0)
    inp.connect(to_core)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)
    out.setsockopt(zmq.LINGER, 5000)
    out.connect(from_core)
    enc = msgspec.msgpack.Encoder()

    def send(msg) -> None:
        out.send(enc.encode(msg), copy=False)

    _exit_on_worker_failure(from_core)
    try:
        from pagefleet.server.engine.core import EngineCore

        core = EngineCore(config, model_dir, eos_token_ids, usage=usage)
    except ConfigError as e:
        send(CoreError("config", str(e)))
        _exit(ctx, 2)
    except BaseException as e:  # noqa: BLE001 - report every startup failure
        if _is_cuda_oom(e):
            log.error("CUDA out of memory while starting the engine: %s", e)
            send(CoreError("oom", f"CUDA out of memory while starting: {e}"))
            _exit(ctx, CUDA_OOM_EXIT_CODE)
        log.error("engine core failed to start", exc_info=True)
        send(CoreError("startup", f"{type(e).__name__}: {e}"))
        _exit(ctx, 1)
    send(core.ready_info())
    code = CoreLoop(core, inp, send, parent_pid).run()
    if code == 0:
        core.shutdown()
    _exit(ctx, code)


def _exit_on_worker_failure(from_core: str) -> None:
    """A dead tensor-parallel worker stops the core at once (its collectives could hang):
    the watchdog thread reports the error on a socket of its own (its own context, so
    the message is flushed before the exit) and exits; the API process then fails every
    open request and exits too."""
    from pagefleet.server.engine import tp_executor

    def handler(kind: str, message: str) -> None:
        ctx = zmq.Context(io_threads=1)
        sock = ctx.socket(zmq.PUSH)
        sock.connect(from_core)
        sock.send(msgspec.msgpack.encode(CoreError(
            kind if kind in ("config", "oom", "startup") else "fatal", message)))
        ctx.destroy(linger=2000)
        sys.stderr.flush()
        os._exit(CUDA_OOM_EXIT_CODE if kind == "oom" else 2 if kind == "config" else 1)

    tp_executor.set_failure_handler(handler)


def _exit(ctx: zmq.Context, code: int) -> None:
    ctx.destroy(linger=5000)   # flush what was sent
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class CoreLoop:
    """Drain inputs, step, send deltas; returns the process exit code."""

    def __init__(self, core, inp: zmq.Socket, send, parent_pid: int) -> None:
        self.core, self.inp, self.send, self.parent_pid = core, inp, send, parent_pid
        self.dec = msgspec.msgpack.Decoder(ToCore)
        self.pending = CoreOutputs()   # rejections and aborts, sent with the next step

    def run(self) -> int:
        core = self.core
        try:
            while True:
                if not core.has_unfinished_requests() and not self.pending:
                    if not self.inp.poll(1000):
                        if os.getppid() != self.parent_pid:
                            log.warning("the API process is gone: engine core exiting")
                            return 0
                        continue
                while self.inp.poll(0):
                    if self._handle(self.dec.decode(self.inp.recv())) == SHUTDOWN:
                        return 0
                if core.has_unfinished_requests():
                    step_out = core.step()
                    if self.pending:
                        step_out = self._merge(self.pending, step_out)
                        self.pending = CoreOutputs()
                    if step_out:
                        self.send(step_out)
                    if not core.progressed:
                        time.sleep(0.001)   # nothing could run this step: don't spin hot
                elif self.pending:
                    stats = core.stats()
                    stats.step_tokens = 0        # no step ran for this message
                    self.pending.stats = stats
                    self.send(self.pending)
                    self.pending = CoreOutputs()
                if os.getppid() != self.parent_pid:
                    log.warning("the API process is gone: engine core exiting")
                    return 0
        except BaseException as e:  # noqa: BLE001 - the engine cannot go on
            if _is_cuda_oom(e):
                log.error("CUDA out of memory in the engine core: %s", e)
                self.send(CoreError("oom", f"CUDA out of memory: {e}"))
                return CUDA_OOM_EXIT_CODE
            log.error("engine core died", exc_info=True)
            self.send(CoreError("fatal", f"{type(e).__name__}: {e}"))
            return 1

    @staticmethod
    def _merge(a: CoreOutputs, b: CoreOutputs) -> CoreOutputs:
        return CoreOutputs(outputs=a.outputs + b.outputs, scheduled=a.scheduled + b.scheduled,
                           preempted=a.preempted + b.preempted, resumed=a.resumed + b.resumed,
                           failed=a.failed + b.failed,
                           stats=b.stats, timestamp=b.timestamp)

    def _handle(self, msg) -> str | None:
        core, pending = self.core, self.pending
        if isinstance(msg, CoreRequest):
            try:
                core.add_request(msg)
            except Exception as e:  # noqa: BLE001 - the request alone is refused
                pending.failed.append(CoreFailure(msg.request_id, "rejected", str(e)))
        elif isinstance(msg, CoreAbort):
            res = core.abort(msg)
            pending.outputs.extend(res.outputs)
            pending.failed.extend(res.failed)
        elif isinstance(msg, CoreUtility):
            if msg.method == SHUTDOWN:
                return SHUTDOWN
            try:
                if msg.method not in UTILITIES:
                    raise ValueError(f"unknown utility {msg.method!r}")
                result = getattr(core, msg.method)()
                if not isinstance(result, dict):
                    result = msgspec.structs.asdict(result)
                self.send(CoreUtilityResult(msg.call_id, result))
            except Exception as e:  # noqa: BLE001 - reported to the caller
                self.send(CoreUtilityResult(msg.call_id, {}, f"{type(e).__name__}: {e}"))
        return None


# -- the API process's side ---------------------------------------------------------------

class CoreProcess:
    """Spawns the core process and holds the two sockets (synchronous parts).

    `start()` blocks until the core is ready (or raises `CoreStartupError` /
    `ConfigError`); the asyncio side (`AsyncEngine`) then reads outputs from
    `out_sock` and watches `proc.sentinel`.
    """

    def __init__(self, config: EngineConfig, model_dir: str | Path,
                 eos_token_ids: tuple[int, ...], usage: str = "server") -> None:
        self.config, self.model_dir = config, str(model_dir)
        self.eos_token_ids, self.usage = tuple(eos_token_ids), usage
        self.ctx = zmq.Context(io_threads=1)
        self._dir = tempfile.mkdtemp(prefix="pagefleet-core-")
        self.to_core_addr = f"ipc://{self._dir}/in"
        self.from_core_addr = f"ipc://{self._dir}/out"
        self.in_sock = self.ctx.socket(zmq.PUSH)          # API -> core
        self.in_sock.setsockopt(zmq.SNDHWM, 0)
        self.in_sock.setsockopt(zmq.LINGER, 0)
        self.in_sock.bind(self.to_core_addr)
        self.out_sock = self.ctx.socket(zmq.PULL)         # core -> API
        self.out_sock.setsockopt(zmq.RCVHWM, 0)
        self.out_sock.bind(self.from_core_addr)
        self.enc = msgspec.msgpack.Encoder()
        self.dec = msgspec.msgpack.Decoder(FromCore)
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.last_error: CoreError | None = None

    def start(self, timeout: float = 1800.0) -> CoreReady:
        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(
            target=core_main, name="pagefleet-engine-core", daemon=True,
            args=(self.config, self.model_dir, self.eos_token_ids, self.usage,
                  self.to_core_addr, self.from_core_addr, os.getpid()))
        self.proc.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.out_sock.poll(200):
                msg = self.dec.decode(self.out_sock.recv())
                if isinstance(msg, CoreReady):
                    return msg
                if isinstance(msg, CoreError):
                    self.proc.join(30)
                    if msg.kind == "config":
                        raise ConfigError(msg.message)
                    raise CoreStartupError(msg.kind, msg.message, self.proc.exitcode)
            elif not self.proc.is_alive():
                raise CoreStartupError("startup", "the engine core process exited with code "
                                       f"{self.proc.exitcode} before it was ready",
                                       self.proc.exitcode)
        self.kill()
        raise CoreStartupError("startup", f"the engine core was not ready within {timeout:g}s")

    def send(self, msg) -> None:
        self.in_sock.send(self.enc.encode(msg), flags=zmq.NOBLOCK, copy=False)

    def shutdown(self, timeout: float = 10.0) -> None:
        proc = self.proc
        if proc is not None and proc.is_alive():
            try:
                self.send(CoreUtility(0, SHUTDOWN))
            except zmq.ZMQError:
                pass
            proc.join(timeout)
        self.kill()

    def kill(self) -> None:
        proc = self.proc
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(10)
        self.close()

    def close(self) -> None:
        for s in (self.in_sock, self.out_sock):
            s.close(linger=0)
        self.ctx.term()
        for name in ("in", "out"):
            try:
                os.unlink(os.path.join(self._dir, name))
            except OSError:
                pass
        try:
            os.rmdir(self._dir)
        except OSError:
            pass


class ServedEngine:
    """What the API process holds for one served model: the running core process, its
    limits, and the tokenizer and generation defaults (loaded here, not in the core)."""

    def __init__(self, config: EngineConfig, model_dir: str | Path, usage: str = "server",
                 check_tokenizer: Callable[[Any], None] | None = None) -> None:
        """`check_tokenizer(tokenizer)` runs once the tokenizer is loaded and before the
        core starts (the weights load): what it raises, a ConfigError say, costs
        seconds instead of a whole model load."""
        from pagefleet.server.engine.engine import eos_token_ids, load_tokenizer
        from pagefleet.server.models.config import ModelConfig, generation_defaults

        self.config = config
        self.model_dir = Path(model_dir)
        self.model_cfg = ModelConfig.from_dir(self.model_dir, config.hf_overrides)
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_dir)
        if check_tokenizer is not None:
            check_tokenizer(self.tokenizer)
        self.generation_defaults = generation_defaults(self.model_dir)
        self.eos_token_ids = eos_token_ids(self.model_cfg, self.tokenizer)
        self.core = CoreProcess(config, self.model_dir, self.eos_token_ids, usage)
        try:
            self.ready: CoreReady = self.core.start(timeout=config.startup_timeout)
        except BaseException:
            self.core.kill()
            raise
        self.max_model_len = self.ready.max_model_len
