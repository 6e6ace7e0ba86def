"""The ranks of one replica and the collectives between them.

`TPGroup` holds two channels:
- a gloo group over loopback for host-side coordination (the KV block count all
  ranks agree on, per-rank facts for the startup log, NCCL's unique id), and for the
  device collectives when the ranks run on the CPU;
- on GPUs, an NCCL communicator (`pynccl.py`) whose collectives are enqueued on the
  current CUDA stream, so CUDA graphs capture them.

No global state: each engine makes its own group from its own TCPStore, so tests can
start several tensor-parallel engines in one process, one after the other.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

log = logging.getLogger("pagefleet.distributed")

# Long enough for the slowest rank to load its shard before the first collective
# (the profile forward); a dead rank is noticed by the executor's watchdog, not by it.
# The engine passes its --startup-timeout; this is the default for other callers.
STARTUP_TIMEOUT_S = 1800.0


def make_store(rank: int, world_size: int, port: int = 0,
               timeout_s: float = STARTUP_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0 hosts the rendezvous store on an ephemeral loopback port (`store.port`
    tells the workers); the others connect to it."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        return dist.TCPStore("127.0.0.1", port, world_size, True, timeout=timeout,
                             wait_for_workers=False)
    return dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)


class TPGroup:
    """Collectives of rank `rank` among `world_size` ranks of one replica."""

    def __init__(self, rank: int, world_size: int, store: dist.Store, device: torch.device,
                 timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        self.cpu = dist.ProcessGroupGloo(dist.PrefixStore("pagefleet-tp", store), rank,
                                         world_size, opts)
        self.nccl = None
        if device.type == "cuda":
            from pagefleet.server.distributed.pynccl import NcclLibrary, PyNcclCommunicator

            lib = NcclLibrary()
            uid = torch.zeros(128, dtype=torch.uint8)
            if rank == 0:
                uid.copy_(torch.frombuffer(bytearray(lib.unique_id()), dtype=torch.uint8))
            self._broadcast_cpu(uid)
            self.nccl = PyNcclCommunicator(bytes(uid.tolist()), rank, world_size, device, lib)
            if rank == 0:
                log.info("NCCL %s: %d ranks", lib.version(), world_size)
        self.backend = "nccl" if self.nccl is not None else "gloo"

    # -- device collectives (the model's) ---------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks (in place on gloo, a new tensor on NCCL)."""
        if self.nccl is not None:
            return self.nccl.all_reduce(x)
        x = x.contiguous()
        self.cpu.allreduce([x]).wait()
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> None:
        """In place: every rank's `x` (contiguous) becomes rank `src`'s."""
        if self.nccl is not None:
            self.nccl.broadcast(x, src)
        else:
            self._broadcast_cpu(x, src)

    def gather_cat(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Rank 0 gets every rank's `x` concatenated along `dim` (rank order); the
        others get None. Used for vocab-parallel logits."""
        if self.nccl is not None:
            parts = self.nccl.gather(x, 0)
        else:
            x = x.contiguous()
            opts = dist.GatherOptions()
            opts.rootRank = 0
            outs = [[torch.empty_like(x) for _ in range(self.world_size)]] if self.rank == 0 else []
            self.cpu.gather(outs, [x], opts).wait()
            parts = outs[0] if self.rank == 0 else None
        return torch.cat(parts, dim=dim) if parts is not None else None

    # -- host-side coordination ---------------------------------------------------------
    def _broadcast_cpu(self, x: torch.Tensor, src: int = 0) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.cpu.broadcast([x], opts).wait()

    def host_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.cpu.allreduce([t], opts).wait()
        return int(t.item())

    def host_all_gather(self, values: list[float]) -> list[list[float]]:
        """Each rank's list of numbers (same length everywhere), in rank order."""
        t = torch.tensor(values, dtype=torch.float64)
        outs = [[torch.empty_like(t) for _ in range(self.world_size)]]
        self.cpu.allgather(outs, [t]).wait()
        return [o.tolist() for o in outs[0]]

    def barrier(self) -> None:
        self.host_min(0)

    def abort(self) -> None:
        """Unblock collectives stuck on a dead peer (best effort, from any thread)."""
        if self.nccl is not None:
            self.nccl.abort()

    def close(self) -> None:
        if self.nccl is not None:
            self.nccl.destroy()
            self.nccl = None
