"""Issue 15, must-hold 1 (CPU): for every format, the engine's logits on a tiny model
equal the dequantized model's (float32 HF reference) within a tight tolerance, and
greedy output equals HF transformers' on the dequantized weights, token for token.

The quantized checkpoints come from `pagefleet.server.testing_quant` (the tools' file
formats); the dequantized twin of each is the model the file means. Hidden 128,
intermediate 288: GPTQ's group of 128 does not divide 288 (a short last group), AWQ
uses groups of 32 (AutoAWQ needs K % G == 0) and whole-row groups. compressed-tensors
W4A16 needs K % G == 0 too: its group-128 cases use intermediate 256 (`arch/i256`), and
its groups of 32 split down_proj's 288 rows into 9.
"""

from __future__ import annotations

import pytest

from pagefleet.server import LLM, SamplingParams
from pagefleet.server.testing import build_tiny_model
from pagefleet.server.testing_quant import quantize_checkpoint
from tests.server.helpers import assert_diverse, hf_greedy, random_prompts
from tests.server.quant_helpers import (decoder_logits, fp8_row_reference, hf_logits,
                                        load_decoder, rel_err)

torch = pytest.importorskip("torch")

TINY = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
CASES = {
    # name: (arch, quantizer kwargs, --quantization flag or None)
    "fp8-at-load": ("qwen2", None, "fp8"),
    "fp8-hf-block": ("qwen2", dict(fmt="fp8", block=(32, 32)), None),
    "fp8-hf-tensor": ("qwen3", dict(fmt="fp8", block=None), None),
    "ct-fp8-channel": ("qwen2", dict(fmt="compressed-tensors", strategy="channel"), None),
    "ct-fp8-tensor": ("qwen3", dict(fmt="compressed-tensors", strategy="tensor"), "fp8"),
    "ct-fp8-block": ("qwen2", dict(fmt="compressed-tensors", strategy="block", block=(64, 64)), None),
    "awq-g32": ("qwen2", dict(fmt="awq", group_size=32), None),
    "awq-row": ("qwen3", dict(fmt="awq", group_size=-1), "awq_marlin"),
    "gptq-sym-g128": ("qwen2", dict(fmt="gptq", group_size=128), None),
    "gptq-asym-g128": ("qwen2", dict(fmt="gptq", group_size=128, sym=False), "gptq"),
    # many small shards: a layer's g_idx can come in a later file than its qweight
    "gptq-actorder-sym": ("qwen2", dict(fmt="gptq", group_size=32, desc_act=True,
                                        shard_bytes=12 << 10), None),
    "gptq-actorder-asym": ("qwen3", dict(fmt="gptq", group_size=128, desc_act=True, sym=False), None),
    "gptq-row-v2": ("qwen2", dict(fmt="gptq", group_size=-1, sym=False,
                                  checkpoint_format="gptq_v2"), "gptq_marlin"),
    # the config only in the older tools' side file (AutoAWQ 0.1, AutoGPTQ 0.4), no quant_method
    "awq-legacy": ("qwen2", dict(fmt="awq", group_size=32, legacy=True), None),
    "gptq-legacy-actorder": ("qwen3", dict(fmt="gptq", group_size=32, desc_act=True,
                                           legacy=True), "gptq"),
    # llm-compressor W4A16 (pack-quantized): W4A16 / W4A16_ASYM presets, channel strategy
    "ct-w4a16-g128": ("qwen2/i256", dict(fmt="compressed-tensors", scheme="w4a16"), None),
    "ct-w4a16-asym-g128": ("qwen3/i256", dict(fmt="compressed-tensors", scheme="w4a16",
                                              sym=False), "compressed-tensors"),
    "ct-w4a16-channel": ("qwen2", dict(fmt="compressed-tensors", scheme="w4a16",
                                       group_size=-1), None),
    "ct-w4a16-asym-channel": ("qwen3", dict(fmt="compressed-tensors", scheme="w4a16",
                                            group_size=-1, sym=False), None),
    # layer 1's gate/up in `ignore` (stored bf16), many small shards
    "ct-w4a16-asym-g32-ignore": ("qwen2", dict(
        fmt="compressed-tensors", scheme="w4a16", group_size=32, sym=False,
        ignore=["lm_head", r"re:.*layers\.1\.mlp\.(gate|up)_proj$"], shard_bytes=12 << 10), None),
    # older llm-compressor's actorder: group (weight_g_idx)
    "ct-w4a16-actorder": ("qwen2", dict(fmt="compressed-tensors", scheme="w4a16", group_size=32,
                                        desc_act=True), None),
}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """name -> (quantized dir, dequantized reference dir, flag); built once each."""
    root = tmp_path_factory.mktemp("quant")
    srcs: dict = {}
    built: dict = {}

    def get(name: str):
        if name not in built:
            arch, kw, flag = CASES[name]
            if arch not in srcs:
                base, _, inter = arch.partition("/i")
                srcs[arch] = build_tiny_model(root / f"src-{base}-{inter}", base, seed=3,
                                              intermediate_size=int(inter) if inter else None,
                                              **TINY)
            src = srcs[arch]
            if kw is None:       # quantized at load: the checkpoint is the bf16 one
                built[name] = (src, fp8_row_reference(src, root / f"ref-{name}"), flag)
            else:
                kw = dict(kw)
                fmt = kw.pop("fmt")
                ref = root / f"ref-{name}"
                q = quantize_checkpoint(src, root / f"q-{name}", fmt, dequantized_dir=ref, **kw)
                built[name] = (q, ref, flag)
        return built[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_dequantized_model(quantized, name):
    qdir, ref, flag = quantized(name)
    ids = random_prompts(11, [45], 500)[0]
    model = load_decoder(qdir, quantization=flag)
    assert model.quant is not None and model.quant_info.linear_bytes < model.quant_info.dense_bytes
    ours = decoder_logits(model, ids)
    theirs = hf_logits(ref, ids)
    assert rel_err(ours, theirs) < 1e-5
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


GREEDY = ["fp8-at-load", "fp8-hf-block", "ct-fp8-channel", "awq-g32", "awq-row",
          "gptq-sym-g128", "gptq-actorder-asym", "gptq-row-v2", "awq-legacy",
          "gptq-legacy-actorder", "ct-w4a16-g128", "ct-w4a16-asym-g128", "ct-w4a16-channel",
          "ct-w4a16-asym-channel", "ct-w4a16-actorder"]


@pytest.mark.parametrize("name", GREEDY)
def test_greedy_equals_hf_on_dequantized_weights(quantized, name):
    qdir, ref, flag = quantized(name)
    prompts = random_prompts(5, [3, 20, 41], 500)
    max_new = [24, 17, 24]
    want = hf_greedy(ref, prompts, max_new)
    assert_diverse(want)
    llm = LLM(qdir, max_model_len=256, max_num_seqs=4, quantization=flag)
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                                  for n in max_new])
    assert [o.outputs[0].token_ids for o in outs] == want
    llm.engine.kv.check_whole()


