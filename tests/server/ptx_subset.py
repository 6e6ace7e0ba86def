"""A small emulator of the PTX instructions the w4 decodes' inline assembly uses
(`server/ops/gluon_w4.py`: `_pair_asm`, `_pair_asm_fma`), so that the
CPU tests can run those strings: Gluon kernels do not run under TRITON_INTERPRET, and
before this the strings were only ever checked on a GPU.

Registers are numpy arrays (one lane per element): 32-bit as uint32, 16-bit as uint16.
Supported: `.reg` declarations, `mov.b32` (an immediate, a register, or a 32-bit
register split into `{lo, hi}` halves), `shr.u32`, `shl.b32`, `lop3.b32` (any lookup
table), and packed `sub.rn` / `fma.rn` on `f16x2` and `bf16x2` (computed in float64,
rounded once to the 16-bit type: exact for the small integers the decodes produce).
Anything else raises, so a decode that grows a new instruction fails its test until
the emulator learns it."""

from __future__ import annotations

import re

import numpy as np
import torch


def _halves(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return (v & 0xFFFF).astype(np.uint16), (v >> 16).astype(np.uint16)


def _to_float(h: np.ndarray, ty: str) -> np.ndarray:
    if ty == "f16":
        return h.view(np.float16).astype(np.float64)
    bits = torch.from_numpy(h.astype(np.int32) << 16)        # bf16: the high half of f32
    return bits.view(torch.float32).double().numpy()


def _from_float(x: np.ndarray, ty: str) -> np.ndarray:
    if ty == "f16":
        return x.astype(np.float16).view(np.uint16)
    b = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy()
    return b.view(np.uint16)


def _packed(op: str, ty: str, args: list[np.ndarray]) -> np.ndarray:
    """A packed two-lane op on 32-bit registers."""
    out = []
    for half in (0, 1):
        xs = [_to_float(_halves(a)[half], ty) for a in args]
        r = xs[0] - xs[1] if op == "sub" else xs[0] * xs[1] + xs[2]
        out.append(_from_float(r, ty).astype(np.uint32))
    return out[0] | (out[1] << 16)


def _lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, lut: int) -> np.ndarray:
    r = np.zeros_like(a)
    for i in range(8):
        if lut >> i & 1:
            r |= ((a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c))
    return r


def run(asm: str, operands: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Run `asm` (Triton's inline-asm string: `$N` operands) with the input operands
    given (uint32 arrays of one shape); returns every operand written, by number."""
    shape = next(iter(operands.values())).shape
    regs: dict[str, np.ndarray] = {f"${k}": np.asarray(v, dtype=np.uint32)
                                   for k, v in operands.items()}
    written: dict[int, np.ndarray] = {}

    def val(tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok):
            return np.full(shape, int(tok, 0) & 0xFFFFFFFF, dtype=np.uint32)
        raise KeyError(f"register {tok!r} read before it was written")

    def put(tok: str, v: np.ndarray) -> None:
        tok = tok.strip()
        regs[tok] = v
        if tok.startswith("$"):
            written[int(tok[1:])] = v

    body = asm.strip()
    body = body[1:-1] if body.startswith("{") and body.endswith("}") else body
    for stmt in filter(None, (s.strip() for s in body.split(";"))):
        if stmt.startswith(".reg"):
            continue
        m = re.fullmatch(r"(\S+)\s+(.*)", stmt)
        op, rest = m.group(1), m.group(2)
        split = re.fullmatch(r"\{\s*(\S+)\s*,\s*(\S+)\s*\}\s*,\s*(\S+)", rest)
        if op == "mov.b32" and split:
            lo, hi = _halves(val(split.group(3)))
            put(split.group(1), lo)
            put(split.group(2), hi)
            continue
        args = [a.strip() for a in rest.split(",")]
        if op == "mov.b32":
            put(args[0], val(args[1]))
        elif op == "shr.u32":
            put(args[0], val(args[1]) >> np.uint32(int(args[2], 0)))
        elif op == "shl.b32":
            put(args[0], (val(args[1]) << np.uint32(int(args[2], 0))) & 0xFFFFFFFF)
        elif op == "lop3.b32":
            put(args[0], _lop3(val(args[1]), val(args[2]), val(args[3]), int(args[4], 0)))
        elif m2 := re.fullmatch(r"(sub|fma)\.rn\.(f16|bf16)x2", op):
            put(args[0], _packed(m2.group(1), m2.group(2), [val(a) for a in args[1:]]))
        else:
            raise NotImplementedError(f"PTX the emulator does not know: {stmt!r}")
    return written


def f16_bits(h: np.ndarray) -> np.ndarray:
    """16-bit fp16 patterns -> their values."""
    return np.asarray(h, dtype=np.uint16).view(np.float16).astype(np.float64)


def bf16_bits(h: np.ndarray) -> np.ndarray:
    """16-bit bf16 patterns -> their values."""
    return _to_float(np.asarray(h, dtype=np.uint16), "bf16")
