"""fp8 (e4m3) weights: quantized at load (`--quantization fp8` on a bf16/fp16
checkpoint) or read from fp8 checkpoints (`quant_method: fp8` as HF transformers and
AutoFP8 write it; llm-compressor's `compressed-tensors` in `compressed_tensors.py`).

Kept per layer: `weight` e4m3 `[N, K]`, `weight_scale` float32 and `fp8_block`
`(bn, bk)` with `w = weight * weight_scale[n // bn, k // bk]`. Per-tensor and
per-channel scales are kept per output row (`[N, 1]`, block `(1, K)`): a fused q|k|v
whose three checkpoint tensors each carry one scale stays exact that way. Weight blocks
stay blocks (`[ceil(N / bn), ceil(K / bk)]`) when every fused part is a whole number of
blocks, else their scales are repeated per row.

At load the quantization is per output channel (scale = row amax / 448), done by the
weight loader on each incoming tensor, so no bf16 copy of the model is ever resident.
Activations: dynamic per-token scales (or the checkpoint's static per-tensor one) on
the GPU's w8a8 path; the small-batch path and the CPU read fp8 weights only (w8a16).
"""

from __future__ import annotations

import torch

from pagefleet.server.models.linear import (LinearBase, LinearMethod, ShardSpec, make_param,
                                            narrowed)
from pagefleet.server.models.quantization.base import QuantConfig, bad_config
from pagefleet.server.ops.deferred import one_row as _one_row
from pagefleet.server.ops.quant import FP8, quantize_fp8_rows

SCALE_KINDS = ("tensor", "channel", "block")


