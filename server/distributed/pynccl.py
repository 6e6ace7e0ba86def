"""A thin ctypes binding of NCCL: collectives issued on the caller's CUDA stream.

Why not `torch.distributed`'s NCCL process group: its collectives run on an internal
stream with per-call host bookkeeping, which CUDA graph capture does not replay
faithfully (the ranks stop agreeing on which collective is in flight). Calling NCCL
directly on the current stream makes every all-reduce of the decode forward part of
the captured graph, as vLLM and SGLang do with their own wrappers.

The library is the one torch itself loaded (`libnccl.so.2`, from the nvidia-nccl
wheel), or `PAGEFLEET_NCCL_SO` when set.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

# ncclDataType_t (nccl.h)
_NCCL_DTYPES = {
    torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
    torch.float32: 7, torch.float64: 8, torch.bfloat16: 9,
}
if hasattr(torch, "float8_e4m3fn"):
    _NCCL_DTYPES[torch.float8_e4m3fn] = 10
NCCL_SUM = 0        # ncclRedOp_t


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


class NcclError(RuntimeError):
    pass


def _library_path() -> str:
    env = os.environ.get("PAGEFLEET_NCCL_SO")
    if env:
        return env
    try:   # the nvidia-nccl wheel that CUDA builds of torch depend on
        import nvidia.nccl

        cand = Path(list(nvidia.nccl.__path__)[0]) / "lib" / "libnccl.so.2"
        if cand.exists():
            return str(cand)
    except ImportError:
        pass
    return "libnccl.so.2"


class NcclLibrary:
    """The functions pagefleet calls, with their C signatures."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or _library_path()
        try:
            lib = ctypes.CDLL(self.path)
        except OSError as e:
            raise NcclError(f"cannot load NCCL from {self.path} ({e}); set PAGEFLEET_NCCL_SO "
                            "to the path of libnccl.so.2") from e
        c_int, c_void_p, c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
        sigs = {
            "ncclGetErrorString": (ctypes.c_char_p, [c_int]),
            "ncclGetVersion": (c_int, [ctypes.POINTER(c_int)]),
            "ncclGetUniqueId": (c_int, [ctypes.POINTER(NcclUniqueId)]),
            "ncclCommInitRank": (c_int, [ctypes.POINTER(c_void_p), c_int, NcclUniqueId, c_int]),
            "ncclAllReduce": (c_int, [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p,
                                      c_void_p]),
            "ncclBroadcast": (c_int, [c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p,
                                      c_void_p]),
            "ncclSend": (c_int, [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]),
            "ncclRecv": (c_int, [c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p]),
            "ncclGroupStart": (c_int, []),
            "ncclGroupEnd": (c_int, []),
            "ncclCommDestroy": (c_int, [c_void_p]),
            "ncclCommAbort": (c_int, [c_void_p]),
        }
        for name, (res, args) in sigs.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        self.lib = lib

    def check(self, result: int) -> None:
        if result != 0:
            msg = self.lib.ncclGetErrorString(result).decode(errors="replace")
            raise NcclError(f"NCCL error {result}: {msg}")

    def version(self) -> str:
        v = ctypes.c_int()
        self.check(self.lib.ncclGetVersion(ctypes.byref(v)))
        n = v.value   # e.g. 22105 -> 2.21.5
        return f"{n // 10000}.{n // 100 % 100}.{n % 100}"

    def unique_id(self) -> bytes:
        uid = NcclUniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)))
        return ctypes.string_at(ctypes.addressof(uid), 128)


class PyNcclCommunicator:
    """One NCCL communicator over the ranks of a group; every call is enqueued on
    torch's current CUDA stream (so it is captured by a CUDA graph being recorded)."""

    def __init__(self, unique_id: bytes, rank: int, world_size: int, device: torch.device,
                 library: NcclLibrary | None = None) -> None:
        self.nccl = library or NcclLibrary()
        self.rank, self.world_size, self.device = rank, world_size, device
        uid = NcclUniqueId()
        ctypes.memmove(uid.internal, unique_id, 128)
        comm = ctypes.c_void_p()
        with torch.cuda.device(device):
            self.nccl.check(self.nccl.lib.ncclCommInitRank(ctypes.byref(comm), world_size, uid,
                                                           rank))
        self.comm = comm
        # A first collective creates NCCL's channels outside any graph capture.
        x = torch.ones(1, device=device)
        self.all_reduce(x)
        torch.cuda.synchronize(device)

    def _stream(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)

    @staticmethod
    def _dtype(t: torch.Tensor) -> int:
        try:
            return _NCCL_DTYPES[t.dtype]
        except KeyError:
            raise NcclError(f"NCCL has no type for {t.dtype}") from None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, into a new tensor (graph-pool memory when capturing)."""
        x = x.contiguous()
        out = torch.empty_like(x)
        self.nccl.check(self.nccl.lib.ncclAllReduce(
            ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()), x.numel(),
            self._dtype(x), NCCL_SUM, self.comm, self._stream()))
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> None:
        """In place: every rank's `x` (contiguous) gets rank `src`'s."""
        assert x.is_contiguous()
        ptr = ctypes.c_void_p(x.data_ptr())
        self.nccl.check(self.nccl.lib.ncclBroadcast(ptr, ptr, x.numel(), self._dtype(x), src,
                                                    self.comm, self._stream()))

    def gather(self, x: torch.Tensor, dst: int = 0) -> list[torch.Tensor] | None:
        """Every rank's `x` (same shape) at rank `dst`, in rank order; None elsewhere."""
        x = x.contiguous()
        lib, stream, dtype = self.nccl.lib, self._stream(), self._dtype(x)
        outs = None
        self.nccl.check(lib.ncclGroupStart())
        try:
            if self.rank == dst:
                outs = [x if r == dst else torch.empty_like(x) for r in range(self.world_size)]
                for r in range(self.world_size):
                    if r != dst:
                        self.nccl.check(lib.ncclRecv(ctypes.c_void_p(outs[r].data_ptr()),
                                                     x.numel(), dtype, r, self.comm, stream))
            else:
                self.nccl.check(lib.ncclSend(ctypes.c_void_p(x.data_ptr()), x.numel(), dtype,
                                             dst, self.comm, stream))
        finally:
            self.nccl.check(lib.ncclGroupEnd())
        return outs

    def abort(self) -> None:
        """Abort outstanding operations (from another thread: a peer died)."""
        if self.comm is not None:
            self.nccl.lib.ncclCommAbort(self.comm)
            self.comm = None

    def destroy(self) -> None:
        if self.comm is not None:
            self.nccl.lib.ncclCommDestroy(self.comm)
            self.comm = None
