"""Tensor parallelism, rank 0's side: the driver that starts the workers and makes
every rank execute the same step.

The scheduler, KV manager and sampler run once, in the engine core, with rank 0's
`TPDriver` as their runner (a `ModelRunner` holding shard 0). Each step:

1. the core stages the step's inputs into the pinned staging buffer as on one GPU
   (`stage()` also reserves room for the previous step's sampled tokens when this
   step's decodes read them on the device);
2. after the one host->device copy, `execute()` sends every worker the step's host
   facts (a few hundred bytes over ZeroMQ IPC), copies the sampled tokens into the
   reserved room on the device, and broadcasts the runner's part of the device
   staging buffer: one collective, after which every rank holds identical inputs;
3. every rank runs the same forward (CUDA graphs on GPUs; the all-reduces of the
   row-parallel layers and the vocab-parallel embedding are inside them), and the
   vocab-parallel logits are gathered on rank 0 for the sampler.

Nothing here waits for the device: workers stay as far ahead as rank 0 does.

Lifecycle: workers are `python -m pagefleet.server.engine.tp_worker` processes (the
core process is a daemon and may not fork multiprocessing children). Each gets its
spec on stdin and keeps stdin open: EOF means rank 0 is gone and it exits at once. A
watchdog thread here sees a worker exit (or report an error) within 0.1 s, logs one
line naming the rank, its pid and why, aborts the collectives and calls the failure
handler: in the core process that reports a `CoreError` and exits, so the server
fails every open request and exits (no hang); in-process (the offline `LLM`) the
next call raises `WorkerDiedError`.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Callable

import msgspec
import torch
import zmq

from pagefleet.server.config import CUDA_OOM_EXIT_CODE, ConfigError, EngineConfig
from pagefleet.server.distributed.checks import check_devices, check_quantization, tp_shape
from pagefleet.server.distributed.comm import TPGroup, make_store
from pagefleet.server.engine.runner import GiB, ModelRunner, StagedStep, resolve_device
from pagefleet.server.engine.tp_protocol import (Query, Shutdown, StepMsg, WorkerEvent,
                                                 WorkerSpec)
from pagefleet.server.models.config import ModelConfig

log = logging.getLogger("pagefleet.engine.tp")

FailureHandler = Callable[[str, str], None]   # (kind, message)
_failure_handler: FailureHandler | None = None


def set_failure_handler(handler: FailureHandler | None) -> None:
    """What to do when a worker dies, after the log line: the core process installs
    one that reports the error to the API process and exits."""
    global _failure_handler
    _failure_handler = handler


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker is gone: the engine cannot run another step."""


