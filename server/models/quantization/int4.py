"""What the 4-bit layers (AWQ, GPTQ, compressed-tensors W4A16) share after loading: the kernels' int4 layout and GEMM.

After `process_weights_after_loading` a 4-bit layer holds `qweight` int32 `[K // 8, N]`
(K-major words, see `ops/int4_packing.py`), `scales` `[groups, N]` in the checkpoint's dtype,
`zeros` uint8 `[groups, N]` or None (all 8: symmetric), `group_size`, and `perm`
(int64 `[K]`) when the checkpoint's `g_idx` is act-order: rows are then stored sorted
by group and the input columns are gathered the same way before the GEMM.
"""

from __future__ import annotations

import torch

from pagefleet.server.models.linear import (LinearBase, LinearMethod, ShardSpec, WeightLoadError,
                                            check_integer, make_param, narrowed)
from pagefleet.server.models.quantization.base import bad_config
from pagefleet.server.ops.deferred import one_row as _one_row


def set_kernel_layout(layer: LinearBase, qweight: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor | None, group_size: int,
                      perm: torch.Tensor | None) -> None:
    """Replace the checkpoint-layout parameters by the kernels' (see module docstring)."""
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        if name in layer._parameters:
            del layer._parameters[name]
    layer.qweight = make_param(qweight.contiguous())
    layer.scales = make_param(scales.contiguous())
    if zeros is not None and bool((zeros == 8).all()):
        zeros = None
    layer.zeros = None if zeros is None else make_param(zeros.to(torch.uint8).contiguous())
    layer.group_size = group_size
    if perm is not None:
        layer.register_buffer("perm", perm.to(torch.int64), persistent=False)
    else:
        layer.perm = None


def check_words(fmt: str, layer: LinearBase, k: int, input_size: int,
                output_partition_sizes: list[int]) -> None:
    """The kernels' words hold 8 input rows, and zero points 8 output columns: K and each
    fused output part must be multiples of 8. Where tensor parallelism split them, say
    the partition and the flag (the checkpoint's own sizes may well be multiples of 8)."""
    tp = f"--tensor-parallel-size {layer.tp_size}"
    if k % 8:
        what = (f"the input partition {k} (of {input_size}, {tp})" if k != input_size
                else f"input size {k}")
        raise bad_config(fmt, f"{layer.prefix}: {what} is not a multiple of 8 (the int4 "
                         "kernels' words hold 8 input rows)"
                         + ("; use a smaller --tensor-parallel-size" if k != input_size else ""))
    if any(p % 8 for p in output_partition_sizes):
        split = output_partition_sizes != layer.output_sizes
        what = (f"output partition sizes {output_partition_sizes} (of {layer.output_sizes}, "
                f"{tp}) are" if split else f"output sizes {output_partition_sizes} are")
        raise bad_config(fmt, f"{layer.prefix}: {what} not multiples of 8"
                         + ("; use a smaller --tensor-parallel-size" if split else ""))


def act_order_perm(g_idx: torch.Tensor, group_size: int, name: str) -> torch.Tensor | None:
    """The row order that makes each group contiguous (None: `g_idx` is the plain
    `k // G`). `g_idx` must be an act-order permutation of the plain groups (every group
    `group_size` rows but a short last one); `name` is the tensor, for the error."""
    g_idx = g_idx.to(torch.int64)
    plain = torch.arange(g_idx.numel(), device=g_idx.device) // group_size
    if torch.equal(g_idx, plain):
        return None
    perm = torch.sort(g_idx, stable=True).indices
    if not torch.equal(g_idx[perm], plain):
        raise WeightLoadError(f"{name}: groups are not all of size {group_size} (not an "
                              "act-order permutation)")
    return perm


def g_idx_loader(layer: LinearBase, tensor: str):
    """The weight loader of an act-order group index (GPTQ `g_idx`, compressed-tensors
    `weight_g_idx`): narrowed to this rank's rows, made local to this rank's scales where
    a row-parallel rank holds only its own groups (`layer.int4_local_groups`), and one
    order for every fused part (the kernels permute the shared input once)."""
    def load(param, loaded, spec: ShardSpec, name: str) -> None:
        check_integer(loaded.dtype, param.dtype, name)
        _, src = narrowed(param, loaded, spec, name)
        src = src.to(param.device, torch.int32)
        if layer.int4_local_groups:   # this rank's scales start at its first group
            src = src - spec.in_start // layer.int4_group
        if layer.loaded_shards(tensor) and not torch.equal(src, param.data):
            raise WeightLoadError(f"{name}: the fused parts of {layer.prefix} have "
                                  f"different act-order {tensor}; they must share one order")
        param.data.copy_(src)
    return load


class Int4Method(LinearMethod):
    """The GEMM half of the 4-bit methods."""

    defers = True   # a one-row call may leave its sum to the reader (ops/deferred.py)

    def apply(self, layer, x, bias, deferred=None):
        if layer.perm is not None:
            x = x.index_select(-1, layer.perm)
        return layer.ops.w4a16_linear(x, layer.qweight, layer.scales, layer.zeros,
                                      layer.group_size, bias,
                                      **_one_row(x, deferred))

    def apply_silu_mul(self, layer, x, bias, deferred=None):
        if layer.perm is not None:   # act-order: the input's columns gathered after the SiLU
            return self.apply(layer, layer.ops.silu_and_mul(x), bias, deferred)
        return layer.ops.w4a16_silu_linear(x, layer.qweight, layer.scales, layer.zeros,
                                           layer.group_size, bias,
                                           **_one_row(x, deferred))
