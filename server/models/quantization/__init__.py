"""Quantized weights: which format a checkpoint is in, and whether `--quantization`
agrees with it.

| `--quantization` | checkpoint | file |
| --- | --- | --- |
| (none) | whatever the quantization config says, or unquantized | |
| `fp8` | unquantized bf16/fp16/fp32: quantized at load | `fp8.py` |
| `fp8` | `quant_method: fp8` (HF transformers, AutoFP8) | `fp8.py` |
| `fp8`, `compressed-tensors` | `quant_method: compressed-tensors`, fp8 weights (llm-compressor) | `compressed_tensors.py` |
| `compressed-tensors` | `quant_method: compressed-tensors`, `pack-quantized` 4-bit int weights (llm-compressor W4A16) | `compressed_tensors.py` |
| `awq`, `awq_marlin` | `quant_method: awq` (AutoAWQ GEMM) | `awq.py` |
| `gptq`, `gptq_marlin` | `quant_method: gptq` (GPTQModel / AutoGPTQ) | `gptq.py` |

The quantization config is config.json's `quantization_config`, else its older
`compression_config` (llm-compressor), else the side file AutoGPTQ
(`quantize_config.json`) or AutoAWQ (`quant_config.json`) wrote; the older versions of
those tools wrote no `quant_method` there, and the method is then read from the file's
keys (`models/config.py:quantization_method`).

Any other pairing is a startup `ConfigError` that names the checkpoint's real format
(a wrong flag otherwise fails to load or, worse, serves garbage). So is a checkpoint
whose tensors are quantized but which has no quantization config at all (one re-saved
without it), and a quantized `lm_head` or embedding, which no format here loads.
"""

from __future__ import annotations

from pathlib import Path

from pagefleet.server.config import ConfigError, QUANTIZATION_METHODS
from pagefleet.server.models.config import quantization_method
from pagefleet.server.models.quantization.base import QuantConfig, TensorInfo, tensor_index
from pagefleet.server.models.quantization.awq import AWQConfig
from pagefleet.server.models.quantization.compressed_tensors import CompressedTensorsConfig
from pagefleet.server.models.quantization.fp8 import Fp8Config
from pagefleet.server.models.quantization.gptq import GPTQConfig

__all__ = ["QuantConfig", "TensorInfo", "tensor_index", "resolve_quantization",
           "checkpoint_quantization"]

_PARSERS = {"fp8": Fp8Config.from_config, "awq": AWQConfig.from_config,
            "gptq": GPTQConfig.from_config,
            "compressed-tensors": CompressedTensorsConfig.from_config}
# What a flag needs, for the error on an unquantized checkpoint.
_FLAG_FORMATS = {"awq": "AWQ", "gptq": "GPTQ",
                 "compressed-tensors": "llm-compressor (compressed-tensors)"}
_FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
# Tensor names only quantized checkpoints have (AWQ/GPTQ, fp8, compressed-tensors).
_QUANT_SUFFIXES = (".qweight", ".qzeros", ".g_idx", ".weight_scale", ".weight_scale_inv",
                   ".input_scale", ".weight_zero_point", ".weight_packed", ".weight_shape")
# Loaded unquantized by every format.
_DENSE_MODULES = ("lm_head", "model.embed_tokens")


def checkpoint_quantization(qcfg: dict | None, index: dict[str, TensorInfo],
                            source: str | None = None, flag: str | None = None
                            ) -> QuantConfig | None:
    """The checkpoint's own format (None: not quantized); unsupported ones are errors.
    `source`: where `qcfg` was read (`ModelConfig.quantization_config_file`); `flag`:
    `--quantization`, which picks AWQ or GPTQ for a side file its keys leave open."""
    if not qcfg:
        return None
    method = quantization_method(qcfg, source, flag)
    if method not in _PARSERS:
        where = "quantization_config" if source in (None, "config.json") else source
        what = f"has quant_method {method!r}" if method else \
            f"has no quant_method (keys: {', '.join(sorted(qcfg)[:8])})"
        raise ConfigError(f"the checkpoint's {where} {what}, which pagefleet cannot load; "
                          f"supported: {', '.join(_PARSERS)}")
    ckpt = _PARSERS[method](qcfg, index)
    if not qcfg.get("quant_method"):
        ckpt.origin = f"{source} without quant_method"
    _refuse_quantized_dense(ckpt, index)
    return ckpt