def agree_on_blocks(tp: TPGroup, num_blocks: int, weights_bytes: int, per_block: int) -> int:
    """Every rank holds the same block ids: the count is the smallest rank's. Rank 0
    logs each rank's weights and what its own memory would hold."""
    facts = tp.host_all_gather([float(num_blocks), float(weights_bytes)])
    agreed = tp.host_min(num_blocks)
    if tp.rank == 0:
        ranks = ", ".join(f"rank {r} {int(b)} blocks ({w / GiB:.3g} GiB weights)"
                          for r, (b, w) in enumerate(facts))
        log.info("KV cache per rank: %s; every rank uses %d blocks of %.2f MiB", ranks, agreed,
                 per_block / (1 << 20))
    return agreed


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "failed"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _Workers:
    """The worker processes, their sockets and the watchdog: no reference to the
    driver, so a `weakref.finalize` can stop them when the driver is dropped."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.dir = tempfile.mkdtemp(prefix="pagefleet-tp-")
        self.ctx = zmq.Context(io_threads=1)
        self.events = self.ctx.socket(zmq.PULL)
        self.events.setsockopt(zmq.RCVHWM, 0)
        self.event_addr = f"ipc://{self.dir}/events"
        self.events.bind(self.event_addr)
        self.step_socks: list[zmq.Socket] = []
        self.step_addrs: list[str] = []
        for r in range(1, world_size):
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.LINGER, 0)
            addr = f"ipc://{self.dir}/step-{r}"
            s.bind(addr)
            self.step_socks.append(s)
            self.step_addrs.append(addr)
        self.procs: dict[int, subprocess.Popen] = {}
        self.replies: queue.Queue = queue.Queue()
        self.errors: dict[int, WorkerEvent] = {}
        self.ready: dict[int, dict] = {}
        self.failure: tuple[str, str] | None = None     # (kind, message)
        self.failed = threading.Event()
        self.closing = False
        self.on_failure: Callable[[str, str], None] | None = None
        self.abort: Callable[[], None] | None = None    # unblocks collectives (NCCL)
        self._watchdog: threading.Thread | None = None

    def spawn(self, spec: WorkerSpec) -> None:
        env = {**os.environ, **spec.env}
        # -P and a neutral cwd: the caller's cwd must not shadow modules (the repo root
        # has an `operator/` folder, the standard library has `operator`).
        proc = subprocess.Popen([sys.executable, "-P", "-m", "pagefleet.server.engine.tp_worker"],
                                stdin=subprocess.PIPE, env=env, close_fds=True, cwd=self.dir)
        proc.stdin.write(pickle.dumps(spec))
        proc.stdin.flush()        # stdin stays open: its EOF tells the worker we are gone
        self.procs[spec.rank] = proc
        log.info("tensor-parallel worker rank %d started (pid %d)", spec.rank, proc.pid)

    def start_watchdog(self) -> None:
        self._watchdog = threading.Thread(target=self._watch, name="pagefleet-tp-watchdog",
                                          daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        dec = msgspec.msgpack.Decoder(WorkerEvent)
        poller = zmq.Poller()
        poller.register(self.events, zmq.POLLIN)
        reported_at: dict[int, float] = {}
        while not self.closing:
            try:
                ready = dict(poller.poll(100))
            except zmq.ZMQError:
                return
            if self.events in ready:
                while True:
                    try:
                        ev = dec.decode(self.events.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    except zmq.ZMQError:
                        return
                    except msgspec.DecodeError as e:   # a bug, not a reason to stop watching
                        log.error("undecodable message from a tensor-parallel worker: %s", e)
                        continue
                    if ev.kind == "ready":
                        self.ready[ev.rank] = ev.info
                    elif ev.kind == "report":
                        self.replies.put(ev)
                    else:
                        self.errors[ev.rank] = ev
                        reported_at.setdefault(ev.rank, time.monotonic())
            if self.closing or self.failure is not None:
                continue
            for rank, proc in self.procs.items():
                code = proc.poll()
                late = rank in reported_at and time.monotonic() - reported_at[rank] > 2.0
                if code is not None or late:
                    self._fail(rank, proc, code)
                    break

    def _fail(self, rank: int, proc: subprocess.Popen, code: int | None) -> None:
        # A worker that hit the same config error as rank 0 (KV sizing) exits while rank
        # 0's own error unwinds: give the main thread a moment to close us quietly.
        ev = self.errors.get(rank)
        if ev is not None and ev.kind == "config":
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and not self.closing:
                time.sleep(0.02)
        if self.closing:
            return
        kind = ev.kind if ev is not None else "fatal"
        if code == CUDA_OOM_EXIT_CODE:
            kind = "oom"
        if ev is not None and ev.message:
            why = f": {ev.message}"
        else:   # killed (nothing to read) or exited without a word (its log says why)
            why = "" if code is not None and code < 0 else " (see its log above)"
        message = (f"tensor-parallel worker rank {rank} (pid {proc.pid}) "
                   f"{_describe_exit(code) if code is not None else 'reported an error'}{why}")
        self.failure = (kind, message)
        self.failed.set()
        log.error("%s; the engine cannot continue without it", message)
        if self.abort is not None:
            try:
                self.abort()
            except Exception as e:  # noqa: BLE001 - best effort; the handler still runs
                log.warning("aborting the collectives failed: %s", e)
        handler = self.on_failure or _failure_handler
        if handler is not None:
            handler(kind, message)

    def send(self, data: bytes) -> None:
        for s in self.step_socks:
            s.send(data, copy=False)

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the workers to exit, then make sure they did; close everything."""
        if self.closing and not self.procs:
            return
        self.closing = True
        data = msgspec.msgpack.encode(Shutdown())
        for s in self.step_socks:
            try:
                s.send(data, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            try:
                proc.stdin.close()
            except OSError:
                pass
        self.procs.clear()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(2)
        self.ctx.destroy(linger=0)   # every socket, even if the watchdog still holds one
        shutil.rmtree(self.dir, ignore_errors=True)


class TPDriver(ModelRunner):
    """Rank 0's runner: shard 0 of the model, plus the workers that hold the others."""

    def __init__(self, config: EngineConfig, model_dir: Path, model_cfg: ModelConfig,
                 max_model_len: int) -> None:
        n = config.tensor_parallel_size
        self.shape = tp_shape(n, model_cfg.num_heads, model_cfg.num_kv_heads,
                              model_cfg.intermediate_size, model_cfg.vocab_size)
        check_quantization(n, model_cfg.quantization_config,
                           model_cfg.quantization_config_file, config.quantization)
        device = resolve_device(config.device)
        check_devices(n, device.type, torch.cuda.device_count() if device.type == "cuda" else 0)
        if device.type == "cuda":
            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
        self.workers = _Workers(n)
        self._finalizer = weakref.finalize(self, self.workers.stop)
        self._last_tail = (-1, 0)     # (staging handle, count) of the sampled tokens copied
        self._step_used = 0           # i64 elements of the staging buffer the step broadcasts
        self._step_spans: list = []
        self._enc = msgspec.msgpack.Encoder()
        try:
            store = make_store(0, n, timeout_s=config.startup_timeout)
            for r in range(1, n):
                self.workers.spawn(WorkerSpec(
                    rank=r, world_size=n, store_port=store.port,
                    step_addr=self.workers.step_addrs[r - 1],
                    event_addr=self.workers.event_addr, config=config,
                    model_dir=str(Path(model_dir).resolve()), max_model_len=max_model_len))
            self.workers.start_watchdog()
            log.info("Tensor parallel: %d ranks (%s on %s); per rank %d of %d attention heads, "
                     "%d of %d KV heads%s, %d of %d vocabulary rows", n,
                     "nccl" if device.type == "cuda" else "gloo", device.type,
                     self.shape.num_heads, model_cfg.num_heads, self.shape.num_kv_heads,
                     model_cfg.num_kv_heads,
                     f" (each on {self.shape.kv_replicas} ranks)" if self.shape.kv_replicas > 1
                     else "", self.shape.vocab_per_rank, model_cfg.vocab_size)
            group = self._guard(lambda: TPGroup(0, n, store, device))
            self.workers.abort = group.abort
            self._store = store
            self._guard(lambda: ModelRunner.__init__(self, config, model_dir, model_cfg,
                                                     max_model_len, tp=group))
        except BaseException:
            self.shutdown()
            raise

    # -- startup ---------------------------------------------------------------------
    def init_kv_cache(self) -> None:
        try:
            self._guard(super().init_kv_cache)
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise

    def _wait_ready(self, timeout: float = 600.0) -> None:
        """Every worker has finished its startup (graphs captured) and said so."""
        deadline = time.monotonic() + timeout
        while len(self.workers.ready) < self.workers.world_size - 1:
            self._raise_if_failed()
            if time.monotonic() > deadline:
                raise WorkerDiedError("tensor-parallel workers did not report ready within "
                                      f"{timeout:g}s")
            time.sleep(0.01)

    # -- per step ----------------------------------------------------------------------
    def stage(self, sched, tables) -> StagedStep:
        step = super().stage(sched, tables)
        st = self.staging
        n_last = 0
        if step.num_decodes:   # rows whose input is the previous step's sampled token
            pend = st.host(step.tok)[3][:step.num_decodes]
            n_last = int(pend.max()) + 1 if len(pend) else 0
        tail = st.reserve("i64", n_last)[0] if n_last > 0 else -1
        self._last_tail = (tail, n_last)
        self._step_used = st.used("i64")
        self._step_spans = st.layout()
        return step

    def execute(self, step: StagedStep) -> torch.Tensor:
        self._raise_if_failed()
        tail, n_last = self._last_tail
        st = self.staging
        try:
            self.workers.send(self._enc.encode(
                StepMsg.of(step, self._step_spans, self._step_used, tail, n_last)))
            if n_last:
                st.get(tail).copy_(self.last_tokens[:n_last])
            if self._step_used:
                self.tp.broadcast(st.region("i64", self._step_used))
            return super().execute(step)
        except Exception as e:
            raise self._translate(e) from e

    # -- failures ----------------------------------------------------------------------
    def _guard(self, fn):
        try:
            return fn()
        except Exception as e:
            raise self._translate(e) from e

    def _translate(self, exc: Exception) -> Exception:
        """A collective that failed because a worker died becomes that worker's error
        (the watchdog knows within 0.1 s; wait a little for it)."""
        if isinstance(exc, (WorkerDiedError, ConfigError)):
            return exc
        self.workers.failed.wait(2.0)
        failure = self.workers.failure
        if failure is None:
            return exc
        kind, message = failure
        return ConfigError(message) if kind == "config" else WorkerDiedError(message)

    def _raise_if_failed(self) -> None:
        failure = self.workers.failure
        if failure is not None:
            kind, message = failure
            raise ConfigError(message) if kind == "config" else WorkerDiedError(message)

    # -- introspection and shutdown ---------------------------------------------------------
    def parallel_info(self) -> dict:
        """Each rank's pid, device and loaded shard (tests, `/debug`-style utilities)."""
        self._raise_if_failed()
        w = self.workers
        while not w.replies.empty():
            w.replies.get_nowait()
        w.send(self._enc.encode(Query("describe")))
        ranks = {0: describe_rank(self)}
        deadline = time.monotonic() + 30
        while len(ranks) < w.world_size:
            self._raise_if_failed()
            try:
                ev = w.replies.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise WorkerDiedError("tensor-parallel workers did not answer") from None
            ranks[ev.rank] = ev.info
        return {"tensor_parallel_size": w.world_size, "backend": self.tp.backend,
                "ranks": [ranks[r] for r in range(w.world_size)]}

    def shutdown(self) -> None:
        self.workers.stop()
        tp = getattr(self, "tp", None)
        if tp is not None:
            tp.close()


def describe_rank(runner: ModelRunner) -> dict:
    """What one rank holds: its pid, device, parameter shapes and load statistics."""
    from pagefleet.server.models import loader

    return {"rank": runner.tp.rank if runner.tp is not None else 0, "pid": os.getpid(),
            "device": str(runner.device),
            "params": {n: list(p.shape) for n, p in runner.model.named_parameters()},
            "param_bytes": runner.weights_bytes, "num_kv_heads": runner.num_kv_heads,
            "num_blocks": runner.layout.num_blocks if runner.layout else 0,
            "load": dict(getattr(loader, "last_load_stats", {}))}


def make_runner(config: EngineConfig, model_dir: Path, model_cfg: ModelConfig,
                max_model_len: int) -> ModelRunner:
    """One device: the plain runner, nothing extra. More: rank 0's driver."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, model_dir, model_cfg, max_model_len)
    return TPDriver(config, model_dir, model_cfg, max_model_len)