def test_w8a8_path_tracks_the_dequantized_model(quantized):
    """The GPU's large-batch fp8 path (activations quantized per token) through its
    torch twin: the same model within the activation rounding (e4m3, ~3% a value)."""
    from pagefleet.server.models.decoder import Ops
    from pagefleet.server.ops import quant

    class W8A8(Ops):
        fp8_linear = staticmethod(quant.fp8_w8a8_linear)

    qdir, ref, _ = quantized("ct-fp8-channel")
    ids = random_prompts(12, [40], 500)[0]
    ours = decoder_logits(load_decoder(qdir, W8A8), ids)
    exact = decoder_logits(load_decoder(qdir), ids)
    theirs = hf_logits(ref, ids)
    err = rel_err(ours, theirs)
    assert 1e-3 < err < 0.25    # really quantized, and close (a chaotic random model)
    assert rel_err(exact, theirs) < 1e-5
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    assert agree >= 0.7


def test_startup_log_reports_the_quantized_size(quantized, caplog):
    """The size the quantized weights take; the KV room they free only where the KV
    cache is sized from free GPU memory (not on the CPU's fixed budget, nor with
    --kv-cache-memory or --num-gpu-blocks-override, where the cache is the same size
    whatever the weights save)."""
    from types import SimpleNamespace

    from pagefleet.server.config import EngineConfig
    from pagefleet.server.engine.runner import ModelRunner

    qdir, _, flag = quantized("awq-g32")
    with caplog.at_level("INFO", logger="pagefleet.engine"):
        llm = LLM(qdir, max_model_len=128, max_num_seqs=2, quantization=flag)
    line = next(r.getMessage() for r in caplog.records if "Quantized weights" in r.getMessage())
    assert "AWQ 4-bit checkpoint" in line and "GiB instead of" in line
    assert "KV cache" not in line and "tokens" not in line     # the CPU: a fixed budget
    info = llm.engine.runner.model.quant_info
    gpu_line = info.log_line(1024, True)
    assert gpu_line.startswith(line) and "more for the KV cache (~" in gpu_line

    def sized_from_free_memory(device: str, **flags) -> bool:
        runner = SimpleNamespace(config=EngineConfig(model="m", **flags),
                                 device=torch.device(device))
        return ModelRunner._kv_from_free_memory(runner)

    assert sized_from_free_memory("cuda")
    assert not sized_from_free_memory("cuda", kv_cache_memory=1 << 30)
    assert not sized_from_free_memory("cuda", num_kv_blocks=100)
    assert not sized_from_free_memory("cpu")


def test_compressed_tensors_ignore_keeps_those_layers_dense(quantized):
    """`ignore` names modules llm-compressor left in the model's dtype: they load
    unquantized, the rest through the 4-bit kernels."""
    qdir, _, flag = quantized("ct-w4a16-asym-g32-ignore")
    model = load_decoder(qdir, quantization=flag)
    assert model.layers[1].mlp.gate_up_proj.method.name == "unquantized"
    assert model.layers[0].mlp.gate_up_proj.method.name == "compressed-tensors w4a16"
    assert model.layers[1].mlp.down_proj.method.name == "compressed-tensors w4a16"
    assert "asymmetric (zero points)" in model.quant.describe()
