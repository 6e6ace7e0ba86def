"""4-bit packing of the on-disk formats, and of the kernels' own layout.

Pure tensor functions, shared by the loader (checkpoint -> kernel layout), the torch
twins (which read the kernels' layout) and the quantizer (`pagefleet.server.testing_quant`).
The on-disk layouts, as AutoAWQ and GPTQModel write them (checked against their code;
the tests re-derive each word with a transcription of the original packing loops):

- AWQ (GEMM): `qweight` int32 `[K, N // 8]`, packed along the output dimension; word
  `[k, j]` holds output columns `8j .. 8j+7`, nibble `i` (bits `4i .. 4i+3`) holding
  column `8j + AWQ_ORDER[i]`. `qzeros` int32 `[K // G, N // 8]`, the same way.
- GPTQ: `qweight` int32 `[K // 8, N]`, packed along the input dimension; nibble `i` of
  word `[r, n]` holds input row `8r + i`. `qzeros` int32 `[ceil(K / G), N // 8]`
  packed along the output dimension in plain order; format v1 (`checkpoint_format:
  gptq`) stores `zero - 1` (a whole-word subtraction of 0x11111111), v2 stores `zero`.
- compressed-tensors `pack-quantized` (llm-compressor W4A16; `pack_to_int32` /
  `unpack_from_int32` in compressed_tensors/compressors/pack_quantized/helpers.py):
  signed values -8..7 stored plus 8 (`CT_OFFSET`), packed in plain order along one
  dim, a partial last word padded with zero nibbles. `weight_packed` int32
  `[N, ceil(K / 8)]` is packed along the input dim (nibble `i` of word `[n, j]` holds
  column `8j + i`: the transpose of GPTQ's `qweight` when K % 8 == 0);
  `weight_zero_point` int32 `[ceil(N / 8), groups]` along the output dim.

The kernels read the GPTQ `qweight` layout (K-major words) for both formats, with the
zero points unpacked to one byte each (`[groups, N]` uint8, or none when every zero
point is 8, the symmetric case).
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)     # nibble i holds column AWQ_ORDER[i] of its 8
PLAIN_ORDER = tuple(range(8))
_SHIFTS = tuple(range(0, 32, 4))


def _to_int32(words64: torch.Tensor) -> torch.Tensor:
    """Low 32 bits of int64 words as int32 (two's complement), as the tools store them."""
    words64 = words64 & 0xFFFFFFFF
    return torch.where(words64 >= 1 << 31, words64 - (1 << 32), words64).to(torch.int32)


def pack_cols(values: torch.Tensor, order: tuple[int, ...] = PLAIN_ORDER) -> torch.Tensor:
    """int values 0..15 `[R, N]` -> int32 `[R, N // 8]`, packed along the last dim."""
    r, n = values.shape
    if n % 8:
        raise ValueError(f"cannot pack {n} columns into 4-bit words: not a multiple of 8")
    v = values.to(torch.int64).reshape(r, n // 8, 8)
    words = torch.zeros(r, n // 8, dtype=torch.int64, device=values.device)
    for i, col in enumerate(order):
        words |= (v[:, :, col] & 0xF) << _SHIFTS[i]
    return _to_int32(words)


def unpack_cols(words: torch.Tensor, order: tuple[int, ...] = PLAIN_ORDER) -> torch.Tensor:
    """int32 `[R, N // 8]` -> uint8 `[R, N]` (inverse of `pack_cols`)."""
    r, w = words.shape
    w64 = words.to(torch.int64)
    out = torch.empty(r, w, 8, dtype=torch.uint8, device=words.device)
    for i, col in enumerate(order):
        out[:, :, col] = ((w64 >> _SHIFTS[i]) & 0xF).to(torch.uint8)
    return out.reshape(r, w * 8)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """int values 0..15 `[K, N]` -> int32 `[K // 8, N]`, nibble i = row 8r + i."""
    k, n = values.shape
    if k % 8:
        raise ValueError(f"cannot pack {k} rows into 4-bit words: not a multiple of 8")
    v = values.to(torch.int64).reshape(k // 8, 8, n)
    words = torch.zeros(k // 8, n, dtype=torch.int64, device=values.device)
    for i in range(8):
        words |= (v[:, i] & 0xF) << _SHIFTS[i]
    return _to_int32(words)


def unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 `[K // 8, N]` -> uint8 `[K, N]` (inverse of `pack_rows`)."""
    r, n = words.shape
    w64 = words.to(torch.int64)
    out = torch.empty(r, 8, n, dtype=torch.uint8, device=words.device)
    for i in range(8):
        out[:, i] = ((w64 >> _SHIFTS[i]) & 0xF).to(torch.uint8)
    return out.reshape(r * 8, n)


CT_OFFSET = 8   # compressed-tensors stores int4 value v as the nibble v + 8


def ct_pack(values: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """compressed-tensors' `pack_to_int32` for 4 bits: signed values -8..7 `[R, C]` ->
    int32 words packed along `dim` (1: `[R, ceil(C / 8)]`, 0: `[ceil(R / 8), C]`), each
    value stored + 8, nibble i of word j holding element 8j + i, a partial last word
    padded with zero nibbles."""
    if bool(((values < -CT_OFFSET) | (values >= CT_OFFSET)).any()):
        raise ValueError("compressed-tensors int4 values must lie in -8..7")
    v = values.to(torch.int64) + CT_OFFSET
    if dim == 0:
        v = v.t()
    pad = -v.shape[1] % 8
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    words = pack_cols(v)
    return (words.t() if dim == 0 else words).contiguous()


def ct_unpack(words: torch.Tensor, size: int, dim: int = 1) -> torch.Tensor:
    """The stored nibbles (value + 8, uint8 0..15) of compressed-tensors words packed
    along `dim`, `size` elements along it (the inverse of `ct_pack`, before the - 8)."""
    w = words.t() if dim == 0 else words
    if not 0 <= w.shape[1] * 8 - size < 8:
        raise ValueError(f"{w.shape[1]} words along dim {dim} cannot hold {size} values")
    out = unpack_cols(w)[:, :size]
    return out.t() if dim == 0 else out


def gptq_v1_qzeros(zeros: torch.Tensor) -> torch.Tensor:
    """GPTQ v1 `qzeros` from zero points `[G, N]`: pack, then subtract 0x11111111 from
    every word, as GPTQModel's v2 -> v1 conversion does (a zero point of 0 borrows from
    its neighbour: such weights have no v1 encoding, so they are refused here)."""
    if bool((zeros < 1).any()):
        raise ValueError("a zero point of 0 cannot be stored in GPTQ v1 qzeros (it would "
                         "underflow into the next nibble); write checkpoint_format gptq_v2")
    words = pack_cols(zeros).to(torch.int64) & 0xFFFFFFFF
    return _to_int32(words - 0x11111111)


def gptq_zeros_from_qzeros(qzeros: torch.Tensor, v1: bool) -> torch.Tensor:
    """Zero points `[G, N]` (int16) from GPTQ `qzeros`; v1 stores zero - 1."""
    z = unpack_cols(qzeros).to(torch.int16)
    return z + 1 if v1 else z
