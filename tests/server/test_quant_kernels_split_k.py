"""Split-K summed in the kernel by each tile's last program (arrival counters) against
the separate reduction kernel, for every quantized GEMM path (int4 GEMV and tl.dot,
fp8 GEMV, SiLU GEMV, tl.dot and fp8 x fp8), under TRITON_INTERPRET=1. Shapes:
tests/server/kernel_helpers.py."""

from __future__ import annotations

import pytest

# kernel_helpers first: it sets TRITON_INTERPRET=1 before anything imports triton.
from tests.server.kernel_helpers import (fp8_case, int4_case, quant_small_tiles,
                                         torch, triton_quant)
from pagefleet.server.ops import quant


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    quant_small_tiles(monkeypatch)


@pytest.mark.parametrize("path", ["w4_gemv", "w4_gemm", "w4_gemm_planes", "fp8_gemv",
                                  "fp8_silu", "fp8_gemm", "fp8_a8"])
def test_split_k_summed_by_the_last_program_is_the_second_kernels_bits(path, monkeypatch):
    """`fused_reduce`: each tile's last program sums the K splits (arrival counters)
    instead of `_splitk_reduce_kernel` after: the same bits over several output tiles
    (rows and columns), with a bias and without, and every counter back at zero for the
    next launch (a captured graph replays on them). The launches are recorded, so the
    test fails if the fused form (or the second kernel) never ran."""
    from pagefleet.server.ops import triton_common
    w4 = path.startswith("w4")
    cfg = triton_quant.W4_CONFIG if w4 else triton_quant.FP8_CONFIG
    monkeypatch.setitem(cfg, "target_programs", 1000)           # as many splits as fit
    monkeypatch.setitem(cfg, "gemv_max_m", 16 if path.endswith(("gemv", "silu")) else 0)
    m, k, n = (3, 400, 40) if path.endswith(("gemv", "silu")) else (20, 400, 40)
    if w4:
        monkeypatch.setitem(cfg, "dequant_min_m", 10 ** 9)
        monkeypatch.setitem(cfg, "gemm_planes", path == "w4_gemm_planes")
        x, qw, s, z, b = int4_case(m, k, n, 32, True, torch.bfloat16, seed=11)
        run = lambda bias: triton_quant.w4a16_linear(x, qw, s, z, 32, bias)  # noqa: E731
    else:
        block = (1, k)
        x, w, ws, b = fp8_case(m, k, n, block, torch.bfloat16, seed=13)
        gate_up = fp8_case(m, 2 * k, n, block, torch.bfloat16, seed=17)[0]
        q, a_scale = quant.quantize_fp8_per_token(x)
        run = {"fp8_gemv": lambda bias: triton_quant.fp8_w8a16_linear(x, w, ws, block, None, bias),
               "fp8_silu": lambda bias: triton_quant.fp8_silu_linear(gate_up, w, ws, block,
                                                                      None, bias),
               "fp8_gemm": lambda bias: triton_quant.fp8_w8a16_linear(x, w, ws, block, None,
                                                                       bias),
               "fp8_a8": lambda bias: triton_quant.fp8_gemm_a8(q, a_scale, w, ws, block, bias,
                                                               torch.bfloat16, scaled_mm=False),
               }[path]
    launches = []
    outputs = triton_quant._outputs

    def recorded(splits, m_, n_, tiles, *args):
        o = outputs(splits, m_, n_, tiles, *args)
        launches.append((splits, tiles, o.fused))
        return o

    monkeypatch.setattr(triton_quant, "_outputs", recorded)
    for bias in (b, None):
        got = []
        for fused in (False, True):
            monkeypatch.setitem(cfg, "fused_reduce", fused)
            launches.clear()
            got.append(run(bias))
            assert launches and all(sp > 1 and tiles > 1 and f == fused
                                    for sp, tiles, f in launches), launches
        assert torch.equal(got[0], got[1])
        counters = triton_common.arrival_counters(x.device, 1)
        assert counters is not None and not counters.any()
