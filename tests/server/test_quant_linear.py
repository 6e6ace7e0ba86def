"""The linear-layer design the tensor-parallel work builds on: every method's
parameters load per shard (q/k/v, gate/up) and per rank, so that the ranks' partitions
put together are exactly the unpartitioned layer; loading errors are clear."""

from __future__ import annotations

import pytest

from pagefleet.server.config import ConfigError
from pagefleet.server.models.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                            RowParallelLinear, UnquantizedLinearMethod,
                                            WeightLoadError)
from pagefleet.server.models.quantization.awq import AWQLinearMethod
from pagefleet.server.models.quantization.base import QuantConfig
from pagefleet.server.models.quantization.compressed_tensors import CompressedTensorsW4A16Method
from pagefleet.server.models.quantization.fp8 import Fp8LinearMethod, Fp8OnlineMethod
from pagefleet.server.models.quantization.gptq import GPTQLinearMethod
from pagefleet.server.ops import quant
from pagefleet.server.testing_quant import (act_order, awq_quantize, ct_w4_quantize,
                                            gptq_quantize, hf_fp8_quantize)
from tests.server.quant_helpers import dense_weight, rel_err

torch = pytest.importorskip("torch")

ALIASES = {"weight_scale_inv": "weight_scale"}
METHODS = {
    "bf16": (lambda: UnquantizedLinearMethod(), lambda w, perm: {"weight": w}),
    "awq": (lambda: AWQLinearMethod(32, torch.float16),
            lambda w, perm: awq_quantize(w, 32)[0]),
    "gptq": (lambda: GPTQLinearMethod(32, False, True, torch.float16),
             lambda w, perm: gptq_quantize(w, 32, False, None)[0]),
    "gptq-actorder": (lambda: GPTQLinearMethod(32, True, True, torch.float16),
                      lambda w, perm: gptq_quantize(w, 32, True, perm)[0]),
    "fp8-block": (lambda: Fp8LinearMethod("block", (16, 32), aliases=ALIASES),
                  lambda w, perm: hf_fp8_quantize(w, (16, 32))[0]),
    "fp8-at-load": (lambda: Fp8OnlineMethod(), lambda w, perm: {"weight": w}),
    "ct-w4a16-asym": (lambda: CompressedTensorsW4A16Method(32, False, False, torch.float16, False),
                      lambda w, perm: ct_w4_quantize(w, 32, False, torch.float16)[0]),
    "ct-w4a16-channel": (lambda: CompressedTensorsW4A16Method(-1, True, False, torch.bfloat16,
                                                              False),
                         lambda w, perm: ct_w4_quantize(w, -1, True, torch.bfloat16)[0]),
    "ct-w4a16-sym": (lambda: CompressedTensorsW4A16Method(16, True, False, torch.bfloat16, False),
                     lambda w, perm: ct_w4_quantize(w, 16, True, torch.bfloat16)[0]),
    "ct-w4a16-asym-channel": (lambda: CompressedTensorsW4A16Method(-1, False, False,
                                                                   torch.float32, False),
                              lambda w, perm: ct_w4_quantize(w, -1, False, torch.float32)[0]),
    "ct-w4a16-actorder": (lambda: CompressedTensorsW4A16Method(32, False, True, torch.float16,
                                                               True),
                          lambda w, perm: ct_w4_quantize(w, 32, False, torch.float16, perm)[0]),
}


def layers(kind: str, method, tp_size: int):
    out = []
    for rank in range(tp_size):
        kw = dict(method=method(), tp_rank=rank, tp_size=tp_size, params_dtype=torch.float32)
        if kind == "qkv":
            out.append(QKVParallelLinear(64, 16, 4, 2, bias=True, **kw))
        elif kind == "qkv-kv1":
            out.append(QKVParallelLinear(64, 16, 4, 1, bias=False, **kw))
        elif kind == "merged":
            out.append(MergedColumnParallelLinear(64, [96, 96], bias=False, **kw))
        else:
            out.append(RowParallelLinear(128, 64, bias=False, **kw))
    return out