def _refuse_quantized_dense(ckpt: QuantConfig, index: dict[str, TensorInfo]) -> None:
    """lm_head and the embedding are loaded unquantized whatever the format; a
    checkpoint that stores either quantized is refused before anything is read."""
    for module in _DENSE_MODULES:
        w = index.get(module + ".weight")
        found = [f"{module}.weight {w.dtype}"] if w is not None and \
            w.dtype not in _FLOAT_DTYPES else []
        found += sorted(n for n in index if n.startswith(module + ".")
                        and n not in (module + ".weight", module + ".bias"))
        if found:
            name = module.split(".")[-1]
            raise ConfigError(
                f"unsupported {ckpt.describe()}: its {name} is quantized ({', '.join(found[:4])}); "
                f"a quantized {name} is not supported (pagefleet loads {module} unquantized). "
                f"Quantize the model with {name} left out (llm-compressor: in `ignore`, as its "
                "recipes do by default; GPTQ: lm_head false).")


def _quantized_tensors(index: dict[str, TensorInfo]) -> str | None:
    """What the tensors of a checkpoint without a quantization config look like (None:
    nothing quantized), from the names and dtypes in the safetensors headers."""
    found = {n: i for n, i in index.items() if n.endswith(_QUANT_SUFFIXES)
             or (n.endswith(".weight") and i.dtype not in _FLOAT_DTYPES)}
    if not found:
        return None
    names = sorted(found)

    def has(suffix: str) -> bool:
        return any(n.endswith(suffix) for n in names)

    if has(".weight_packed"):
        kind = ("4-bit compressed-tensors pack-quantized tensors (weight_packed, "
                "weight_scale, weight_shape: llm-compressor W4A16-like)")
    elif has(".qweight"):
        kind = ("4-bit GPTQ-like tensors (qweight, qzeros, scales, g_idx)" if has(".g_idx")
                else "4-bit AWQ-like tensors (qweight, qzeros, scales; no g_idx)")
    elif has(".weight_scale_inv"):
        kind = "fp8 tensors (float8_e4m3fn weights, weight_scale_inv: HF transformers fp8-like)"
    elif has(".weight_scale") or any(found[n].dtype == "F8_E4M3" for n in names):
        kind = "fp8 tensors (float8_e4m3fn weights, weight_scale: llm-compressor-like)"
    else:
        kind = "quantized tensors (integer or 8-bit float weights)"
    first = next((n for n in names if n.endswith((".qweight", ".weight_packed", ".weight"))),
                 names[0])
    return f"{kind}, e.g. {first} {found[first].dtype} {list(found[first].shape)}"


def resolve_quantization(model_dir: str | Path, qcfg: dict | None, flag: str | None,
                         index: dict[str, TensorInfo], weights_dtype: str | None = None,
                         source: str | None = None) -> QuantConfig | None:
    """The format to load the checkpoint in, checked against `--quantization`."""
    if flag is not None and flag not in QUANTIZATION_METHODS:
        raise ConfigError(f"--quantization: {flag!r} is not one of "
                          f"{', '.join(QUANTIZATION_METHODS)}")
    ckpt = checkpoint_quantization(qcfg, index, source, flag)
    if ckpt is None:
        found = _quantized_tensors(index)
        if found is not None:
            opt = f"--quantization {flag}" if flag else "--quantization"
            raise ConfigError(
                f"the checkpoint in {model_dir} is quantized but has no quantization "
                f"config: its tensors are {found}, yet config.json has no "
                "quantization_config (nor compression_config) and there is no "
                "quantize_config.json or quant_config.json beside it. Its config.json is "
                "missing the quantization_config the quantization tool wrote (lost when the "
                f"model was re-saved?): put it back. {opt} cannot stand in for it (the "
                "format's details, such as the group size or the scale layout, are in that "
                "config).")
        if flag in (None, "fp8"):
            return Fp8Config(index, online=True) if flag else None
        dtype = weights_dtype or "unquantized"
        raise ConfigError(
            f"--quantization {flag} does not match the checkpoint in {model_dir}: it is not "
            f"quantized ({dtype} weights, no quantization_config in config.json), and {flag} "
            f"needs a checkpoint quantized with {_FLAG_FORMATS[flag.split('_')[0]]}. Omit "
            "--quantization to serve it as it is, or pass --quantization fp8 to quantize "
            "it to fp8 at load.")
    if flag is not None and flag not in ckpt.flags:
        what = ckpt.describe()
        article = "an" if what[0] in "AFf" else "a"    # an AWQ / an FP8 / a GPTQ
        raise ConfigError(
            f"--quantization {flag} does not match the checkpoint in {model_dir}: it is "
            f"{article} {what}. Omit --quantization to use the checkpoint's own format "
            f"(or pass --quantization {ckpt.flags[0]}).")
    return ckpt
