"""AutoAWQ checkpoints (GEMM version), as AutoAWQ's `WQLinear_GEMM` stores them.

`quantization_config`: `{"quant_method": "awq", "bits": 4, "group_size": 128,
"zero_point": true, "version": "gemm", "modules_to_not_convert": null}` (AutoAWQ's
`to_transformers_dict`), or older AutoAWQ's `quant_config.json` (`AwqConfig.to_dict`:
`{"zero_point": true, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}`, no
`quant_method`). Per layer: `qweight` int32 `[K, N // 8]` and `qzeros` int32
`[K // G, N // 8]`, both in AWQ's nibble order, `scales` float16 `[K // G, N]`, `bias`
float16. Loading repacks to the kernels' K-major layout (`int4.py`,
`ops/int4_packing.py`).
"""

from __future__ import annotations

import torch

from pagefleet.server.models.linear import make_param
from pagefleet.server.models.quantization.base import QuantConfig, bad_config
from pagefleet.server.models.quantization.int4 import Int4Method, set_kernel_layout
from pagefleet.server.ops.int4_packing import AWQ_ORDER, pack_rows, unpack_cols


class AWQLinearMethod(Int4Method):
    name = "awq"

    def __init__(self, group_size: int, scale_dtype: torch.dtype) -> None:
        self.group_size, self.scale_dtype = group_size, scale_dtype

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       input_size, output_size, params_dtype):
        k, n = input_size_per_partition, sum(output_partition_sizes)
        # Per channel (group_size <= 0): one group spanning the rows, the same on every
        # rank of a row-parallel layer (its scales are not split along the input).
        per_channel = self.group_size <= 0
        g = k if per_channel else self.group_size
        in_dim = None if per_channel else 0
        if k % g and k != input_size:   # a row-parallel rank's slice must hold whole groups
            raise bad_config("AWQ", f"{layer.prefix}: the input partition {k} (of {input_size}, "
                             f"--tensor-parallel-size {layer.tp_size}) is not a multiple of the "
                             f"group size {g}; use a smaller --tensor-parallel-size")
        if k % g:
            raise bad_config("AWQ", f"{layer.prefix}: input size {k} is not a multiple of the "
                             f"group size {g}")
        if any(p % 8 for p in output_partition_sizes):
            raise bad_config("AWQ", f"{layer.prefix}: output sizes {output_partition_sizes} "
                             "are not multiples of 8")
        layer.register_parameter("qweight", make_param(
            torch.empty(k, n // 8, dtype=torch.int32), output_dim=1, output_div=8, input_dim=0))
        layer.register_parameter("qzeros", make_param(
            torch.empty(k // g, n // 8, dtype=torch.int32), output_dim=1, output_div=8,
            input_dim=in_dim, input_div=g))
        layer.register_parameter("scales", make_param(
            torch.empty(k // g, n, dtype=self.scale_dtype), output_dim=1, input_dim=in_dim,
            input_div=g))
        layer.awq_group = g

    def process_weights_after_loading(self, layer):
        q = unpack_cols(layer.qweight.data, AWQ_ORDER)        # [K, N]
        zeros = unpack_cols(layer.qzeros.data, AWQ_ORDER)     # [K // G, N]
        set_kernel_layout(layer, pack_rows(q), layer.scales.data, zeros, layer.awq_group, None)


class AWQConfig(QuantConfig):
    flags = ("awq", "awq_marlin")
    name = "awq"

    def __init__(self, index, group_size: int, zero_point: bool, version: str) -> None:
        super().__init__(index)
        self.group_size, self.zero_point, self.version = group_size, zero_point, version

    @classmethod
    def from_config(cls, cfg: dict, index) -> "AWQConfig":
        bits = cfg.get("bits", cfg.get("w_bit", 4))
        if bits != 4:
            raise bad_config("AWQ", f"{bits}-bit weights (only 4-bit)")
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise bad_config("AWQ", f"version {version!r} (only the GEMM layout)")
        zero_point = bool(cfg.get("zero_point", True))
        if not zero_point:
            raise bad_config("AWQ", "zero_point false (AutoAWQ's GEMM layout has zero points)")
        group = int(cfg.get("group_size", cfg.get("q_group_size", 128)))
        return cls(index, group, zero_point, version)

    def describe(self) -> str:
        g = "per channel" if self.group_size <= 0 else f"group size {self.group_size}"
        return (f"AWQ 4-bit checkpoint ({self.origin or 'quant_method awq'}, GEMM layout, {g}, "
                "zero points)")

    def is_quantized(self, hf_prefix: str) -> bool:
        return hf_prefix + ".qweight" in self.index

    def quantized_method(self, hf_prefixes):
        dtype = self.tensor_dtype(hf_prefixes[0] + ".scales") or torch.float16
        return AWQLinearMethod(self.group_size, dtype)
