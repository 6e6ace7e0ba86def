"""A checkpoint tensor that reads only the part a rank narrows it to.

With tensor parallelism each rank keeps a slice of most weights (rows of a column-
parallel layer, columns of a row-parallel one, a range of the vocabulary). The layers'
weight loaders (`models/linear.py`) narrow the checkpoint tensor they are given and
copy the result; given a `LazyTensor` instead of a tensor, `narrow` only records the
range and the bytes are read from the safetensors file (through `get_slice`) when the
loader finally copies them. So a rank reads its shard, not the whole checkpoint.

Anything else a loader does with it (a shape check, `repeat_interleave` on a scale, a
torch function) reads the current view then, so every loader works unchanged. Bytes
read are counted in `ReadStats` (the loading tests assert them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
if hasattr(torch, "float8_e4m3fn"):
    _DTYPES["F8_E4M3"] = torch.float8_e4m3fn
    _DTYPES["F8_E5M2"] = torch.float8_e5m2


@dataclass
class ReadStats:
    bytes_read: int = 0
    tensors: int = 0


class LazyTensor:
    """A view (one range per dim) of a safetensors slice; see the module docstring."""

    def __init__(self, sl, stats: ReadStats | None = None,
                 ranges: tuple[tuple[int, int], ...] | None = None) -> None:
        self._sl = sl
        self._stats = stats
        self._ranges = ranges if ranges is not None else tuple((0, n) for n in sl.get_shape())
        self.dtype = _DTYPES.get(sl.get_dtype())

    @property
    def shape(self) -> torch.Size:
        return torch.Size(b - a for a, b in self._ranges)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self._ranges)

    def numel(self) -> int:
        return self.shape.numel()

    def narrow(self, dim: int, start: int, length: int) -> "LazyTensor":
        dim = dim % len(self._ranges)
        a, b = self._ranges[dim]
        if start < 0 or length < 0 or a + start + length > b:
            raise IndexError(f"narrow({dim}, {start}, {length}) out of range for shape "
                             f"{tuple(self.shape)}")
        ranges = list(self._ranges)
        ranges[dim] = (a + start, a + start + length)
        return LazyTensor(self._sl, self._stats, tuple(ranges))

    def materialize(self) -> torch.Tensor:
        """Read the view from the file (only its bytes)."""
        if not self._ranges:   # a 0-dim tensor
            t = self._sl[:]
        else:
            t = self._sl[tuple(slice(a, b) for a, b in self._ranges)]
        if self._stats is not None:
            self._stats.bytes_read += t.numel() * t.element_size()
            self._stats.tensors += 1
        return t

    def to(self, *args, **kwargs) -> torch.Tensor:
        return self.materialize().to(*args, **kwargs)

    def __getitem__(self, index):
        return self.materialize()[index]

    def __getattr__(self, name: str):
        # Only reached for what the view does not define: read it, ask the tensor.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def real(x):
            if isinstance(x, LazyTensor):
                return x.materialize()
            if isinstance(x, (list, tuple)):
                return type(x)(real(y) for y in x)
            return x
        return func(*real(args), **{k: real(v) for k, v in (kwargs or {}).items()})

    def __repr__(self) -> str:
        return f"LazyTensor(shape={tuple(self.shape)}, dtype={self.dtype})"
