"""The quantizer writes what AutoAWQ, GPTQModel, HF transformers and llm-compressor
write: packing words re-derived with transcriptions of those projects' own packing
loops and from hand-computed values; HF transformers' own fp8 quantizer and its
dequantizing loaders (fp8, compressed-tensors fp8 and W4A16) read our files as we do,
and compressed-tensors' own pack/unpack and pack-quantized compressor agree with ours
word for word."""

from __future__ import annotations

import json

import pytest

from pagefleet.server.ops.int4_packing import (AWQ_ORDER, ct_pack, ct_unpack, gptq_v1_qzeros,
                                               gptq_zeros_from_qzeros, pack_cols, pack_rows,
                                               unpack_cols, unpack_rows)
from pagefleet.server.testing import build_tiny_model
from pagefleet.server.testing_quant import (awq_quantize, ct_w4_config, ct_w4_quantize,
                                            gptq_quantize, hf_fp8_quantize,
                                            quantize_checkpoint)

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")


# -- packing, against the tools' loops ------------------------------------------------------

def autoawq_pack(intweight: np.ndarray) -> np.ndarray:
    """WQLinear_GEMM.from_linear's loop: word col, nibble i <- column col*8 + order[i]."""
    k, n = intweight.shape
    q = np.zeros((k, n // 8), dtype=np.uint32)
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    for col in range(n // 8):
        for i in range(8):
            q[:, col] |= intweight[:, col * 8 + order_map[i]].astype(np.uint32) << (i * 4)
    return q.view(np.int32)


def gptq_pack_qweight(intweight: np.ndarray) -> np.ndarray:
    """AutoGPTQ / GPTQModel: row r of the words holds input rows 8r .. 8r+7."""
    k, n = intweight.shape
    q = np.zeros((k // 8, n), dtype=np.uint32)
    i = row = 0
    while row < q.shape[0]:
        for j in range(i, i + 8):
            q[row] |= intweight[j].astype(np.uint32) << (4 * (j - i))
        i += 8
        row += 1
    return q.view(np.int32)


def gptqmodel_qzeros_v1(zeros: np.ndarray) -> np.ndarray:
    """GPTQModel's qzeros numpy loop (v2), then its v2 -> v1 word subtraction."""
    g, n = zeros.shape
    q = np.zeros((g, n // 8), dtype=np.uint32)
    for col in range(n // 8):
        for j in range(8):
            q[:, col] |= zeros[:, col * 8 + j].astype(np.uint32) << (4 * j)
    return (q - np.uint32(0x11111111)).view(np.int32)


def test_hand_computed_words():
    cols = torch.arange(8, dtype=torch.int32)[None]
    assert pack_cols(cols, AWQ_ORDER).item() == 0x75316420            # AWQ's nibble order
    assert pack_cols(cols).item() == 0x76543210
    assert pack_rows(cols.t()).item() == 0x76543210
    assert pack_cols(torch.full((1, 8), 15)).item() == -1             # 0xFFFFFFFF as int32
    assert gptq_v1_qzeros(torch.full((1, 8), 8)).item() == 0x77777777  # symmetric: 8 - 1


def test_compressed_tensors_int4_words_by_hand():
    """compressed-tensors' pack_to_int32 (4 bits): value v stored as v + 8, element 8j + i
    in bits 4i..4i+3 of word j (plain order, low nibble first), along the last dim for
    weight_packed and along the output dim (dim 0) for weight_zero_point; a partial
    last word is padded with zero nibbles (not with the offset 8)."""
    row = torch.arange(-8, 0, dtype=torch.int8)[None]                  # -8..-1 -> 0..7
    assert ct_pack(row).item() == 0x76543210
    assert ct_pack(row + 8).item() == 0xFEDCBA98 - (1 << 32)             # 8..15, as int32
    assert ct_pack(torch.tensor([[0, 0, 0, 0, 0, 0, 0, -8]], dtype=torch.int8)).item() == \
        0x08888888
    assert ct_pack(row.t(), dim=0).item() == 0x76543210                  # along dim 0
    assert ct_pack(torch.full((1, 3), 7, dtype=torch.int8)).item() == 0xFFF   # padded
    two = ct_pack(torch.tensor([[-8, 7], [1, -1]] * 4, dtype=torch.int8), dim=0)
    # column 0 is -8, 1, -8, 1, ... (nibbles 0, 9, ...); column 1 is 7, -1, ... (15, 7, ...)
    assert two.shape == (1, 2) and two.tolist() == [[0x90909090 - (1 << 32), 0x7F7F7F7F]]
    words = torch.tensor([[0x76543210, 0x0000000F]], dtype=torch.int32)
    assert ct_unpack(words, 9).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 15]]
    assert ct_unpack(words.t(), 9, dim=0).t().tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 15]]
    # the kernels' words (GPTQ qweight layout, K-major) are weight_packed transposed
    q = torch.randint(-8, 8, (16, 40), dtype=torch.int8)
    assert torch.equal(ct_pack(q).t(), pack_rows((q.to(torch.int32) + 8).t()))
    with pytest.raises(ValueError, match="-8..7"):
        ct_pack(torch.tensor([[8]]))


def test_compressed_tensors_own_packing_and_compressor_agree():
    """compressed-tensors' own pack_to_int32 / unpack_from_int32 and its pack-quantized
    compressor (compress: quantize + pack; decompress: unpack + dequantize) against ours,
    on odd sizes and every W4A16 variant."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import (pack_to_int32,
                                                                       unpack_from_int32)
    from compressed_tensors.quantization import QuantizationConfig

    v = torch.randint(-8, 8, (24, 43), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    for dim in (0, 1):
        theirs = pack_to_int32(v, 4, packed_dim=dim)
        assert torch.equal(theirs, ct_pack(v, dim))
        ours = ct_unpack(theirs, v.shape[dim], dim).to(torch.int16) - 8
        assert torch.equal(unpack_from_int32(theirs, 4, v.shape, packed_dim=dim), ours.to(torch.int8))
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(2)) * 0.05
    for gs, sym in ((128, True), (32, False), (-1, True), (-1, False)):
        t, deq = ct_w4_quantize(w, gs, sym, torch.bfloat16)
        scheme = QuantizationConfig.model_validate(ct_w4_config(gs, sym, False)).config_groups["group_0"]
        names = ["weight_packed", "weight_scale", "weight_shape"] + ([] if sym else ["weight_zero_point"])
        assert sorted(t) == sorted(names)
        assert sorted(PackedQuantizationCompressor.compression_param_names(scheme)) == sorted(names)
        assert t["weight_shape"].tolist() == [40, 256] and t["weight_shape"].dtype == torch.int64
        # their decompress (float32 scales: exact) gives the weight the file means
        out = PackedQuantizationCompressor.decompress(
            dict(t, weight_scale=t["weight_scale"].float()), scheme)
        assert torch.equal(out["weight"], deq)
        # their compress of that weight, with our scales and zero points, gives our words
        sd = {"weight": deq, "weight_scale": t["weight_scale"].float()}
        if not sym:
            sd["weight_zero_point"] = unpack_from_int32(
                t["weight_zero_point"], 4, (40, t["weight_scale"].shape[1]), packed_dim=0)
        c = PackedQuantizationCompressor.compress(sd, scheme)
        assert torch.equal(c["weight_packed"], t["weight_packed"])
        if not sym:
            assert torch.equal(c["weight_zero_point"], t["weight_zero_point"])
        groups = 1 if gs < 0 else 256 // gs
        assert t["weight_scale"].shape == (40, groups) and t["weight_scale"].dtype == torch.bfloat16
        assert t["weight_packed"].shape == (40, 32) and t["weight_packed"].dtype == torch.int32
        if not sym:
            assert t["weight_zero_point"].shape == (5, groups)
            assert t["weight_zero_point"].dtype == torch.int32
    with pytest.raises(ValueError, match="multiple of the group size"):
        ct_w4_quantize(torch.randn(8, 96), 64, True, torch.bfloat16)


def test_packing_matches_the_tools_loops():
    g = np.random.default_rng(0)
    w = g.integers(0, 16, size=(48, 40))
    assert np.array_equal(pack_cols(torch.from_numpy(w), AWQ_ORDER).numpy(), autoawq_pack(w))
    assert np.array_equal(pack_rows(torch.from_numpy(w)).numpy(), gptq_pack_qweight(w))
    z = g.integers(1, 16, size=(3, 40))
    assert np.array_equal(gptq_v1_qzeros(torch.from_numpy(z)).numpy(), gptqmodel_qzeros_v1(z))
    t = torch.from_numpy(w)
    assert torch.equal(unpack_cols(pack_cols(t, AWQ_ORDER), AWQ_ORDER).long(), t)
    assert torch.equal(unpack_rows(pack_rows(t)).long(), t)
    assert torch.equal(gptq_zeros_from_qzeros(gptq_v1_qzeros(torch.from_numpy(z)), True).long(),
                       torch.from_numpy(z))
    with pytest.raises(ValueError, match="zero point of 0"):
        gptq_v1_qzeros(torch.zeros(1, 8, dtype=torch.int32))


def test_awq_and_gptq_tensors_as_the_tools_store_them():
    w = torch.randn(40, 64) * 0.05
    t, deq = awq_quantize(w, 32)
    assert (t["qweight"].shape, t["qweight"].dtype) == ((64, 5), torch.int32)
    assert (t["qzeros"].shape, t["scales"].shape, t["scales"].dtype) == ((2, 5), (2, 40), torch.float16)
    # AutoAWQ's packing: intweight = round((W + zeros * scales) / scales), words by its loop.
    z = unpack_cols(t["qzeros"], AWQ_ORDER).float()
    s = t["scales"].float()
    gi = torch.arange(64) // 32
    intweight = torch.round((deq.t() + (z * s)[gi]) / s[gi]).to(torch.int64)
    assert np.array_equal(t["qweight"].numpy(), autoawq_pack(intweight.numpy()))
    assert (deq - w).abs().max() <= s.max() / 2 + 1e-6

    perm = torch.randperm(64)
    t, deq = gptq_quantize(w, 32, sym=False, perm=perm)
    assert t["qweight"].shape == (8, 40) and t["qzeros"].shape == (2, 5)
    assert t["g_idx"].dtype == torch.int32 and t["scales"].dtype == torch.float16
    inv = torch.argsort(perm)
    assert torch.equal(t["g_idx"].long(), inv // 32)     # AutoGPTQ: g_idx[invperm]
    z = gptq_zeros_from_qzeros(t["qzeros"], v1=True).float()
    s = t["scales"].float()
    gi = t["g_idx"].long()
    intweight = torch.round((deq.t() + (z * s)[gi]) / s[gi]).to(torch.int64)
    assert np.array_equal(t["qweight"].numpy(), gptq_pack_qweight(intweight.numpy()))
    t, _ = gptq_quantize(w, -1, sym=True, perm=None)
    assert t["scales"].shape == (1, 40) and bool((t["g_idx"] == 0).all())
    assert bool((unpack_cols(t["qzeros"]) == 7).all())   # sym: 8 stored as 7 (v1)


def test_fp8_blocks_are_bitwise_hf_transformers():
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    class Q:   # the quantizer object HF's op reads its config from
        class quantization_config:
            weight_block_size = (16, 32)
            scale_fmt = "float"

    w = torch.randn(48, 64, dtype=torch.bfloat16)
    hf = Fp8Quantize(Q())._quantize_one("x.weight", w)
    ours, _ = hf_fp8_quantize(w.float(), (16, 32))
    assert torch.equal(hf["x.weight"].view(torch.uint8), ours["weight"].view(torch.uint8))
    assert torch.equal(hf["x.weight_scale_inv"], ours["weight_scale_inv"])
    assert hf_fp8_quantize(w.float(), (32, 32)) is None    # 48 rows do not tile: kept as is


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("fmt")
    src = build_tiny_model(root / "src", "qwen2", hidden_size=64, num_layers=1, num_heads=2,
                           num_kv_heads=1, vocab_size=300)

    def make(fmt, **kw):
        name = f"{fmt}-" + "-".join(f"{k}={v}" for k, v in sorted(kw.items()))
        return (quantize_checkpoint(src, root / name, fmt, dequantized_dir=root / f"ref-{name}",
                                    **kw),
                root / f"ref-{name}")
    return make


def _config(path):
    return json.loads((path / "config.json").read_text())


def test_awq_file(written):
    from safetensors import safe_open
    q, _ = written("awq", group_size=32)
    cfg = _config(q)
    assert cfg["quantization_config"] == {"quant_method": "awq", "zero_point": True,
                                          "group_size": 32, "bits": 4, "version": "gemm",
                                          "modules_to_not_convert": None}
    assert cfg["torch_dtype"] == "float16"
    with safe_open(str(q / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        p = "model.layers.0.self_attn.q_proj."
        assert {p + s for s in ("qweight", "qzeros", "scales", "bias")} <= names
        assert p + "weight" not in names and "lm_head.weight" in names
        assert f.get_slice(p + "qweight").get_dtype() == "I32"
        assert f.get_slice("lm_head.weight").get_dtype() == "F16"


def test_gptq_file(written):
    q, _ = written("gptq", group_size=32, desc_act=True, sym=False)
    qc = _config(q)["quantization_config"]
    for key, value in {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                       "sym": False, "checkpoint_format": "gptq", "lm_head": False,
                       "pack_dtype": "int32"}.items():
        assert qc[key] == value
    assert json.loads((q / "quantize_config.json").read_text()) == qc


def test_legacy_files_are_autogptq_04s_and_autoawq_01s(written):
    """Before quant_method and config.json's quantization_config: AutoGPTQ 0.4's
    `save_quantized` (BaseQuantizeConfig.to_dict() keys, one `gptq_model-4bit-{G}g`
    safetensors with its metadata) and AutoAWQ 0.1's (`json.dumps(self.quant_config)`)."""
    from safetensors import safe_open
    q, _ = written("gptq", group_size=32, desc_act=True, legacy=True)
    assert "quantization_config" not in _config(q)
    side = json.loads((q / "quantize_config.json").read_text())
    assert side == {"bits": 4, "group_size": 32, "damp_percent": 0.01, "desc_act": True,
                    "static_groups": False, "sym": True, "true_sequential": True,
                    "model_name_or_path": None, "model_file_base_name": None}
    assert [p.name for p in q.glob("*.safetensors")] == ["gptq_model-4bit-32g.safetensors"]
    with safe_open(str(q / "gptq_model-4bit-32g.safetensors"), "pt") as f:
        meta = f.metadata()
        assert "model.layers.0.self_attn.q_proj.g_idx" in set(f.keys())
    assert meta["gptq_group_size"] == "32" and meta["gptq_desc_act"] == "True"
    q, _ = written("awq", group_size=32, legacy=True)
    assert "quantization_config" not in _config(q)
    assert json.loads((q / "quant_config.json").read_text()) == {
        "zero_point": True, "q_group_size": 32, "w_bit": 4, "version": "GEMM"}
    assert not (q / "quantize_config.json").exists()


def test_hf_transformers_dequantizes_our_fp8_file_to_the_reference(written):
    from transformers import AutoModelForCausalLM
    q, ref = written("fp8", block=(32, 32))
    qc = _config(q)["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [32, 32]
    a = AutoModelForCausalLM.from_pretrained(str(q), dtype=torch.float32).state_dict()
    b = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k].float(), b[k]) for k in b)


def test_compressed_tensors_reads_our_file_as_fp8_dynamic(written):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    q, ref = written("compressed-tensors", strategy="channel")
    qc = _config(q)["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)
    scheme = parsed.config_groups["group_0"]
    preset = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    for part in ("weights", "input_activations"):
        got, want = getattr(scheme, part), getattr(preset, part)
        for field in ("num_bits", "type", "strategy", "symmetric", "dynamic"):
            assert getattr(got, field) == getattr(want, field), (part, field)
    assert ct.__version__ and parsed.format == "float-quantized"
    a = AutoModelForCausalLM.from_pretrained(
        str(q), dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(dequantize=True)).state_dict()
    b = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32).state_dict()
    assert all(torch.equal(a[k].float(), b[k]) for k in b)


@pytest.mark.parametrize("gs,sym", [(32, True), (-1, False)])
def test_compressed_tensors_w4a16_file(written, gs, sym):
    """Our W4A16 file as llm-compressor writes it: its quantization_config is the W4A16
    (W4A16_ASYM) preset's as compressed-tensors parses it, the tensors are the
    pack-quantized compressor's, and HF transformers' compressed-tensors loader
    decompresses them to our dequantized reference."""
    pytest.importorskip("compressed_tensors")
    from safetensors import safe_open
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    q, ref = written("compressed-tensors", scheme="w4a16", group_size=gs, sym=sym)
    qc = _config(q)["quantization_config"]
    assert (qc["quant_method"], qc["format"], qc["quantization_status"], qc["ignore"]) == \
        ("compressed-tensors", "pack-quantized", "compressed", ["lm_head"])
    parsed = QuantizationConfig.model_validate(qc)
    got = parsed.config_groups["group_0"].weights
    want = preset_name_to_scheme("W4A16" if sym else "W4A16_ASYM", ["Linear"]).weights
    for field in ("num_bits", "type", "symmetric", "dynamic", "actorder"):
        assert getattr(got, field) == getattr(want, field), field
    assert (got.strategy, got.group_size) == (("group", gs) if gs > 0 else ("channel", None))
    assert parsed.config_groups["group_0"].input_activations is None
    with safe_open(str(q / "model.safetensors"), "pt") as f:
        p = "model.layers.0.mlp.down_proj."
        names = {n for n in f.keys() if n.startswith(p)}
        assert names == {p + n for n in ("weight_packed", "weight_scale", "weight_shape")
                         + (() if sym else ("weight_zero_point",))}
        assert f.get_slice(p + "weight_packed").get_dtype() == "I32"
        assert f.get_slice(p + "weight_shape").get_dtype() == "I64"
        assert f.get_slice("lm_head.weight").get_dtype() == "F32"
    a = AutoModelForCausalLM.from_pretrained(
        str(q), dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(dequantize=True)).state_dict()
    b = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k].float(), b[k]) for k in b)
