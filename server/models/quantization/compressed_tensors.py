"""llm-compressor's `compressed-tensors` checkpoints: fp8 weights, and 4-bit integer
weights (W4A16, `pack-quantized`).

fp8: `quantization_config` as compressed-tensors writes it: `quant_method:
compressed-tensors`, `format: float-quantized` (or `naive-quantized`), `config_groups`
whose `weights` are `num_bits: 8, type: float, symmetric` with strategy `tensor`,
`channel` or `block` (`block_structure`), and `input_activations` either absent
(w8a16), dynamic (strategy `token`, or `group`, computed here per token), or static
per-tensor (`input_scale`). Tensors: `weight` e4m3 `[N, K]`, `weight_scale` in the
model's dtype (`[1]`, `[N, 1]` or `[ceil(N / bn), ceil(K / bk)]`), `input_scale`.

W4A16 (the W4A16 / W4A16_ASYM presets, GPTQ or round-to-nearest): `format:
pack-quantized`, `weights` `num_bits: 4, type: int`, strategy `group` (`group_size`) or
`channel`, `symmetric` true or false, `actorder` null / `weight` (calibration order
only, nothing stored) or `group` (older llm-compressor: `weight_g_idx`), no
`input_activations`. Tensors (the pack-quantized compressor): `weight_packed` int32
`[N, K / 8]` (values -8..7 stored + 8, packed along K in plain nibble order,
`ops/int4_packing.py`), `weight_scale` `[N, groups]` in the model's dtype, `weight_shape`
`[2]` = (N, K), asymmetric `weight_zero_point` int32 `[N / 8, groups]` (the zero points,
also stored + 8, packed along N), act-order `weight_g_idx` int32 `[K]`. The weight is
`(q - z) * s`; at load the words become the kernels' K-major layout by a transpose (the
stored nibbles are already `q + 8`, the kernels' unsigned values with zero point 8).

Layers listed in `ignore` are stored unquantized, which the tensor index shows.
"""

from __future__ import annotations

import torch

from pagefleet.server.models.linear import (ShardSpec, WeightLoadError, check_integer,
                                            make_param)
from pagefleet.server.models.quantization.base import QuantConfig, bad_config
from pagefleet.server.models.quantization.fp8 import Fp8LinearMethod
from pagefleet.server.models.quantization.int4 import (Int4Method, act_order_perm,
                                                       check_words, g_idx_loader,
                                                       set_kernel_layout)
from pagefleet.server.ops.int4_packing import ct_unpack, pack_rows

FMT = "compressed-tensors"


def _scheme(group: dict) -> tuple[str, tuple[int, int] | None, bool]:
    """(weight scale kind, block, static input scale) of one config group."""
    w = group.get("weights") or {}
    if (w.get("num_bits"), w.get("type")) != (8, "float"):
        raise bad_config(FMT, f"weights {w.get('num_bits')}-bit {w.get('type')}: only fp8 "
                         "(num_bits 8, type float) is supported")
    if not w.get("symmetric", True) or w.get("dynamic"):
        raise bad_config(FMT, "fp8 weights must be static and symmetric")
    if w.get("actorder"):
        raise bad_config(FMT, "activation ordering on fp8 weights")
    strategy = w.get("strategy") or "tensor"
    block = None
    if strategy == "block":
        bs = w.get("block_structure") or []
        if len(bs) != 2:
            raise bad_config(FMT, f"block strategy without a 2-d block_structure ({bs})")
        block = (int(bs[0]), int(bs[1]))
    elif strategy not in ("tensor", "channel"):
        raise bad_config(FMT, f"fp8 weight strategy {strategy!r} (tensor, channel or block)")
    a = group.get("input_activations")
    static = False
    if a:
        if (a.get("num_bits"), a.get("type")) != (8, "float") or not a.get("symmetric", True):
            raise bad_config(FMT, "input activations must be symmetric fp8")
        if a.get("dynamic") in (True, "local"):
            if a.get("strategy") not in ("token", "group", "tensor", None):
                raise bad_config(FMT, f"dynamic activation strategy {a.get('strategy')!r}")
        elif a.get("strategy") == "tensor":
            static = True
        else:
            raise bad_config(FMT, f"static activation strategy {a.get('strategy')!r}")
    if group.get("output_activations"):
        raise bad_config(FMT, "output activation quantization")
    return strategy, block, static


