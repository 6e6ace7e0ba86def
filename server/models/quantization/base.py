"""What every quantization format provides, and the checkpoint's tensor index.

A `QuantConfig` is parsed from the checkpoint's `quantization_config` (or made for
`--quantization fp8` on an unquantized checkpoint) and hands each linear layer its
`LinearMethod`. Which layers are quantized is read from the checkpoint's own tensor
index (names, dtypes and shapes from the safetensors headers, no data), so layers a
tool left unquantized (`modules_to_not_convert`, `ignore`, or shapes it could not
tile) load as they are, whichever list the tool wrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pagefleet.server.config import ConfigError
from pagefleet.server.models.linear import LinearMethod, UnquantizedLinearMethod

SAFETENSORS_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F16": torch.float16,
    "F32": torch.float32, "F64": torch.float64, "I32": torch.int32, "I64": torch.int64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str          # safetensors dtype name, e.g. "BF16", "F8_E4M3", "I32"
    shape: tuple[int, ...]


def tensor_index(files: list[Path]) -> dict[str, TensorInfo]:
    """Every tensor's file, dtype and shape, from the headers only."""
    index: dict[str, TensorInfo] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                index[name] = TensorInfo(path, sl.get_dtype(), tuple(sl.get_shape()))
    return index


class QuantConfig:
    """A checkpoint's quantization format."""

    #: the `--quantization` names that mean this format
    flags: tuple[str, ...] = ()
    #: short name for logs and errors
    name = "quantized"
    #: where the format was read when not from a `quant_method` (describe() says so)
    origin: str | None = None

    def __init__(self, index: dict[str, TensorInfo] | None = None) -> None:
        self.index = index or {}

    def describe(self) -> str:
        return self.name

    def is_quantized(self, hf_prefix: str) -> bool:
        """Whether the checkpoint stores this linear layer quantized."""
        raise NotImplementedError

    def quantized_method(self, hf_prefixes: list[str]) -> LinearMethod:
        raise NotImplementedError

    def linear_method(self, hf_prefixes: list[str]) -> LinearMethod:
        """The method for a layer fused from these HF modules (all quantized or none)."""
        flags = [self.is_quantized(p) for p in hf_prefixes]
        if all(flags):
            return self.quantized_method(hf_prefixes)
        if not any(flags):
            return UnquantizedLinearMethod()
        mixed = ", ".join(f"{p} ({'quantized' if q else 'not quantized'})"
                          for p, q in zip(hf_prefixes, flags))
        raise ConfigError(f"{self.name} checkpoint: the fused layer's parts disagree: {mixed}; "
                          "quantize or skip all of them together")

    def tensor_dtype(self, name: str) -> torch.dtype | None:
        info = self.index.get(name)
        return SAFETENSORS_DTYPES.get(info.dtype) if info else None


def bad_config(fmt: str, msg: str) -> ConfigError:
    return ConfigError(f"unsupported {fmt} checkpoint: {msg}")