def checkpoint(kind: str, make, seed: int):
    """shard id -> {tensor name: tensor}, as a checkpoint stores each projection."""
    g = torch.Generator().manual_seed(seed)
    sizes = {"qkv": {"q": 64, "k": 32, "v": 32}, "qkv-kv1": {"q": 64, "k": 16, "v": 16},
             "merged": {0: 96, 1: 96}, "row": {None: 64}}[kind]
    k = 128 if kind == "row" else 64
    perm = act_order(k, seed, "cpu")
    ckpt = {}
    for sid, n in sizes.items():
        tensors = make(torch.randn(n, k, generator=g) * 0.1, perm)
        if kind == "qkv":
            tensors["bias"] = torch.randn(n, generator=g)
        ckpt[sid] = tensors
    return ckpt


def load(layer, ckpt) -> None:
    for sid, tensors in ckpt.items():
        for name, t in tensors.items():
            layer.load_weight(name, t, sid)
    assert not layer.missing()
    layer.finish_loading()


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("kind", ["qkv", "qkv-kv1", "merged", "row"])
def test_partitions_put_together_are_the_whole_layer(method, kind):
    make_method, make = METHODS[method]
    if method in ("gptq-actorder", "ct-w4a16-actorder") and kind == "row":
        # Row-parallel act-order keeps every group on every rank (any row may use any
        # group); sorting a rank's rows by group needs the TP runner's own layout: until
        # then such a partition is refused clearly.
        ckpt = checkpoint(kind, make, seed=1)
        layer = layers(kind, make_method, 2)[1]
        with pytest.raises(WeightLoadError, match="g_idx: groups are not all of size"):
            load(layer, ckpt)
        return
    ckpt = checkpoint(kind, make, seed=len(kind) + len(method))
    (full,) = layers(kind, make_method, 1)
    load(full, ckpt)
    w_full = dense_weight(full)
    x = torch.randn(3, full.input_size)
    ref = full(x.clone()) if full.method.name == "unquantized" else None
    parts = layers(kind, make_method, 2)
    outs = []
    for r, layer in enumerate(parts):
        load(layer, ckpt)
        w = dense_weight(layer)
        if kind == "row":
            kp = layer.input_size_per_partition
            expect = w_full[:, r * kp:(r + 1) * kp]
            outs.append(x[:, r * kp:(r + 1) * kp] @ w.t())
        else:
            rows = []
            for sid in full.shard_ids:
                fs, ps = full.shard_spec(sid), layer.shard_spec(sid)
                shard = w_full[fs.out_offset:fs.out_offset + fs.out_size]
                rows.append(shard[ps.out_start:ps.out_start + ps.out_size])
            expect = torch.cat(rows)
        if method == "fp8-at-load" and kind == "row":
            assert rel_err(w, expect) < 0.05   # each rank scales its own rows' half
        else:
            assert torch.equal(w, expect)
    if kind == "row" and ref is not None:
        assert torch.allclose(sum(outs), ref, atol=1e-5)   # the all-reduce the TP runner adds
    if kind == "qkv-kv1":   # one KV head, two ranks: both hold it
        k0, k1 = (dense_weight(p)[64 // 2:64 // 2 + 16] for p in parts)
        assert torch.equal(k0, k1)


def test_forward_uses_the_ops_bundle():
    (layer,) = layers("merged", METHODS["awq"][0], 1)
    load(layer, checkpoint("merged", METHODS["awq"][1], 1))
    calls = []

    class Spy:
        @staticmethod
        def w4a16_linear(*a):
            calls.append(a)
            return quant.w4a16_linear(*a)

    layer.ops = Spy
    x = torch.randn(2, 64)
    assert torch.allclose(layer(x), x @ dense_weight(layer).t(), atol=1e-5) and calls


def test_loading_errors_are_clear():
    make_method, make = METHODS["awq"]
    (layer,) = layers("merged", make_method, 1)
    ckpt = checkpoint("merged", make, 2)
    with pytest.raises(WeightLoadError, match="does not match the layer"):
        layer.load_weight("qweight", ckpt[0]["qweight"][:, :4], 0)
    with pytest.raises(WeightLoadError, match="unexpected tensor 'weight'"):
        layer.load_weight("weight", torch.zeros(96, 64), 0)
    layer.load_weight("qweight", ckpt[0]["qweight"], 0)
    with pytest.raises(WeightLoadError, match="appears twice"):
        layer.load_weight("qweight", ckpt[0]["qweight"], 0)
    assert "qweight[1]" in layer.missing() and "scales[0]" in layer.missing()
    with pytest.raises(WeightLoadError, match="unknown shard"):
        layer.load_weight("scales", ckpt[0]["scales"], "q")


def test_act_order_parts_must_share_one_order():
    make_method, make = METHODS["gptq-actorder"]
    (layer,) = layers("merged", make_method, 1)
    a = make(torch.randn(96, 64) * 0.1, act_order(64, 1, "cpu"))
    b = make(torch.randn(96, 64) * 0.1, act_order(64, 2, "cpu"))
    layer.load_weight("g_idx", a["g_idx"], 0)
    with pytest.raises(WeightLoadError, match="different act-order g_idx"):
        layer.load_weight("g_idx", b["g_idx"], 1)


def test_fused_parts_must_agree_on_quantization():
    class Half(QuantConfig):
        name = "test"

        def is_quantized(self, p):
            return p.endswith("q_proj")

    with pytest.raises(ConfigError, match="disagree"):
        Half().linear_method(["x.q_proj", "x.k_proj", "x.v_proj"])


@pytest.mark.parametrize("block", [(48, 48), (32, 48)])
def test_fp8_blocks_split_mid_block_by_tensor_parallel_are_refused(block):
    """A row-parallel layer whose input partition (here 128 / 2 = 64) does not start on a
    weight block (48) would give rank 1 the scales of the wrong blocks: with the output
    not whole blocks (64 rows in blocks of 48) they were taken silently (16 columns off by
    a block), else the load failed on 'rows 64..128 do not fall on units of 48'. Refused
    when the layer is built, naming the flag, as vLLM does. Whole-block partitions load
    (test_partitions_put_together_are_the_whole_layer)."""
    from pagefleet.server.testing_quant import ct_fp8_quantize

    tensors, deq = ct_fp8_quantize(torch.randn(64, 128) * 0.1, "block", block, torch.float32)
    (full,) = layers("row", lambda: Fp8LinearMethod("block", block), 1)
    load(full, {None: tensors})
    assert torch.equal(dense_weight(full), deq)
    with pytest.raises(ConfigError, match=r"input partition 64 .*--tensor-parallel-size 2.* "
                                          rf"block of {block[1]}"):
        layers("row", lambda: Fp8LinearMethod("block", block), 2)


def test_grouped_int4_split_mid_group_names_tensor_parallelism():
    """The same for AWQ groups: the message says the partition, not 'input size'."""
    with pytest.raises(ConfigError, match=r"input partition 64 .*--tensor-parallel-size 2"):
        RowParallelLinear(128, 64, bias=False, method=AWQLinearMethod(48, torch.float16),
                          tp_rank=0, tp_size=2, params_dtype=torch.float32)


@pytest.mark.parametrize("method", [
    lambda: CompressedTensorsW4A16Method(-1, True, False, torch.bfloat16, False),
    lambda: GPTQLinearMethod(-1, False, True, torch.float16)])
def test_int4_words_split_by_tensor_parallel_name_the_partition(method):
    """A K or N that is a multiple of 8 loads on one device; split over ranks into
    slices that are not (200 / 2 = 100 rows, 40 / 2 = 20 columns) the message says the
    partition and the flag, not 'input size 100', a size the checkpoint does not have."""
    RowParallelLinear(200, 64, bias=False, method=method(), params_dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"input partition 100 \(of 200, "
                                          r"--tensor-parallel-size 2\).*multiple of 8"):
        RowParallelLinear(200, 64, bias=False, method=method(), tp_rank=0, tp_size=2,
                          params_dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"output partition sizes \[20\] \(of \[40\], "
                                          r"--tensor-parallel-size 2\).*multiples of 8"):
        MergedColumnParallelLinear(64, [40], bias=False, method=method(), tp_rank=0,
                                   tp_size=2, params_dtype=torch.float32)
