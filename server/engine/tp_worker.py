"""Tensor parallelism, the other ranks: `python -m pagefleet.server.engine.tp_worker`.

A worker holds one shard of the model in a `ModelRunner` (the same class as rank 0's,
so startup — loading, the profile forward, KV sizing, CUDA graph capture — runs the
same collectives in the same order) and then executes, step after step, exactly what
rank 0 sends: the host facts over ZeroMQ, the staged inputs by a broadcast from rank
0's device buffer. It never schedules, samples or reads a device value back.

Exits: on `Shutdown`; at once when its stdin reaches EOF (rank 0's process is gone,
however it died); on any error, after reporting it (with its kind) to rank 0.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import traceback

log = logging.getLogger("pagefleet.engine.tp.worker")


def _watch_parent(stream) -> None:
    """Block on stdin; EOF means the process that started us is gone: exit now (a
    collective waiting on it would otherwise hang)."""
    try:
        while stream.read(4096):
            pass
    except (OSError, ValueError):
        pass
    os._exit(0)


def _setup_logging(rank: int) -> None:
    root = logging.getLogger("pagefleet")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(levelname)s %(asctime)s [%(name)s rank={rank} pid={os.getpid()}] %(message)s",
        "%m-%d %H:%M:%S"))
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("PAGEFLEET_LOG_LEVEL", "INFO").upper())
    root.propagate = False
    # Rank 0 logs the memory budget of every rank; the workers' copies would repeat it.
    logging.getLogger("pagefleet.engine").setLevel(logging.WARNING)
    log.setLevel(root.level)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the API process drains, then stops us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    spec = pickle.load(sys.stdin.buffer)
    threading.Thread(target=_watch_parent, args=(sys.stdin.buffer,), daemon=True,
                     name="pagefleet-tp-parent").start()
    _setup_logging(spec.rank)

    import msgspec
    import torch
    import zmq

    from pagefleet.server.config import CUDA_OOM_EXIT_CODE, ConfigError
    from pagefleet.server.distributed.comm import TPGroup, make_store
    from pagefleet.server.engine.runner import ModelRunner, resolve_device
    from pagefleet.server.engine.tp_executor import describe_rank
    from pagefleet.server.engine.tp_protocol import Query, Shutdown, StepMsg, ToWorker, WorkerEvent
    from pagefleet.server.models.config import ModelConfig

    ctx = zmq.Context(io_threads=1)
    events = ctx.socket(zmq.PUSH)
    events.setsockopt(zmq.LINGER, 2000)
    events.connect(spec.event_addr)
    steps = ctx.socket(zmq.PULL)
    steps.setsockopt(zmq.RCVHWM, 0)
    steps.connect(spec.step_addr)
    enc = msgspec.msgpack.Encoder()

    def report(kind: str, message: str = "", info: dict | None = None) -> None:
        events.send(enc.encode(WorkerEvent(spec.rank, kind, message, info or {})))

    def leave(code: int) -> int:
        ctx.destroy(linger=2000)
        sys.stderr.flush()
        os._exit(code)

    def is_oom(e: BaseException) -> bool:
        return type(e).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(e)

    try:
        device = resolve_device(spec.config.device)
        if device.type == "cuda":
            device = torch.device("cuda", spec.rank)
            torch.cuda.set_device(device)
        store = make_store(spec.rank, spec.world_size, spec.store_port,
                           timeout_s=spec.config.startup_timeout)
        group = TPGroup(spec.rank, spec.world_size, store, device)
        model_cfg = ModelConfig.from_dir(spec.model_dir, spec.config.hf_overrides)
        runner = ModelRunner(spec.config, spec.model_dir, model_cfg, spec.max_model_len, tp=group)
        runner.init_kv_cache()
    except ConfigError as e:
        log.error("%s", e)
        report("config", str(e))
        return leave(2)
    except BaseException as e:  # noqa: BLE001 - every startup failure is reported
        if is_oom(e):
            log.error("CUDA out of memory while starting: %s", e)
            report("oom", f"CUDA out of memory while starting: {e}")
            return leave(CUDA_OOM_EXIT_CODE)
        log.error("startup failed:\n%s", traceback.format_exc())
        report("startup", f"{type(e).__name__}: {e}")
        return leave(1)
    report("ready", info={"num_blocks": runner.layout.num_blocks})
    log.info("ready: %d KV heads, %d blocks on %s", runner.num_kv_heads,
             runner.layout.num_blocks, device)

    dec = msgspec.msgpack.Decoder(ToWorker)
    staging = runner.staging
    try:
        while True:
            msg = dec.decode(steps.recv())
            if isinstance(msg, StepMsg):
                staging.begin()
                staging.load_layout(msg.spans, {"i64": msg.used})
                if msg.used:
                    group.broadcast(staging.region("i64", msg.used))
                if msg.n_last:
                    runner.last_tokens[:msg.n_last].copy_(staging.get(msg.tail))
                runner.execute(msg.staged_step())
            elif isinstance(msg, Query):
                report("report", info=describe_rank(runner))
            elif isinstance(msg, Shutdown):
                group.close()
                return leave(0)
    except BaseException as e:  # noqa: BLE001 - report, then stop the replica
        if is_oom(e):
            log.error("CUDA out of memory: %s", e)
            report("oom", f"CUDA out of memory: {e}")
            return leave(CUDA_OOM_EXIT_CODE)
        log.error("worker failed:\n%s", traceback.format_exc())
        report("fatal", f"{type(e).__name__}: {e}")
        return leave(1)


if __name__ == "__main__":
    sys.exit(main())
