"""Deferred one-row GEMV sums (ops/deferred.py): the readers (the fused add + RMSNorm
and the rotary + KV write kernels, interpreted) give the bits of the row made a tensor
first and leave the layer's accumulator zero; the decoder routes q/k/v, o and down
through them, and a whole model whose one-row GEMVs defer (a twin of the GPU kernel's
fixed-point adds; the Gluon kernel itself is checked on a GPU by
benchmarks/gemv_mma_check.py) gives the torch path's greedy tokens."""

from __future__ import annotations

import pytest
import torch

# kernel_helpers first: it sets TRITON_INTERPRET=1 before anything imports triton.
from tests.server.kernel_helpers import attention_small_tiles, quant_small_tiles

from pagefleet.server.ops import deferred
from pagefleet.server.ops.deferred import DeferredSlot, DeferredSum


def _deferred(n: int, splits: int, seed: int, bias: bool, dtype=torch.float32) -> DeferredSum:
    g = torch.Generator().manual_seed(seed)
    parts = torch.randn(splits, 1, n, generator=g) * 3
    acc = deferred.fixed_point(parts)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype) if bias else None
    return DeferredSum(acc, b, dtype)


def _copy(d: DeferredSum) -> DeferredSum:
    return DeferredSum(d.acc.clone(), d.bias, d.dtype)


def test_fixed_point_sum_is_order_free_and_close_to_the_float_sum():
    g = torch.Generator().manual_seed(0)
    parts = torch.randn(14, 1, 300, generator=g) * 50
    a = deferred.fixed_point(parts)
    b = deferred.fixed_point(parts.flip(0))
    assert torch.equal(a, b)
    got = DeferredSum(a.clone(), None, torch.float32).materialize()
    assert (got - parts.sum(0)).abs().max() < 1e-6 * parts.abs().sum(0).max()


def test_materialize_converts_adds_the_bias_and_rearms():
    d = _deferred(40, 5, 1, bias=True, dtype=torch.bfloat16)
    want = (d.acc.to(torch.float32) / deferred.SCALE + d.bias.float()).to(torch.bfloat16)
    got = d.materialize()
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert not d.acc.any()


def test_slot_keeps_its_row_and_makes_a_new_one_for_another_width():
    slot = DeferredSlot()
    a = slot.buffer(16, torch.device("cpu"))
    assert a.dtype == torch.int64 and a.shape == (1, 16) and not a.any()
    assert slot.buffer(16, torch.device("cpu")) is a
    assert slot.buffer(8, torch.device("cpu")).shape == (1, 8)


def test_a_sum_never_read_is_cleared_before_the_row_is_reused(caplog):
    """An error between a GEMV and its reader (eager) leaves the row holding a sum: the
    next call must not add onto it."""
    slot = DeferredSlot()
    acc = slot.buffer(4, torch.device("cpu"))
    acc += 7
    d = slot.hand_out(None, torch.float32)
    assert slot.armed and d.slot is slot
    with caplog.at_level("WARNING", logger="pagefleet.engine"):
        again = slot.buffer(4, torch.device("cpu"))
    assert again is acc and not acc.any() and not slot.armed
    assert "never read" in caplog.text
    acc += 3
    slot.hand_out(None, torch.float32).materialize()   # read: nothing to clear, no warning
    caplog.clear()
    slot.buffer(4, torch.device("cpu"))
    assert not slot.armed and "never read" not in caplog.text


