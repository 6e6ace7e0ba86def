"""GPTQ checkpoints as GPTQModel (and AutoGPTQ before it) write them.

`quantization_config` (config.json, or quantize_config.json): `quant_method: gptq`,
`bits: 4`, `group_size` (128, -1 for one group per column, ...), `desc_act`, `sym`,
`checkpoint_format` (`gptq`: v1, zero points stored minus one; `gptq_v2`: as is),
`lm_head: false`; older AutoGPTQ's quantize_config.json has no `quant_method`
(`bits`, `group_size`, `damp_percent`, `desc_act`, `static_groups`, `sym`,
`true_sequential`, `model_name_or_path`, `model_file_base_name`). Per layer: `qweight`
int32 `[K // 8, N]`, `qzeros` int32 `[ceil(K / G), N // 8]`, `scales` float16
`[ceil(K / G), N]`, `g_idx` int32 `[K]` (group of each input row; with act-order a
permutation of the plain `k // G`), `bias`.

K need not be a multiple of G (the last group is short). With act-order the rows are
sorted by group at load (so each group is contiguous again) and the GEMM gathers its
input columns in the same order; every fused part must then carry the same `g_idx`,
which GPTQ's own ordering gives them (they share one input, so one Hessian).
"""

from __future__ import annotations

import torch

from pagefleet.server.models.linear import make_param
from pagefleet.server.models.quantization.base import QuantConfig, bad_config
from pagefleet.server.models.quantization.int4 import (Int4Method, act_order_perm,
                                                       check_words, g_idx_loader,
                                                       set_kernel_layout)
from pagefleet.server.ops.int4_packing import (gptq_zeros_from_qzeros, pack_rows,
                                                          unpack_rows)


class GPTQLinearMethod(Int4Method):
    name = "gptq"

    def __init__(self, group_size: int, desc_act: bool, v1: bool,
                 scale_dtype: torch.dtype, has_g_idx: bool = True) -> None:
        self.group_size, self.desc_act, self.v1 = group_size, desc_act, v1
        self.scale_dtype, self.has_g_idx = scale_dtype, has_g_idx

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       input_size, output_size, params_dtype):
        k, n = input_size_per_partition, sum(output_partition_sizes)
        # Per channel (group_size <= 0): one group spanning the rows, the same on every
        # rank of a row-parallel layer (its scales are not split along the input).
        per_channel = self.group_size <= 0
        g = k if per_channel else self.group_size
        check_words("GPTQ", layer, k, input_size, output_partition_sizes)
        partitioned_in = k != input_size
        if partitioned_in and not self.desc_act and k % g:
            raise bad_config("GPTQ", f"{layer.prefix}: the input partition {k} (of "
                             f"{input_size}, --tensor-parallel-size {layer.tp_size}) is not a "
                             f"multiple of the group size {g}; use a smaller "
                             "--tensor-parallel-size")
        # Row-parallel act-order layers keep every group (any row may use any of them).
        groups_in = partitioned_in and not self.desc_act and not per_channel
        groups = 1 if per_channel else -(-(k if groups_in else input_size) // g)
        in_dim = 0 if groups_in else None
        layer.register_parameter("qweight", make_param(
            torch.empty(k // 8, n, dtype=torch.int32), output_dim=1, input_dim=0, input_div=8))
        layer.register_parameter("qzeros", make_param(
            torch.empty(groups, n // 8, dtype=torch.int32), output_dim=1, output_div=8,
            input_dim=in_dim, input_div=g))
        layer.register_parameter("scales", make_param(
            torch.empty(groups, n, dtype=self.scale_dtype), output_dim=1, input_dim=in_dim,
            input_div=g))
        layer.register_parameter("g_idx", make_param(
            (torch.arange(k) // g).to(torch.int32), input_dim=0, required=self.has_g_idx,
            weight_loader=g_idx_loader(layer, "g_idx")))
        layer.int4_group = g
        layer.int4_local_groups = groups_in

    def process_weights_after_loading(self, layer):
        g = layer.int4_group
        zeros = gptq_zeros_from_qzeros(layer.qzeros.data, self.v1)
        perm = act_order_perm(layer.g_idx.data, g, layer.checkpoint_name("g_idx"))
        qweight = layer.qweight.data
        if perm is not None:
            qweight = pack_rows(unpack_rows(qweight)[perm])
        set_kernel_layout(layer, qweight, layer.scales.data, zeros, g, perm)


class GPTQConfig(QuantConfig):
    flags = ("gptq", "gptq_marlin")
    name = "gptq"

    def __init__(self, index, group_size: int, desc_act: bool, sym: bool, v1: bool) -> None:
        super().__init__(index)
        self.group_size, self.desc_act, self.sym, self.v1 = group_size, desc_act, sym, v1

    @classmethod
    def from_config(cls, cfg: dict, index) -> "GPTQConfig":
        bits = cfg.get("bits", 4)
        if bits != 4:
            raise bad_config("GPTQ", f"{bits}-bit weights (only 4-bit)")
        if cfg.get("lm_head"):
            raise bad_config("GPTQ", "a quantized lm_head (lm_head: true)")
        if cfg.get("dynamic"):
            raise bad_config("GPTQ", "per-module `dynamic` overrides")
        if cfg.get("is_marlin_format"):
            raise bad_config("GPTQ", "is_marlin_format true (AutoGPTQ's Marlin repacking; "
                             "only the gptq layout)")
        fmt = cfg.get("checkpoint_format", cfg.get("format", "gptq"))
        if fmt not in ("gptq", "gptq_v2"):
            raise bad_config("GPTQ", f"checkpoint_format {fmt!r} (gptq or gptq_v2)")
        pack = cfg.get("pack_dtype", "int32")
        if pack != "int32":
            raise bad_config("GPTQ", f"pack_dtype {pack!r} (only int32 words)")
        return cls(index, int(cfg.get("group_size", 128)), bool(cfg.get("desc_act", False)),
                   bool(cfg.get("sym", True)), fmt == "gptq")

    def describe(self) -> str:
        g = "per channel" if self.group_size <= 0 else f"group size {self.group_size}"
        return (f"GPTQ 4-bit checkpoint ({self.origin or 'quant_method gptq'}, {g}, desc_act "
                f"{str(self.desc_act).lower()}, sym {str(self.sym).lower()}, "
                f"{'v1' if self.v1 else 'v2'} zero points)")

    def is_quantized(self, hf_prefix: str) -> bool:
        return hf_prefix + ".qweight" in self.index

    def quantized_method(self, hf_prefixes):
        dtype = self.tensor_dtype(hf_prefixes[0] + ".scales") or torch.float16
        # g_idx is waited for where the checkpoint has it (it may sit in a later shard);
        # without it the groups are the plain k // G, which is right only without
        # act-order: there the groups follow GPTQ's column order, which only g_idx gives
        # (the fused parts share one, so one part's is enough).
        has = [p + ".g_idx" in self.index for p in hf_prefixes]
        if self.desc_act and not any(has):
            raise bad_config("GPTQ", f"desc_act true (act-order), but {hf_prefixes[0]}.g_idx "
                             "is missing: act-order rows are grouped by their g_idx, and the "
                             "plain groups in its place would serve garbage. Use the "
                             "checkpoint's files as the quantization tool wrote them.")
        has_g_idx = all(has)
        return GPTQLinearMethod(self.group_size, self.desc_act, self.v1, dtype, has_g_idx)