def _weights(cfg: dict) -> str:
    """What config_groups say the weights are, for the error on a format or scheme not
    loaded here (a format such as int-quantized names only a packing, not the bits)."""
    out = []
    for g in (cfg.get("config_groups") or {}).values():
        w = g.get("weights") or {}
        if not w:
            continue
        desc = f"{w.get('num_bits')}-bit {w.get('type')} weights"
        if w.get("strategy"):
            desc += f", {w['strategy']} strategy"
        if w.get("group_size"):
            desc += f", group size {w['group_size']}"
        out.append(desc)
    return f" ({'; '.join(dict.fromkeys(out))})" if out else ""


FP8_FORMATS = ("float-quantized", "naive-quantized")
W4_FORMATS = ("pack-quantized",)


def _format(cfg: dict) -> str | None:
    """The weights' format: the config's own, or for `mixed-precision` (newer
    compressed-tensors, config groups each with a format) the one its groups share."""
    fmt = cfg.get("format")
    if fmt != "mixed-precision":
        return fmt
    fmts = {g.get("format") for g in (cfg.get("config_groups") or {}).values()
            if g.get("weights")}
    if len(fmts) == 1 and None not in fmts:
        return fmts.pop()
    raise bad_config(FMT, f"format 'mixed-precision' with config groups in formats "
                     f"{', '.join(sorted(map(str, fmts)))}{_weights(cfg)}: one format (and "
                     "scheme) for all quantized layers is supported")


def _one_scheme(cfg: dict, parse, what: str, described: str) -> tuple:
    """The config's one scheme, `parse`d from each of its config_groups (after the checks
    every format shares): one scheme serves every layer, so groups that differ are an
    error (`what`: the kind named in it; `described`: what the weights are, or '')."""
    _check_common(cfg)
    schemes = {parse(g) for g in (cfg.get("config_groups") or {}).values()}
    if len(schemes) != 1:
        raise bad_config(FMT, f"{len(schemes)} different schemes in config_groups{described} "
                         f"(one {what} scheme for all layers is supported)")
    return schemes.pop()


def _check_common(cfg: dict) -> None:
    if cfg.get("kv_cache_scheme"):
        raise bad_config(FMT, "kv_cache_scheme (quantized KV cache scales); use "
                         "--kv-cache-dtype fp8 instead")
    if cfg.get("sparsity_config") or cfg.get("transform_config"):
        raise bad_config(FMT, "sparsity or transform configs")


class CompressedTensorsConfig(QuantConfig):
    flags = ("fp8", "compressed-tensors")    # the second: vLLM's name for these
    name = "compressed-tensors fp8"

    def __init__(self, index, kind: str, block, static_input: bool, fmt: str) -> None:
        super().__init__(index)
        self.kind, self.block, self.static_input, self.fmt = kind, block, static_input, fmt

    @classmethod
    def from_config(cls, cfg: dict, index) -> "QuantConfig":
        """The checkpoint's compressed-tensors format: this class for fp8 weights,
        `CompressedTensorsW4A16Config` for pack-quantized 4-bit ones."""
        fmt = _format(cfg)
        if fmt in W4_FORMATS:
            return CompressedTensorsW4A16Config.from_config(cfg, index)
        if fmt not in FP8_FORMATS:
            raise bad_config(FMT, f"format {fmt!r}{_weights(cfg)}: supported are fp8 weights "
                             "(float-quantized) and 4-bit int weights (pack-quantized, "
                             "W4A16)")
        kind, block, static = _one_scheme(cfg, _scheme, "fp8", "")
        return cls(index, kind, block, static, fmt)

    def describe(self) -> str:
        w = {"tensor": "per-tensor", "channel": "per-channel"}.get(self.kind) or \
            f"{self.block[0]}x{self.block[1]} block"
        a = "static" if self.static_input else "dynamic"
        return f"compressed-tensors FP8 checkpoint ({self.fmt}, {w} weight scales, {a} activations)"

    def is_quantized(self, hf_prefix: str) -> bool:
        info = self.index.get(hf_prefix + ".weight")
        return info is not None and info.dtype == "F8_E4M3"

    def quantized_method(self, hf_prefixes):
        return Fp8LinearMethod(self.kind, self.block, self.static_input)


