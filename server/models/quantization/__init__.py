"""Quantized weights: which format a checkpoint is in, and whether `--quantization`
agrees with it.

| `--quantization` | checkpoint | file |
| --- | --- | --- |
| (none) | whatever `quantization_config` says, or unquantized | |
| `fp8` | unquantized bf16/fp16/fp32: quantized at load | `fp8.py` |
| `fp8` | `quant_method: fp8` (HF transformers, AutoFP8) | `fp8.py` |
| `fp8` | `quant_method: compressed-tensors`, fp8 weights (llm-compressor) | `compressed_tensors.py` |
| `awq`, `awq_marlin` | `quant_method: awq` (AutoAWQ GEMM) | `awq.py` |
| `gptq`, `gptq_marlin` | `quant_method: gptq` (GPTQModel / AutoGPTQ) | `gptq.py` |

Any other pairing is a startup `ConfigError` that names the checkpoint's real format
(a wrong flag otherwise fails to load or, worse, serves garbage).
"""

from __future__ import annotations

from pathlib import Path

from pagefleet.server.config import ConfigError, QUANTIZATION_METHODS
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


def checkpoint_quantization(qcfg: dict | None, index: dict[str, TensorInfo]) -> QuantConfig | None:
    """The checkpoint's own format (None: not quantized); unsupported ones are errors."""
    if not qcfg:
        return None
    method = str(qcfg.get("quant_method", "")).lower()
    if method not in _PARSERS:
        raise ConfigError(f"the checkpoint's quantization_config has quant_method {method!r}, "
                          f"which pagefleet cannot load; supported: {', '.join(_PARSERS)}")
    return _PARSERS[method](qcfg, index)


def resolve_quantization(model_dir: str | Path, qcfg: dict | None, flag: str | None,
                         index: dict[str, TensorInfo], weights_dtype: str | None = None
                         ) -> QuantConfig | None:
    """The format to load the checkpoint in, checked against `--quantization`."""
    if flag is not None and flag not in QUANTIZATION_METHODS:
        raise ConfigError(f"--quantization: {flag!r} is not one of "
                          f"{', '.join(QUANTIZATION_METHODS)}")
    ckpt = checkpoint_quantization(qcfg, index)
    if ckpt is None:
        if flag in (None, "fp8"):
            return Fp8Config(index, online=True) if flag else None
        dtype = weights_dtype or "unquantized"
        raise ConfigError(
            f"--quantization {flag} does not match the checkpoint in {model_dir}: it is not "
            f"quantized ({dtype} weights, no quantization_config in config.json), and {flag} "
            f"needs a checkpoint quantized with {flag.split('_')[0].upper()}. Omit "
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
