"""Linear layers that own a quantization method, shard-ready for tensor parallelism.

The shape follows vLLM's `LinearBase` + `LinearMethodBase`: a layer knows its logical
sizes (one input, one or more fused outputs: q|k|v = 3, gate|up = 2) and its partition
(`tp_rank` of `tp_size`); its `LinearMethod` creates the parameters for (input size per
partition, output partition sizes), processes them once every checkpoint tensor is in,
and runs the GEMM in `apply`.

Every parameter says how it maps onto the logical matrix (`output_dim`/`input_dim`: which
of its dims runs along the output/input, or None; `output_div`/`input_div`: logical
elements per stored element along it: 8 for packed int4 words, the group size for group
scales). The layer turns (checkpoint tensor, shard id) into a `ShardSpec` (where the
shard sits in this partition and which part of the tensor this rank takes), and a
parameter's `weight_loader` (the generic `load_narrowed` unless the method set one)
narrows and copies. Nothing here reads the whole checkpoint: one tensor at a time.

Column-parallel layers split the output dim across ranks, row-parallel ones the input
dim (their partial outputs need an all-reduce, which `reduce_results` marks for the
tensor-parallel runner; with `tp_size` 1 nothing is reduced).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable

import torch
from torch import nn

from pagefleet.server.ops.deferred import DeferredSlot, DeferredSum


class WeightLoadError(RuntimeError):
    """A checkpoint tensor does not fit the layer it is meant for."""


@dataclass(frozen=True)
class ShardSpec:
    """Where one checkpoint tensor lands, in logical (unpacked, ungrouped) elements."""

    shard_id: Hashable
    out_offset: int        # first output row of this shard in this partition's parameter
    out_size: int          # output rows of this shard in this partition
    out_start: int         # first output row this rank takes from the checkpoint tensor
    out_total: int         # output rows of the checkpoint tensor
    in_start: int          # first input column this rank takes (row-parallel)
    in_size: int           # input columns of this partition
    in_total: int          # input columns of the checkpoint tensor


def make_param(data: torch.Tensor, *, output_dim: int | None = None, input_dim: int | None = None,
               output_div: int = 1, input_div: int = 1, required: bool = True,
               weight_loader: Callable | None = None) -> nn.Parameter:
    """A frozen parameter with its layout attributes (see the module docstring)."""
    p = nn.Parameter(data, requires_grad=False)
    p.output_dim, p.input_dim = output_dim, input_dim
    p.output_div, p.input_div = output_div, input_div
    p.required = required
    p.weight_loader = weight_loader
    return p


def _span(start: int, size: int, div: int, total: int, what: str) -> tuple[int, int]:
    """Stored (start, length) of a logical span of a dim holding `total` logical
    elements (stored size x div); only the dim's last unit may be partial."""
    end = start + size
    if start % div or (end % div and -(-end // div) * div != total):
        raise WeightLoadError(f"{what}: rows {start}..{end} do not fall on units of {div}")
    return start // div, -(-end // div) - start // div


def narrowed(param: nn.Parameter, loaded: torch.Tensor, spec: ShardSpec,
             name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(destination view in `param`, source view of `loaded`) for this shard and rank."""
    dst, src = param.data, loaded
    od, idim = param.output_dim, param.input_dim

    def mismatch(detail: str) -> WeightLoadError:
        return WeightLoadError(f"{name}: checkpoint shape {tuple(loaded.shape)} does not match "
                               f"the layer's {tuple(param.shape)} (shard {spec.shard_id!r}: "
                               f"{detail})")

    if src.dim() != dst.dim():
        raise mismatch(f"{src.dim()} dims, expected {dst.dim()}")
    if od is not None and src.shape[od] != -(-spec.out_total // param.output_div):
        raise mismatch(f"{spec.out_total} output rows expected")
    if idim is not None and src.shape[idim] != -(-spec.in_total // param.input_div):
        raise mismatch(f"{spec.in_total} input columns expected")
    if od is not None:
        f = param.output_div
        o0, on = _span(spec.out_offset, spec.out_size, f, dst.shape[od] * f, name)
        s0, sn = _span(spec.out_start, spec.out_size, f, src.shape[od] * f, name)
        dst, src = dst.narrow(od, o0, on), src.narrow(od, s0, sn)
    if idim is not None and spec.in_size != spec.in_total:
        f = param.input_div
        i0, il = _span(spec.in_start, spec.in_size, f, src.shape[idim] * f, name)
        src = src.narrow(idim, i0, il)
    if tuple(dst.shape) != tuple(src.shape):
        raise mismatch(f"{tuple(src.shape)} into {tuple(dst.shape)}")
    return dst, src


_FP8_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
               torch.float8_e5m2fnuz}


def _is_quantized_dtype(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point or dtype in _FP8_DTYPES


def check_not_quantized(src: torch.dtype | None, dst: torch.dtype, name: str) -> None:
    """A float parameter takes float16/bfloat16/float32 values only: an fp8 or integer
    checkpoint tensor is quantized, and casting it without its scales would load garbage."""
    if src is not None and _is_quantized_dtype(src) and not _is_quantized_dtype(dst):
        raise WeightLoadError(
            f"{name} is {str(src).removeprefix('torch.')} in the checkpoint, a quantized "
            f"tensor, but it is loaded unquantized ({str(dst).removeprefix('torch.')}): the "
            "checkpoint's quantization config does not cover it (the config lacks its "
            "quantization_config, or lists this module as not quantized). Casting it "
            "without its scales would serve garbage.")


def check_integer(src: torch.dtype | None, dst: torch.dtype, name: str) -> None:
    """An integer parameter (packed int4 words, zero points, group indices) takes integer
    checkpoint tensors only: int32 words cast to float16/float32 (a state dict cast
    wholesale to a float dtype when re-saved) no longer hold their bits, and casting them
    back would load garbage without a word."""
    if src is None or dst.is_floating_point or not src.is_floating_point:
        return
    raise WeightLoadError(
        f"{name} is {str(src).removeprefix('torch.')} in the checkpoint, but it must be an "
        f"integer tensor ({str(dst).removeprefix('torch.')}: packed 4-bit words, zero points "
        "or group indices); its integer bits were lost when it was cast to a float dtype "
        "(was the state dict converted with .half() / .to(dtype) before saving?). Use the "
        "checkpoint as the quantization tool wrote it.")


def load_narrowed(param: nn.Parameter, loaded: torch.Tensor, spec: ShardSpec, name: str) -> None:
    """The generic weight loader: narrow, check the shape, copy (casting the dtype; a
    quantized tensor into a float parameter, or a float one into an integer parameter,
    is an error)."""
    check_not_quantized(loaded.dtype, param.dtype, name)
    check_integer(loaded.dtype, param.dtype, name)
    dst, src = narrowed(param, loaded, spec, name)
    dst.copy_(src.to(device=dst.device, dtype=dst.dtype))


class LinearMethod:
    """How one linear layer stores and multiplies its weights."""

    #: short name for logs ("bf16", "fp8", "awq", "gptq")
    name = "unquantized"

    def create_weights(self, layer: "LinearBase", input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: "LinearBase") -> None:
        """Turn the checkpoint layout into the kernels' (called once, when complete)."""

    def apply(self, layer: "LinearBase", x: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def apply_silu_mul(self, layer: "LinearBase", x: torch.Tensor,
                       bias: torch.Tensor | None) -> torch.Tensor:
        """This layer on silu(gate) * up of x = `[gate | up]` (the MLP's down projection);
        a method whose kernel can take the activation in its input load overrides it."""
        return self.apply(layer, layer.ops.silu_and_mul(x), bias)


class UnquantizedLinearMethod(LinearMethod):
    name = "unquantized"

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       input_size, output_size, params_dtype):
        w = torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype)
        layer.register_parameter("weight", make_param(w, output_dim=0, input_dim=1))

    def apply(self, layer, x, bias):
        return nn.functional.linear(x, layer.weight, bias)


class LinearBase(nn.Module):
    """A linear layer of `input_size` -> sum(`output_sizes`), shards named `shard_ids`."""

    def __init__(self, input_size: int, output_sizes: list[int], *, bias: bool,
                 method: LinearMethod | None, shard_ids: list[Hashable] | None = None,
                 parallel: str | None = None, tp_rank: int = 0, tp_size: int = 1,
                 params_dtype: torch.dtype | None = None, prefix: str = "") -> None:
        super().__init__()
        if parallel not in (None, "column", "row"):
            raise ValueError(f"parallel must be None, 'column' or 'row', not {parallel!r}")
        self.prefix = prefix
        self.input_size, self.output_sizes = input_size, list(output_sizes)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.parallel = parallel if tp_size > 1 else None
        self.shard_ids = list(shard_ids) if shard_ids is not None else [None]
        if len(self.shard_ids) != len(self.output_sizes):
            raise ValueError("one shard id per output size")
        self.input_size_per_partition = self._in_partition()
        self.output_partition_sizes = self._out_partitions()
        self.reduce_results = self.parallel == "row"
        self.method = method or UnquantizedLinearMethod()
        self.ops = None   # the model's op bundle, set by the decoder (and by set_ops)
        # The accumulator of a one-row split sum finished by this layer's reader, set by
        # the decoder where that reader takes one (ops/deferred.py); None: a tensor
        self.deferred: DeferredSlot | None = None
        dtype = params_dtype or torch.get_default_dtype()
        self.params_dtype = dtype
        self.method.create_weights(self, self.input_size_per_partition,
                                   self.output_partition_sizes, input_size,
                                   sum(self.output_sizes), dtype)
        if bias:
            self.register_parameter("bias", make_param(
                torch.empty(sum(self.output_partition_sizes), dtype=dtype), output_dim=0))
        else:
            self.bias = None
        self._loaded: set[tuple[str, Hashable]] = set()
        self.processed = False
        # The checkpoint's module of each shard (model.layers.0.self_attn.q_proj, ...), set
        # by the loader; errors found after loading name those, not the fused prefix.
        self.checkpoint_prefixes: list[str] | None = None

    # -- partition arithmetic (the TP helper extends these) ---------------------------------
    def _in_partition(self) -> int:
        if self.parallel == "row":
            if self.input_size % self.tp_size:
                raise ValueError(f"{self.prefix}: input size {self.input_size} does not split "
                                 f"over {self.tp_size} ranks")
            return self.input_size // self.tp_size
        return self.input_size

    def _out_partitions(self) -> list[int]:
        if self.parallel == "column":
            bad = [o for o in self.output_sizes if o % self.tp_size]
            if bad:
                raise ValueError(f"{self.prefix}: output sizes {bad} do not split over "
                                 f"{self.tp_size} ranks")
            return [o // self.tp_size for o in self.output_sizes]
        return list(self.output_sizes)

    def shard_spec(self, shard_id: Hashable) -> ShardSpec:
        if shard_id not in self.shard_ids:
            raise WeightLoadError(f"{self.prefix}: unknown shard {shard_id!r}")
        i = self.shard_ids.index(shard_id)
        parts = self.output_partition_sizes
        out_start = self.tp_rank * parts[i] if self.parallel == "column" else 0
        in_part = self.input_size_per_partition
        in_start = self.tp_rank * in_part if self.parallel == "row" else 0
        return ShardSpec(shard_id, sum(parts[:i]), parts[i], out_start, self.output_sizes[i],
                         in_start, in_part, self.input_size)

    # -- loading ---------------------------------------------------------------------------
    def load_weight(self, name: str, loaded: torch.Tensor, shard_id: Hashable = None) -> None:
        """Copy checkpoint tensor `name` (of shard `shard_id`) into this partition."""
        name = getattr(self.method, "aliases", {}).get(name, name)
        if self.processed:
            raise WeightLoadError(f"{self.prefix}.{name}: loaded twice")
        param = self._parameters.get(name)
        if param is None:
            raise WeightLoadError(f"{self.prefix}: unexpected tensor {name!r} for a "
                                  f"{self.method.name} layer")
        if (name, shard_id) in self._loaded:
            raise WeightLoadError(f"{self.prefix}.{name}: shard {shard_id!r} appears twice in "
                                  "the checkpoint")
        spec = self.shard_spec(shard_id)
        loader = getattr(param, "weight_loader", None) or load_narrowed
        loader(param, loaded, spec, f"{self.prefix}.{name}")
        self._loaded.add((name, shard_id))

    def missing(self) -> list[str]:
        """Checkpoint tensors this layer still needs (`name[shard]`)."""
        if self.processed:
            return []
        out = []
        for name, p in self._parameters.items():
            if p is None or not getattr(p, "required", True):
                continue
            for sid in self.shard_ids:
                if (name, sid) not in self._loaded:
                    out.append(name if sid is None else f"{name}[{sid}]")
        return out

    def checkpoint_name(self, tensor: str) -> str:
        """The checkpoint's names of this layer's `tensor` (one per fused part), for
        errors; the fused name where no loader said (a layer built on its own)."""
        if not self.checkpoint_prefixes:
            return f"{self.prefix}.{tensor}"
        return ", ".join(f"{p}.{tensor}" for p in self.checkpoint_prefixes)

    def loaded_shards(self, name: str) -> set[Hashable]:
        return {sid for n, sid in self._loaded if n == name}

    def finish_loading(self) -> None:
        """Process the weights (once); the loader calls this as soon as nothing is missing."""
        if not self.processed:
            self.method.process_weights_after_loading(self)
            self.processed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """forward(silu(gate) * up) for x = `[gate | up]`."""
        return self.method.apply_silu_mul(self, x, self.bias)

    # The decoder's calls where the reader takes a deferred sum (`deferred` set, and a
    # method that defers): a one-row GPU GEMV may return a `DeferredSum`, which its
    # reader must consume (it re-arms the layer's accumulator). Every other caller gets
    # a tensor from forward / forward_silu_mul.
    def forward_deferred(self, x: torch.Tensor) -> "torch.Tensor | DeferredSum":
        if self.deferred is None or not getattr(self.method, "defers", False):
            return self.forward(x)
        return self.method.apply(self, x, self.bias, self.deferred)

    def forward_silu_mul_deferred(self, x: torch.Tensor) -> "torch.Tensor | DeferredSum":
        if self.deferred is None or not getattr(self.method, "defers", False):
            return self.forward_silu_mul(x)
        return self.method.apply_silu_mul(self, x, self.bias, self.deferred)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_sizes}, method={self.method.name}, "
                f"tp={self.tp_rank}/{self.tp_size}")


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, **kw) -> None:
        super().__init__(input_size, [output_size], **kw)


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, **kw) -> None:
        super().__init__(input_size, [output_size], parallel="column", **kw)