# -- W4A16: pack-quantized 4-bit integer weights ------------------------------------------------

W4_TENSORS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point",
              "weight_g_idx")
ACT_ORDER_NONE = (None, False, "weight", "static")   # calibration order only: nothing stored
ACT_ORDER_G_IDX = (True, "group", "dynamic")         # weight_g_idx stored (older llm-compressor)


def _w4_scheme(group: dict) -> tuple[int, bool, bool]:
    """(group size, -1 per channel; symmetric; act-order g_idx) of one config group."""
    w = group.get("weights") or {}
    if (w.get("num_bits"), w.get("type")) != (4, "int"):
        raise bad_config(FMT, f"pack-quantized weights {w.get('num_bits')}-bit "
                         f"{w.get('type')}: only 4-bit int weights (W4A16) are supported")
    if w.get("dynamic"):
        raise bad_config(FMT, "dynamic 4-bit weights (their scales must be stored)")
    gs = w.get("group_size")
    strategy = w.get("strategy") or ("group" if (gs or 0) > 0 else
                                     "channel" if gs == -1 else "tensor")
    if strategy == "group":
        if not gs or gs <= 0:
            raise bad_config(FMT, f"group strategy with group_size {gs!r}")
        size = int(gs)
    elif strategy == "channel":
        size = -1
    else:
        raise bad_config(FMT, f"4-bit weight strategy {strategy!r} (group or channel)")
    actorder = w.get("actorder")
    if actorder not in ACT_ORDER_NONE + ACT_ORDER_G_IDX:
        raise bad_config(FMT, f"actorder {actorder!r} (null, weight or group)")
    if group.get("input_activations"):
        a = group["input_activations"]
        raise bad_config(FMT, f"4-bit weights with {a.get('num_bits')}-bit {a.get('type')} "
                         "input activations (W4A8): only weight-only W4A16 is supported")
    if group.get("output_activations"):
        raise bad_config(FMT, "output activation quantization")
    return size, bool(w.get("symmetric", True)), actorder in ACT_ORDER_G_IDX


