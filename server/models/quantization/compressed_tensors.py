"""llm-compressor's `compressed-tensors` checkpoints with fp8 weights.

`quantization_config` as compressed-tensors writes it: `quant_method:
compressed-tensors`, `format: float-quantized` (or `naive-quantized`), `config_groups`
whose `weights` are `num_bits: 8, type: float, symmetric` with strategy `tensor`,
`channel` or `block` (`block_structure`), and `input_activations` either absent
(w8a16), dynamic (strategy `token`, or `group`, computed here per token), or static
per-tensor (`input_scale`). Tensors: `weight` e4m3 `[N, K]`, `weight_scale` in the
model's dtype (`[1]`, `[N, 1]` or `[ceil(N / bn), ceil(K / bk)]`), `input_scale`.
Layers listed in `ignore` are stored unquantized, which the tensor index shows.
"""

from __future__ import annotations

from pagefleet.server.models.quantization.base import QuantConfig, bad_config
from pagefleet.server.models.quantization.fp8 import Fp8LinearMethod

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
    """What config_groups say the weights are, for the error on a format not loaded
    here: pack-quantized (W4A16, llm-compressor's most common output) and int-quantized
    name only a packing, not the bits."""
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


class CompressedTensorsConfig(QuantConfig):
    flags = ("fp8", "compressed-tensors")    # the second: vLLM's name for these
    name = "compressed-tensors fp8"

    def __init__(self, index, kind: str, block, static_input: bool, fmt: str) -> None:
        super().__init__(index)
        self.kind, self.block, self.static_input, self.fmt = kind, block, static_input, fmt

    @classmethod
    def from_config(cls, cfg: dict, index) -> "CompressedTensorsConfig":
        fmt = cfg.get("format")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise bad_config(FMT, f"format {fmt!r}{_weights(cfg)}: only fp8 weights "
                             "(float-quantized) are supported; for 4-bit weights use the "
                             "model's AWQ or GPTQ checkpoint")
        if cfg.get("kv_cache_scheme"):
            raise bad_config(FMT, "kv_cache_scheme (quantized KV cache scales); use "
                             "--kv-cache-dtype fp8 instead")
        if cfg.get("sparsity_config") or cfg.get("transform_config"):
            raise bad_config(FMT, "sparsity or transform configs")
        groups = cfg.get("config_groups") or {}
        schemes = {_scheme(g) for g in groups.values()}
        if len(schemes) != 1:
            raise bad_config(FMT, f"{len(schemes)} different schemes in config_groups (one "
                             "fp8 scheme for all layers is supported)")
        kind, block, static = schemes.pop()
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