@pytest.mark.parametrize("bias", [False, True])
def test_norm_reads_a_deferred_row_as_the_tensor_it_stands_for(bias):
    from pagefleet.server.ops import triton_layernorm
    n = 96
    d = _deferred(n, 7, 2, bias)
    g = torch.Generator().manual_seed(3)
    residual, w = torch.randn(1, n, generator=g), torch.randn(n, generator=g)
    want = triton_layernorm.fused_add_rms_norm(_copy(d).materialize(), residual, w, 1e-6)
    got = triton_layernorm.fused_add_rms_norm(d, residual, w, 1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not d.acc.any()


@pytest.mark.parametrize("bias,fp8", [(True, False), (False, True)])
def test_rotary_reads_a_deferred_qkv_row_as_the_tensor_it_stands_for(bias, fp8):
    from pagefleet.server.ops import rotary, triton_rotary
    heads, kv_heads, d = 4, 2, 32
    n = (heads + 2 * kv_heads) * d
    row = _deferred(n, 5, 4, bias)
    cs = rotary.cos_sin_cache(d, 64, 10000.0, None)
    pos, slot = torch.tensor([17]), torch.tensor([5])
    cdt = torch.float8_e4m3fn if fp8 else torch.float32

    def caches():
        return torch.zeros(8, kv_heads, d, dtype=cdt), torch.zeros(8, kv_heads, d, dtype=cdt)

    kc, vc = caches()
    q, k, v = _copy(row).materialize().split([heads * d, kv_heads * d, kv_heads * d], -1)
    want = triton_rotary.rotary_and_store(pos, q.reshape(1, heads, d), k.reshape(1, kv_heads, d),
                                          v.reshape(1, kv_heads, d), cs, kc, vc, slot, 0.5, 0.25)
    kc2, vc2 = caches()
    got = triton_rotary.rotary_and_store_deferred(pos, row, heads, kv_heads, d, cs, kc2, vc2,
                                                  slot, 0.5, 0.25)
    assert torch.equal(got, want)
    assert torch.equal(kc2.float(), kc.float()) and torch.equal(vc2.float(), vc.float())
    assert kc[5].float().abs().sum() > 0
    assert not row.acc.any()


def _deferring_ops(base):
    """`base` whose 4-bit linears, at one row with a slot, defer their sum as the GPU's
    one-row GEMV does: the twin's product in 3 K splits, each added in fixed point to
    the layer's accumulator (which the readers must find zero)."""
    from pagefleet.server.ops import quant
    from pagefleet.server.ops.deferred import fixed_point

    def w4a16_linear(x, qweight, scales, zeros, group_size, bias=None, deferred=None):
        if deferred is None or x.shape[0] != 1:
            return base.w4a16_linear(x, qweight, scales, zeros, group_size, bias)
        w = quant.w4_dequantize(qweight, scales, zeros, group_size, torch.float32)
        ks = torch.arange(w.shape[0]).chunk(3)
        parts = torch.stack([x[:, i].float() @ w[i] for i in ks])
        acc = deferred.buffer(w.shape[1], x.device)
        assert not acc.any(), "a reader left the accumulator armed"
        acc += fixed_point(parts)
        return deferred.hand_out(bias, x.dtype)

    def w4a16_silu_linear(x, qweight, scales, zeros, group_size, bias=None, deferred=None):
        return w4a16_linear(base.silu_and_mul(x), qweight, scales, zeros, group_size, bias,
                            deferred)

    class Deferring(base):
        pass
    Deferring.w4a16_linear = staticmethod(w4a16_linear)
    Deferring.w4a16_silu_linear = staticmethod(w4a16_silu_linear)
    return Deferring


@pytest.fixture
def tiles(monkeypatch):
    attention_small_tiles(monkeypatch)
    quant_small_tiles(monkeypatch)


@pytest.mark.usefixtures("tiles")
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_a_model_whose_one_row_gemvs_defer_gives_the_torch_tokens(tmp_path, arch):
    """q/k/v (with qwen2's bias; not qwen3's: its q/k norms read q/k), o and down defer at
    one row; TritonOps' readers (interpreted) and the torch twins' both give the torch
    path's greedy tokens, through the padded decode path and the piecewise one, and
    every accumulator is zero after."""
    from pagefleet.server import LLM, SamplingParams
    from pagefleet.server.models.decoder import Ops
    from pagefleet.server.ops.triton_ops import TritonOps
    from pagefleet.server.testing import build_tiny_model
    from pagefleet.server.testing_quant import quantize_checkpoint
    from tests.server.helpers import random_prompts

    src = build_tiny_model(tmp_path / "src", arch, hidden_size=64, num_layers=2,
                           num_heads=2, num_kv_heads=1, vocab_size=300)
    q = quantize_checkpoint(src, tmp_path / "awq", "awq", group_size=32)
    prompts = random_prompts(4, [9, 5, 1], 290)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for name, ops, pieces in (("torch", Ops, None), ("deferred-torch", _deferring_ops(Ops), None),
                              ("deferred-triton", _deferring_ops(TritonOps), False),
                              ("deferred-pieces", _deferring_ops(TritonOps), True)):
        llm = LLM(q, max_model_len=64, max_num_seqs=2, block_size=16, enforce_eager=True)
        runner = llm.engine.runner
        runner.set_ops(ops)
        if pieces is not None:
            runner._setup_decode_path(pieces=pieces)
        outs[name] = [o.outputs[0].token_ids for o in
                      [*llm.generate(prompts[:1], params), *llm.generate(prompts[1:], params)]]
        slots = [m.deferred for m in runner.model.modules()
                 if getattr(m, "deferred", None) is not None]
        assert len(slots) == (3 if arch == "qwen2" else 2) * 2
        if name != "torch":
            assert all(s.acc is not None and not s.acc.any() and not s.armed
                       for s in slots), name
    for name in ("deferred-torch", "deferred-triton", "deferred-pieces"):
        assert outs[name] == outs["torch"], name


@pytest.mark.usefixtures("tiles")
def test_the_fp8_gemv_defers_in_the_interpreter_and_gives_the_same_tokens(tmp_path, monkeypatch):
    """The one-row fp8 GEMV (a Triton kernel: its fixed-point adds run here, unlike the
    Gluon 4-bit ones) with FP8_CONFIG["deferred_sum"] on, through TritonOps' readers:
    the tokens of the arrival-counter sum, and every accumulator zero after."""
    from pagefleet.server import LLM, SamplingParams
    from pagefleet.server.ops import triton_quant
    from pagefleet.server.ops.triton_ops import TritonOps
    from pagefleet.server.testing import build_tiny_model
    from tests.server.helpers import random_prompts

    src = build_tiny_model(tmp_path / "src", "qwen2", hidden_size=64, num_layers=2,
                           num_heads=2, num_kv_heads=1, vocab_size=300)
    prompts = random_prompts(6, [9, 5], 290)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs, made = {}, {}
    # enough programs that q/k/v's 128 columns split K too
    monkeypatch.setitem(triton_quant.FP8_CONFIG, "target_programs", 64)
    for on in (False, True):
        monkeypatch.setitem(triton_quant.FP8_CONFIG, "deferred_sum", on)
        llm = LLM(src, max_model_len=64, max_num_seqs=1, enforce_eager=True, quantization="fp8")
        runner = llm.engine.runner
        runner.set_ops(TritonOps)
        outs[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        slots = [m.deferred for m in runner.model.modules()
                 if getattr(m, "deferred", None) is not None]
        made[on] = [s.acc is not None for s in slots]
        assert all(s.acc is None or not s.acc.any() for s in slots)
    assert outs[True] == outs[False]
    assert not any(made[False]) and all(made[True]) and len(made[True]) == 6


def test_rotary_reader_does_not_specialize_on_the_step_inputs_alignment():
    """As `_rotary_store_kernel` (step inputs are staging slices, at any offset): one
    compiled variant whatever the position's and slot's alignment, so a one-row step
    reading them from the staged `[4, width]` block (8 bytes in at width 1) rather than
    the decode path's `_g_tok` compiles nothing new while serving."""
    from pagefleet.server.ops import jit_variants, rotary, triton_rotary
    heads, kv_heads, d = 4, 2, 32
    n = (heads + 2 * kv_heads) * d
    cs = rotary.cos_sin_cache(d, 64, 10000.0, None)
    with jit_variants.record() as seen:
        for width in (1, 2):   # positions 8 and 16 bytes into the staged [4, width] block
            tok = torch.zeros(4, width, dtype=torch.long)
            tok[1], tok[2] = 17, 5
            kc, vc = torch.zeros(8, kv_heads, d), torch.zeros(8, kv_heads, d)
            triton_rotary.rotary_and_store_deferred(tok[1][:1], _deferred(n, 3, width, False),
                                                    heads, kv_heads, d, cs, kc, vc,
                                                    tok[2][:1])
    assert len(seen["triton_rotary._rotary_store_deferred_kernel"]) == 1



def test_which_one_row_gemvs_defer_at_qwen2_5_7b_shapes():
    """The shipped plans on a 132-SM GPU: q/k/v, o and down (split K) defer at one row;
    gate_up (not split), two rows, and the switch off do not."""
    from pagefleet.server.ops import triton_quant as tq
    cfg = tq.W4_CONFIG

    def d(m, n, k, **over):
        c = {**cfg, **over}
        return tq.defers(m, tq.mma_plan(m, n, k, 132, c), c)
    assert d(1, 4608, 3584) and d(1, 3584, 3584) and d(1, 3584, 18944)
    assert not d(1, 37888, 3584)
    assert not d(2, 3584, 3584) and not d(1, 3584, 3584, deferred_sum=False)