def _scalar(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.numel() != 1:
        raise bad_config("fp8", f"{name}: expected one per-tensor scale, got shape {tuple(t.shape)}")
    return t.reshape(())


class Fp8LinearMethod(LinearMethod):
    """fp8 weights from a checkpoint: per-tensor, per-channel or block scales."""

    name = "fp8"

    def __init__(self, scale_kind: str, block: tuple[int, int] | None = None,
                 static_input: bool = False, aliases: dict[str, str] | None = None) -> None:
        if scale_kind not in SCALE_KINDS:
            raise ValueError(scale_kind)
        if scale_kind == "block" and not block:
            raise ValueError("block scales need a block size")
        self.scale_kind, self.block, self.static_input = scale_kind, block, static_input
        self.aliases = aliases or {}

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       input_size, output_size, params_dtype):
        n, k = sum(output_partition_sizes), input_size_per_partition
        layer.register_parameter("weight", make_param(
            torch.empty(n, k, dtype=FP8), output_dim=0, input_dim=1))
        if self.scale_kind == "tensor":
            scale = make_param(torch.empty(n, 1), weight_loader=self._tensor_scale_loader)
            block = (1, k)
        elif self.scale_kind == "channel":
            scale = make_param(torch.empty(n, 1), output_dim=0)
            block = (1, k)
        else:
            bn, bk = self.block
            if k != input_size and k % bk:
                # A rank's input slice must start on a block: else its columns would take
                # the scales of the blocks the checkpoint's column blocks do not line up
                # with (vLLM refuses the same).
                raise bad_config("fp8", f"{layer.prefix}: the input partition {k} (of "
                                 f"{input_size}, --tensor-parallel-size {layer.tp_size}) is "
                                 f"not a multiple of the weight block of {bk} columns; use a "
                                 "smaller --tensor-parallel-size")
            kb = -(-k // bk)
            if all(p % bn == 0 for p in output_partition_sizes):
                scale = make_param(torch.empty(-(-n // bn), kb), output_dim=0, output_div=bn,
                                   input_dim=1, input_div=bk)
                block = (bn, bk)
            else:    # a fused part is not whole blocks: one scale row per output row
                scale = make_param(torch.empty(n, kb), input_dim=1, input_div=bk,
                                   weight_loader=self._row_block_loader(bn, bk))
                block = (1, bk)
        layer.register_parameter("weight_scale", scale)
        layer.fp8_block = block
        if self.static_input:
            layer.register_parameter("input_scale", make_param(
                torch.zeros(len(output_partition_sizes)),
                weight_loader=self._input_scale_loader(layer)))
        else:
            layer.input_scale = None

    @staticmethod
    def _tensor_scale_loader(param, loaded, spec: ShardSpec, name: str) -> None:
        rows = param.data[spec.out_offset:spec.out_offset + spec.out_size]
        rows.fill_(_scalar(loaded, name).to(torch.float32).item())

    @staticmethod
    def _row_block_loader(bn: int, bk: int):
        def load(param, loaded, spec: ShardSpec, name: str) -> None:
            total = -(-spec.out_total // bn)
            if loaded.dim() != 2 or loaded.shape[0] != total:
                raise bad_config("fp8", f"{name}: scale shape {tuple(loaded.shape)} does not "
                                 f"cover {spec.out_total} rows in blocks of {bn}")
            per_row = loaded.repeat_interleave(bn, 0)[spec.out_start:spec.out_start + spec.out_size]
            if spec.in_size != spec.in_total:
                per_row = per_row.narrow(1, spec.in_start // bk, -(-spec.in_size // bk))
            dst = param.data[spec.out_offset:spec.out_offset + spec.out_size]
            if dst.shape != per_row.shape:
                raise bad_config("fp8", f"{name}: scale shape {tuple(loaded.shape)} does not "
                                 f"match the layer")
            dst.copy_(per_row.to(dst.device, torch.float32))
        return load

    @staticmethod
    def _input_scale_loader(layer: LinearBase):
        def load(param, loaded, spec: ShardSpec, name: str) -> None:
            param.data[layer.shard_ids.index(spec.shard_id)] = _scalar(loaded, name).float()
        return load

    def process_weights_after_loading(self, layer):
        if self.static_input:
            # One activation scale for the fused input: the parts' largest (vLLM does the same).
            layer.input_scale = make_param(layer.input_scale.data.max().reshape(1).clone())

    defers = True   # a one-row call may leave its sum to the reader (ops/deferred.py)

    def apply(self, layer, x, bias, deferred=None):
        return layer.ops.fp8_linear(x, layer.weight, layer.weight_scale, layer.fp8_block,
                                    layer.input_scale, bias,
                                    **_one_row(x, deferred))

    def apply_silu_mul(self, layer, x, bias, deferred=None):
        return layer.ops.fp8_silu_linear(x, layer.weight, layer.weight_scale, layer.fp8_block,
                                         layer.input_scale, bias,
                                         **_one_row(x, deferred))


class Fp8OnlineMethod(Fp8LinearMethod):
    """`--quantization fp8` on a bf16/fp16/fp32 checkpoint: each incoming weight is
    quantized per output row by its loader (on the model's device)."""

    def __init__(self) -> None:
        super().__init__("channel")

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       input_size, output_size, params_dtype):
        n, k = sum(output_partition_sizes), input_size_per_partition
        layer.register_parameter("weight", make_param(
            torch.empty(n, k, dtype=FP8), output_dim=0, input_dim=1,
            weight_loader=self._quantizing_loader(layer)))
        layer.register_parameter("weight_scale", make_param(torch.empty(n, 1), required=False))
        layer.fp8_block = (1, k)
        layer.input_scale = None

    @staticmethod
    def _quantizing_loader(layer: LinearBase):
        def load(param, loaded, spec: ShardSpec, name: str) -> None:
            if loaded.dtype == FP8 or not loaded.is_floating_point():
                raise bad_config("fp8", f"{name} is {loaded.dtype}; quantizing at load needs "
                                 "float16/bfloat16/float32 weights")
            dst, src = narrowed(param, loaded, spec, name)
            q, scale = quantize_fp8_rows(src.to(dst.device))
            dst.copy_(q)
            layer.weight_scale.data[spec.out_offset:spec.out_offset + spec.out_size] = scale
        return load


class Fp8Config(QuantConfig):
    """`quant_method: fp8` checkpoints, or quantization at load (`online`)."""

    flags = ("fp8",)
    name = "fp8"

    def __init__(self, index=None, *, online: bool = False, block: tuple[int, int] | None = None,
                 static_input: bool = False) -> None:
        super().__init__(index)
        self.online, self.block, self.static_input = online, block, static_input

    @classmethod
    def from_config(cls, cfg: dict, index) -> "Fp8Config":
        act = str(cfg.get("activation_scheme", "dynamic")).lower()
        if act not in ("dynamic", "static"):
            raise bad_config("fp8", f"activation_scheme {act!r} (expected dynamic or static)")
        if cfg.get("scale_fmt", "float") != "float":
            raise bad_config("fp8", f"scale_fmt {cfg['scale_fmt']!r} (only float32 scales)")
        block = cfg.get("weight_block_size")
        if block is not None:
            if len(block) != 2 or min(block) <= 0:
                raise bad_config("fp8", f"weight_block_size {block}")
            block = (int(block[0]), int(block[1]))
        return cls(index, block=block, static_input=act == "static")

    def describe(self) -> str:
        if self.online:
            return "fp8 quantized at load (per-channel weight scales, dynamic activations)"
        w = f"{self.block[0]}x{self.block[1]} weight blocks" if self.block else "per-tensor weight scales"
        a = "static" if self.static_input else "dynamic"
        return f"FP8 checkpoint (quant_method fp8, e4m3, {w}, {a} activations)"

    def is_quantized(self, hf_prefix: str) -> bool:
        if self.online:
            return True
        info = self.index.get(hf_prefix + ".weight")
        return info is not None and info.dtype == "F8_E4M3"

    def quantized_method(self, hf_prefixes):
        if self.online:
            return Fp8OnlineMethod()
        aliases = {"activation_scale": "input_scale", "weight_scale_inv": "weight_scale"}
        kind = "block" if self.block else "tensor"
        return Fp8LinearMethod(kind, self.block, self.static_input, aliases)