class CompressedTensorsW4A16Method(Int4Method):
    """`weight_packed` / `weight_scale` / `weight_shape` (/ `weight_zero_point`,
    `weight_g_idx`) as the pack-quantized compressor stores them, turned into the
    kernels' int4 layout (`int4.py`) once a layer is complete."""

    name = "compressed-tensors w4a16"

    def __init__(self, group_size: int, symmetric: bool, actorder: bool,
                 scale_dtype: torch.dtype | None, has_g_idx: bool,
                 has_shape: bool = True) -> None:
        self.group_size, self.symmetric, self.actorder = group_size, symmetric, actorder
        self.scale_dtype, self.has_g_idx, self.has_shape = scale_dtype, has_g_idx, has_shape

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       input_size, output_size, params_dtype):
        k, n = input_size_per_partition, sum(output_partition_sizes)
        # Per channel (group_size <= 0): one group spanning the rows, the same on every
        # rank of a row-parallel layer (its scales are not split along the input).
        per_channel = self.group_size <= 0
        g = k if per_channel else self.group_size
        check_words(FMT, layer, k, input_size, output_partition_sizes)
        partitioned_in = k != input_size
        if partitioned_in and not self.actorder and not per_channel and k % g:
            raise bad_config(FMT, f"{layer.prefix}: the input partition {k} (of {input_size}, "
                             f"--tensor-parallel-size {layer.tp_size}) is not a multiple of "
                             f"the group size {g}; use a smaller --tensor-parallel-size")
        groups_in = partitioned_in and not self.actorder and not per_channel
        groups = 1 if per_channel else -(-(k if groups_in else input_size) // g)
        in_dim = 1 if groups_in else None
        layer.register_parameter("weight_packed", make_param(
            torch.empty(n, k // 8, dtype=torch.int32), output_dim=0, input_dim=1, input_div=8))
        layer.register_parameter("weight_scale", make_param(
            torch.empty(n, groups, dtype=self.scale_dtype or params_dtype), output_dim=0,
            input_dim=in_dim, input_div=g))
        if not self.symmetric:
            layer.register_parameter("weight_zero_point", make_param(
                torch.empty(n // 8, groups, dtype=torch.int32), output_dim=0, output_div=8,
                input_dim=in_dim, input_div=g))
        layer.register_parameter("weight_shape", make_param(
            torch.zeros(len(output_partition_sizes), 2, dtype=torch.int64),
            required=self.has_shape,
            weight_loader=self._shape_loader(layer)))
        layer.register_parameter("weight_g_idx", make_param(
            (torch.arange(k) // g).to(torch.int32), input_dim=0, required=self.has_g_idx,
            weight_loader=g_idx_loader(layer, "weight_g_idx")))
        layer.int4_group = g
        layer.int4_local_groups = groups_in

    @staticmethod
    def _shape_loader(layer):
        """`weight_shape` is (N, K) of the checkpoint's tensor: it must be this shard's."""
        def load(param, loaded, spec: ShardSpec, name: str) -> None:
            check_integer(loaded.dtype, param.dtype, name)
            got = [int(v) for v in loaded.to(torch.int64).reshape(-1).tolist()]
            want = [spec.out_total, spec.in_total]
            if got != want:
                raise WeightLoadError(f"{name}: the checkpoint says the weight is {got}, but "
                                      f"the model's config makes it {want} (output, input)")
            param.data[layer.shard_ids.index(spec.shard_id)] = torch.tensor(got)
        return load

    def process_weights_after_loading(self, layer):
        k, n = layer.input_size_per_partition, sum(layer.output_partition_sizes)
        perm = act_order_perm(layer.weight_g_idx.data, layer.int4_group,
                              layer.checkpoint_name("weight_g_idx"))
        packed = layer.weight_packed.data
        # Words along K with the nibble of row 8j + i at bits 4i: the kernels' words, transposed.
        qweight = packed.t() if perm is None else pack_rows(ct_unpack(packed, k).t()[perm])
        zeros = None if self.symmetric else ct_unpack(layer.weight_zero_point.data, n, 0).t()
        scales = layer.weight_scale.data.t()
        for name in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape",
                     "weight_g_idx"):
            layer._parameters.pop(name, None)
        set_kernel_layout(layer, qweight, scales, zeros, layer.int4_group, perm)


class CompressedTensorsW4A16Config(QuantConfig):
    flags = ("compressed-tensors",)    # vLLM's name; fp8, awq and gptq do not fit
    name = "compressed-tensors w4a16"

    def __init__(self, index, group_size: int, symmetric: bool, actorder: bool,
                 fmt: str) -> None:
        super().__init__(index)
        self.group_size, self.symmetric, self.actorder, self.fmt = \
            group_size, symmetric, actorder, fmt

    @classmethod
    def from_config(cls, cfg: dict, index) -> "CompressedTensorsW4A16Config":
        size, sym, actorder = _one_scheme(cfg, _w4_scheme, "4-bit", _weights(cfg))
        return cls(index, size, sym, actorder, _format(cfg))

    def describe(self) -> str:
        g = "per channel" if self.group_size <= 0 else f"group size {self.group_size}"
        z = "symmetric" if self.symmetric else "asymmetric (zero points)"
        a = ", act-order weight_g_idx" if self.actorder else ""
        return f"compressed-tensors W4A16 checkpoint ({self.fmt}, 4-bit int weights, {g}, {z}{a})"

    def is_quantized(self, hf_prefix: str) -> bool:
        # Any of the layer's packed tensors (a missing weight_packed is then named as
        # missing, not its weight_scale as unexpected); `ignore`d layers have `weight`.
        return any(hf_prefix + "." + t in self.index for t in W4_TENSORS)

    def quantized_method(self, hf_prefixes):
        dtype = self.tensor_dtype(hf_prefixes[0] + ".weight_scale")
        has = [p + ".weight_g_idx" in self.index for p in hf_prefixes]
        # Optional tensors are waited for where the checkpoint has them (they may sit in
        # a later shard than the layer's last required one).
        has_shape = all(p + ".weight_shape" in self.index for p in hf_prefixes)
        if self.actorder and not any(has):
            raise bad_config(FMT, f"actorder group, but {hf_prefixes[0]}.weight_g_idx is "
                             "missing: act-order rows are grouped by their weight_g_idx, and "
                             "the plain groups in its place would serve garbage. Use the "
                             "checkpoint's files as llm-compressor wrote them.")
        return CompressedTensorsW4A16Method(self.group_size, self.symmetric, self.actorder,
                                            dtype, all(has), has_shape)