class MergedColumnParallelLinear(LinearBase):
    """Several projections of one input fused along the output (gate|up: shards 0, 1)."""

    def __init__(self, input_size: int, output_sizes: list[int], **kw) -> None:
        super().__init__(input_size, output_sizes, shard_ids=list(range(len(output_sizes))),
                         parallel="column", **kw)


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, **kw) -> None:
        super().__init__(input_size, [output_size], parallel="row", **kw)


class QKVParallelLinear(LinearBase):
    """q|k|v fused (shards 'q', 'k', 'v'). With more ranks than KV heads, each KV head
    is replicated on `tp_size // num_kv_heads` ranks, as in vLLM."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 *, tp_rank: int = 0, tp_size: int = 1, **kw) -> None:
        self.head_dim, self.total_heads, self.total_kv_heads = head_dim, num_heads, num_kv_heads
        if num_heads % tp_size:
            raise ValueError(f"{num_heads} attention heads do not split over {tp_size} ranks")
        if num_kv_heads >= tp_size and num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {tp_size} ranks")
        if num_kv_heads < tp_size and tp_size % num_kv_heads:
            raise ValueError(f"{tp_size} ranks cannot replicate {num_kv_heads} KV heads evenly")
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // num_kv_heads)
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [q, kv, kv], shard_ids=["q", "k", "v"],
                         parallel="column", tp_rank=tp_rank, tp_size=tp_size, **kw)

    def _out_partitions(self) -> list[int]:
        kv = self.num_kv_heads * self.head_dim
        return [self.num_heads * self.head_dim, kv, kv]

    def shard_spec(self, shard_id: Hashable) -> ShardSpec:
        spec = super().shard_spec(shard_id)
        if shard_id == "q" or self.parallel is None:
            return spec
        kv = self.num_kv_heads * self.head_dim
        start = (self.tp_rank // self.kv_replicas) * kv
        return ShardSpec(spec.shard_id, spec.out_offset, spec.out_size, start, spec.out_total,
                         spec.in_start, spec.in_size, spec.in_total)
