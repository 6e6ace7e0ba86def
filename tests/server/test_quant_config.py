"""Issue 15, must-hold 2: a `--quantization` that does not fit the checkpoint is a
startup error naming the checkpoint's real format; the flag's aliases and detection."""

from __future__ import annotations

import json

import pytest

from pagefleet.server import LLM
from pagefleet.server.config import ConfigError, EngineConfig
from pagefleet.server.testing import build_tiny_model
from pagefleet.server.testing_quant import quantize_checkpoint

torch = pytest.importorskip("torch")

TINY = dict(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=300)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("qcfg")
    src = build_tiny_model(root / "src", "qwen2", **TINY)
    out = {"bf16": src}
    for fmt, kw in (("awq", dict(group_size=32)), ("gptq", dict(group_size=32)),
                    ("fp8", dict(block=(32, 32))), ("compressed-tensors", {})):
        out[fmt] = quantize_checkpoint(src, root / fmt, fmt, **kw)
    # AutoAWQ 0.1 / AutoGPTQ 0.4: the config only in quant_config.json / quantize_config.json
    out["awq-legacy"] = quantize_checkpoint(src, root / "awq-legacy", "awq", group_size=32,
                                            legacy=True)
    out["gptq-legacy"] = quantize_checkpoint(src, root / "gptq-legacy", "gptq", group_size=32,
                                             desc_act=True, legacy=True)
    out["gptq-actorder"] = quantize_checkpoint(src, root / "gptq-actorder", "gptq",
                                               group_size=32, desc_act=True)
    # llm-compressor W4A16_ASYM (pack-quantized), and older llm-compressor's actorder group
    out["ct-w4a16"] = quantize_checkpoint(src, root / "ct-w4a16", "compressed-tensors",
                                          scheme="w4a16", group_size=32, sym=False)
    out["ct-w4a16-actorder"] = quantize_checkpoint(src, root / "ct-w4a16-actorder",
                                                   "compressed-tensors", scheme="w4a16",
                                                   group_size=32, desc_act=True)
    return out


def start(path, flag):
    return LLM(path, max_model_len=64, max_num_seqs=2, quantization=flag)


@pytest.mark.parametrize("ckpt,flag,names", [
    ("bf16", "awq", ["not quantized", "float32", "fp8"]),
    ("bf16", "gptq_marlin", ["not quantized", "GPTQ"]),
    ("awq", "gptq", ["AWQ 4-bit checkpoint", "group size 32", "--quantization awq"]),
    ("awq", "fp8", ["AWQ 4-bit checkpoint"]),
    ("gptq", "awq", ["GPTQ 4-bit checkpoint", "desc_act false", "--quantization gptq"]),
    ("gptq", "awq_marlin", ["GPTQ 4-bit checkpoint"]),
    ("fp8", "awq", ["FP8 checkpoint", "32x32 weight blocks"]),
    ("compressed-tensors", "gptq", ["compressed-tensors FP8 checkpoint", "per-channel"]),
    # vLLM's name for llm-compressor checkpoints fits those only
    ("bf16", "compressed-tensors", ["not quantized", "llm-compressor"]),
    ("awq", "compressed-tensors", ["AWQ 4-bit checkpoint", "--quantization awq"]),
    ("fp8", "compressed-tensors", ["FP8 checkpoint (quant_method fp8"]),
    # old side files: the method read from their keys, the flag still checked
    ("awq-legacy", "gptq", ["AWQ 4-bit checkpoint (quant_config.json without quant_method",
                            "group size 32", "--quantization awq"]),
    ("gptq-legacy", "awq_marlin", ["GPTQ 4-bit checkpoint (quantize_config.json without "
                                   "quant_method", "desc_act true", "v1 zero points"]),
    ("gptq-legacy", "fp8", ["GPTQ 4-bit checkpoint"]),
    # llm-compressor W4A16: only compressed-tensors (or no flag) fits
    ("ct-w4a16", "awq", ["a compressed-tensors W4A16 checkpoint (pack-quantized, 4-bit int "
                         "weights, group size 32, asymmetric (zero points))",
                         "--quantization compressed-tensors"]),
    ("ct-w4a16", "gptq", ["compressed-tensors W4A16 checkpoint"]),
    ("ct-w4a16", "gptq_marlin", ["compressed-tensors W4A16 checkpoint"]),
    ("ct-w4a16", "awq_marlin", ["compressed-tensors W4A16 checkpoint"]),
    ("ct-w4a16", "fp8", ["compressed-tensors W4A16 checkpoint"]),
    ("ct-w4a16-actorder", "gptq", ["symmetric, act-order weight_g_idx"]),
])
def test_mismatched_flag_is_a_startup_error_naming_the_format(ckpts, ckpt, flag, names):
    with pytest.raises(ConfigError) as e:
        start(ckpts[ckpt], flag)
    msg = str(e.value)
    assert f"--quantization {flag} does not match" in msg
    for n in names:
        assert n in msg, msg


@pytest.mark.parametrize("ckpt,flag", [("awq", "awq_marlin"), ("awq", None), ("gptq", "gptq_marlin"),
                                       ("gptq", "gptq"), ("fp8", "fp8"), ("fp8", None),
                                       ("compressed-tensors", "fp8"), ("bf16", "fp8"),
                                       ("compressed-tensors", "compressed-tensors"),
                                       ("awq-legacy", None), ("awq-legacy", "awq"),
                                       ("awq-legacy", "awq_marlin"), ("gptq-legacy", None),
                                       ("gptq-legacy", "gptq"), ("gptq-legacy", "gptq_marlin"),
                                       ("ct-w4a16", None), ("ct-w4a16", "compressed-tensors"),
                                       ("ct-w4a16-actorder", None)])
def test_matching_flags_and_detection_load(ckpts, ckpt, flag):
    llm = start(ckpts[ckpt], flag)
    model = llm.engine.runner.model
    assert model.quant is not None
    assert model.layers[0].self_attn.qkv_proj.method.name != "unquantized"


def test_unquantized_without_flag_has_no_quant(ckpts):
    assert start(ckpts["bf16"], None).engine.runner.model.quant is None


def test_unknown_flag_and_unsupported_checkpoint_methods(ckpts, tmp_path):
    with pytest.raises(ConfigError, match="--quantization: must be one of"):
        EngineConfig(model=str(ckpts["bf16"]), quantization="int3").validate()
    import shutil
    bad = tmp_path / "bnb"
    shutil.copytree(ckpts["bf16"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="quant_method 'bitsandbytes'"):
        start(bad, None)


@pytest.mark.parametrize("fmt,patch,match", [
    ("awq", {"version": "gemv"}, "only the GEMM layout"),
    ("awq", {"bits": 8}, "only 4-bit"),
    ("gptq", {"bits": 8}, "only 4-bit"),
    ("gptq", {"lm_head": True}, "quantized lm_head"),
    ("gptq", {"checkpoint_format": "marlin"}, "checkpoint_format"),
    ("fp8", {"activation_scheme": "weird"}, "activation_scheme"),
    # fp8 weights under the W4A16 format name: its scheme is checked against the format
    ("compressed-tensors", {"format": "pack-quantized"}, "only 4-bit int weights"),
    ("ct-w4a16", {"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
])
def test_unsupported_options_are_clear_errors(ckpts, tmp_path, fmt, patch, match):
    import shutil
    d = tmp_path / fmt
    shutil.copytree(ckpts[fmt], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"].update(patch)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=match):
        start(d, None)


def test_gptq_config_read_from_quantize_config_json(ckpts, tmp_path):
    """Older GPTQ checkpoints carry the config only in quantize_config.json."""
    import shutil
    d = tmp_path / "gptq-side"
    shutil.copytree(ckpts["gptq"], d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert start(d, None).engine.runner.model.quant.name == "gptq"
    with pytest.raises(ConfigError, match="GPTQ 4-bit checkpoint"):
        start(d, "awq")


def test_serve_cli_refuses_a_mismatched_flag(ckpts):
    """The real `pagefleet serve` process: exit code 2 and the message on stderr, before
    anything listens."""
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("pagefleet")
    proc = subprocess.run([str(exe), "serve", str(ckpts["awq"]), "--quantization", "gptq",
                           "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--quantization gptq does not match" in proc.stderr
    assert "AWQ 4-bit checkpoint" in proc.stderr


# -- checkpoints whose quantization config is not config.json's quantization_config -------------

def test_old_side_files_load_as_their_tool_wrote_them(ckpts):
    """AutoGPTQ 0.4's quantize_config.json and AutoAWQ 0.1's quant_config.json carry no
    quant_method (and config.json no quantization_config): the method comes from their
    keys, as vLLM reads them. Output equality: test_quant_engine's *-legacy cases."""
    for name, method, flags in (("awq-legacy", "awq", ("awq", "awq_marlin")),
                                ("gptq-legacy", "gptq", ("gptq", "gptq_marlin"))):
        cfg = json.loads((ckpts[name] / "config.json").read_text())
        assert "quantization_config" not in cfg
        quant = start(ckpts[name], None).engine.runner.model.quant
        assert (quant.name, quant.flags) == (method, flags)
        assert "without quant_method" in quant.describe()
    gptq = start(ckpts["gptq-legacy"], None).engine.runner.model.quant
    assert (gptq.group_size, gptq.desc_act, gptq.sym, gptq.v1) == (32, True, True, True)


def test_a_side_file_its_keys_leave_open_follows_the_flag_then_its_name():
    from pagefleet.server.models.config import quantization_method

    bare = {"bits": 4, "group_size": 128}
    assert quantization_method(bare, "quantize_config.json") == "gptq"
    assert quantization_method(bare, "quant_config.json") == "awq"
    assert quantization_method(bare, "quantize_config.json", "awq_marlin") == "awq"
    assert quantization_method(bare, "quant_config.json", "gptq") == "gptq"
    # keys decide over the flag (which is then a mismatch, naming the real format)
    assert quantization_method({"w_bit": 4, "q_group_size": 64}, "quantize_config.json",
                               "gptq") == "awq"
    assert quantization_method({"bits": 4, "desc_act": False}, "quant_config.json") == "gptq"
    # config.json's own quantization_config is never guessed at
    assert quantization_method(bare, "config.json", "awq") == ""


def test_tensor_parallel_check_sees_act_order_in_an_old_autogptq_side_file(ckpts):
    from pagefleet.server.distributed.checks import check_quantization
    from pagefleet.server.models.config import ModelConfig

    cfg = ModelConfig.from_dir(ckpts["gptq-legacy"])
    assert cfg.quantization_config_file == "quantize_config.json"
    with pytest.raises(ConfigError, match="desc_act: true"):
        check_quantization(2, cfg.quantization_config, cfg.quantization_config_file)
    check_quantization(1, cfg.quantization_config, cfg.quantization_config_file)


def _strip_config(src, dst, new_key=None):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    qcfg = cfg.pop("quantization_config")
    if new_key:
        cfg[new_key] = qcfg
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "quantize_config.json").unlink(missing_ok=True)
    return dst


@pytest.mark.parametrize("fmt,looks", [
    ("awq", "4-bit AWQ-like tensors (qweight, qzeros, scales; no g_idx)"),
    ("gptq", "4-bit GPTQ-like tensors (qweight, qzeros, scales, g_idx)"),
    ("fp8", "fp8 tensors (float8_e4m3fn weights, weight_scale_inv"),
    ("compressed-tensors", "fp8 tensors (float8_e4m3fn weights, weight_scale:"),
    ("ct-w4a16", "4-bit compressed-tensors pack-quantized tensors (weight_packed, weight_scale, "
                 "weight_shape: llm-compressor W4A16-like), e.g. "
                 "model.layers.0.mlp.down_proj.weight_packed I32"),
])
@pytest.mark.parametrize("flag", [None, "awq", "fp8"])
def test_quantized_tensors_without_a_config_are_named_not_called_unquantized(
        ckpts, tmp_path, fmt, looks, flag):
    """config.json lost its quantization_config (a re-save): the tensors say what the
    checkpoint is; neither 'not quantized, omit --quantization' nor a load that fails on
    'unexpected tensor qweight'."""
    d = _strip_config(ckpts[fmt], tmp_path / fmt)
    with pytest.raises(ConfigError) as e:
        start(d, flag)
    msg = str(e.value)
    assert "is quantized but has no quantization config" in msg, msg
    assert looks in msg and "missing the quantization_config" in msg, msg
    assert "not quantized" not in msg


def test_llm_compressors_older_compression_config_key_is_read(ckpts, tmp_path):
    """Older llm-compressor wrote `compression_config`; vLLM falls back to it."""
    from tests.server.quant_helpers import decoder_logits, load_decoder

    d = _strip_config(ckpts["compressed-tensors"], tmp_path / "ct", "compression_config")
    for flag in (None, "fp8", "compressed-tensors"):
        model = start(d, flag).engine.runner.model
        assert model.quant.name == "compressed-tensors fp8"
    ids = list(range(3, 30))
    assert torch.equal(decoder_logits(load_decoder(d), ids),
                       decoder_logits(load_decoder(ckpts["compressed-tensors"]), ids))
    with pytest.raises(ConfigError, match="it is a compressed-tensors FP8 checkpoint"):
        start(d, "awq")


def test_a_quantized_lm_head_is_refused_before_loading(ckpts, tmp_path):
    """llm-compressor with lm_head not in `ignore`: refused from the config and the
    tensor index, by name, not after copying e4m3 bytes into a float lm_head."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pagefleet.server.testing_quant import ct_fp8_quantize

    d = tmp_path / "ct-lm-head"
    shutil.copytree(ckpts["compressed-tensors"], d)
    tensors = load_file(str(d / "model.safetensors"))
    q, _ = ct_fp8_quantize(tensors["lm_head.weight"].float(), "channel", None, torch.float32)
    tensors["lm_head.weight"], tensors["lm_head.weight_scale"] = q["weight"], q["weight_scale"]
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = []
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        start(d, None)
    msg = str(e.value)
    assert "compressed-tensors FP8 checkpoint" in msg and "a quantized lm_head is not supported" in msg
    assert "lm_head.weight F8_E4M3, lm_head.weight_scale" in msg


def test_an_unquantized_layer_refuses_quantized_tensors():
    """A float weight is never filled by casting an fp8 or integer checkpoint tensor (its
    scales would be dropped): the loader names the tensor and its dtype."""
    from pagefleet.server.models.linear import ReplicatedLinear, WeightLoadError

    layer = ReplicatedLinear(32, 16, bias=False, method=None, prefix="model.layers.0.mlp.down_proj")
    for bad in (torch.ones(16, 32).to(torch.float8_e4m3fn), torch.ones(16, 32, dtype=torch.int32)):
        with pytest.raises(WeightLoadError, match="down_proj.weight is (float8_e4m3fn|int32) in "
                           "the checkpoint, a quantized tensor"):
            layer.load_weight("weight", bad)
    layer.load_weight("weight", torch.ones(16, 32, dtype=torch.bfloat16))
    assert layer.weight.dtype == torch.get_default_dtype() and bool((layer.weight == 1).all())


def test_dense_tensors_refuse_quantized_values(ckpts, tmp_path):
    """The same for the model's other tensors (a norm stored in fp8)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from pagefleet.server.models.linear import WeightLoadError
    from tests.server.quant_helpers import load_decoder

    d = tmp_path / "awq-fp8-norm"
    shutil.copytree(ckpts["awq"], d)
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match="model.norm.weight is float8_e4m3fn"):
        load_decoder(d)


# -- malformed checkpoints and formats in the wild (adversarial review) -------------------------

def _edit(src, dst, cfg_patch=None, tensors=None):
    """A copy of checkpoint `src` with its quantization_config and/or tensors edited."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if cfg_patch is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg_patch(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
        (dst / "quantize_config.json").unlink(missing_ok=True)
    if tensors is not None:
        t = load_file(str(dst / "model.safetensors"))
        tensors(t)
        save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("fmt,tensor", [("awq", "self_attn.k_proj.qweight"),
                                        ("awq", "mlp.down_proj.qzeros"),
                                        ("gptq", "mlp.up_proj.qweight"),
                                        ("gptq-actorder", "self_attn.q_proj.g_idx"),
                                        ("ct-w4a16", "mlp.down_proj.weight_packed"),
                                        ("ct-w4a16", "self_attn.v_proj.weight_zero_point"),
                                        ("ct-w4a16-actorder", "mlp.up_proj.weight_g_idx")])
def test_packed_integer_tensors_saved_as_floats_are_refused(ckpts, tmp_path, fmt, tensor):
    """A state dict cast wholesale to float16 (`{k: v.half() ...}`, a common slip when
    re-saving) turns the int32 words into float values: copied back into int32 they
    were garbage that loaded without a word (AWQ logits 90-100% off). Refused by name."""
    from pagefleet.server.models.linear import WeightLoadError
    from tests.server.quant_helpers import load_decoder

    name = f"model.layers.0.{tensor}"

    def cast(t):
        t[name] = t[name].to(torch.float16 if "g_idx" not in name else torch.float32)

    d = _edit(ckpts[fmt], tmp_path / fmt, tensors=cast)
    with pytest.raises(WeightLoadError) as e:
        load_decoder(d)
    msg = str(e.value)
    assert name in msg and "an integer tensor" in msg, msg


def test_act_order_without_g_idx_is_refused(ckpts, tmp_path):
    """desc_act true: each layer's rows are grouped by its g_idx. A checkpoint without
    them (stripped by a converter) loaded with plain k // G groups: 80% logit error."""
    from tests.server.quant_helpers import load_decoder

    d = _edit(ckpts["gptq-actorder"], tmp_path / "no-g-idx", tensors=lambda t: [
        t.pop(n) for n in list(t) if n.endswith(".g_idx")])
    with pytest.raises(ConfigError) as e:
        load_decoder(d)
    msg = str(e.value)
    assert "desc_act true" in msg and "model.layers.0.self_attn.q_proj.g_idx" in msg, msg
    # without act-order the plain groups are what g_idx would say: still loads
    plain = _edit(ckpts["gptq"], tmp_path / "plain-no-g-idx", tensors=lambda t: [
        t.pop(n) for n in list(t) if n.endswith(".g_idx")])
    ids = list(range(3, 30))
    from tests.server.quant_helpers import decoder_logits
    assert torch.equal(decoder_logits(load_decoder(plain), ids),
                       decoder_logits(load_decoder(ckpts["gptq"]), ids))


@pytest.mark.parametrize("patch,names", [
    (lambda q: q.pop("quant_method"), ["has no quant_method"]),
    (lambda q: q.update(quant_method="gguf"), ["quant_method 'gguf'"]),
    (lambda q: q.update(quant_method="marlin"), ["quant_method 'marlin'"]),
    (lambda q: q.update(quant_method="fbgemm_fp8"), ["quant_method 'fbgemm_fp8'"]),
])
def test_unknown_or_missing_quant_method(ckpts, tmp_path, patch, names):
    d = _edit(ckpts["awq"], tmp_path / "qm", patch)
    with pytest.raises(ConfigError) as e:
        start(d, None)
    msg = str(e.value)
    assert "quant_method ''" not in msg
    assert "supported: fp8, awq, gptq, compressed-tensors" in msg
    for n in names:
        assert n in msg, msg


def _ct_w4a16(q):
    """llm-compressor's W4A16 preset as compressed-tensors writes it (pack-quantized)."""
    q["format"] = "pack-quantized"
    group = q["config_groups"]["group_0"]
    group.update(input_activations=None, format="pack-quantized")
    group["weights"].update(num_bits=4, type="int", strategy="group", group_size=128)


def _ct_mixed(q):
    """fp8 layers in one config group, W4A16 ones in another (mixed-precision)."""
    fp8 = json.loads(json.dumps(q["config_groups"]["group_0"]))
    _ct_w4a16(q)
    q["config_groups"]["group_1"] = dict(fp8, targets=["re:.*down_proj"])
    q["format"] = "mixed-precision"


@pytest.mark.parametrize("src,patch,names", [
    ("compressed-tensors", lambda q: (_ct_w4a16(q), q["config_groups"]["group_0"]["weights"]
                                      .update(num_bits=8)),
     ["pack-quantized weights 8-bit int", "only 4-bit int weights (W4A16)"]),
    ("compressed-tensors", lambda q: q.update(format="int-quantized"),
     ["format 'int-quantized'", "8-bit float weights"]),
    ("compressed-tensors", lambda q: (_ct_w4a16(q), q.update(format="int-quantized")),
     ["format 'int-quantized' (4-bit int weights, group strategy, group size 128)"]),
    ("compressed-tensors", _ct_mixed,
     ["format 'mixed-precision' with config groups in formats float-quantized, "
      "pack-quantized", "4-bit int weights", "8-bit float weights"]),
    ("ct-w4a16", lambda q: q["config_groups"]["group_0"].update(input_activations={
        "num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
     ["8-bit int input activations (W4A8)"]),
    ("ct-w4a16", lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="tensor",
                                                                           group_size=None),
     ["4-bit weight strategy 'tensor'"]),
    ("ct-w4a16", lambda q: q["config_groups"].update(group_1=dict(
        q["config_groups"]["group_0"], targets=["re:.*down_proj"],
        weights=dict(q["config_groups"]["group_0"]["weights"], group_size=128))),
     ["2 different schemes in config_groups", "group size 32; 4-bit int weights, group "
      "strategy, group size 128"]),
])
def test_compressed_tensors_integer_schemes_name_their_weights(ckpts, tmp_path, src, patch,
                                                               names):
    """Integer schemes other than W4A16 (W8A16, W4A8, int-quantized, formats mixed
    across config groups): refused at startup with what the weights are, not only the
    format's name."""
    d = _edit(ckpts[src], tmp_path / "ct", patch)
    with pytest.raises(ConfigError) as e:
        start(d, None)
    msg = str(e.value)
    assert "unsupported compressed-tensors checkpoint" in msg, msg
    for n in names:
        assert n in msg, msg


def test_gguf_checkpoints_are_named(ckpts, tmp_path):
    """A GGUF directory (config.json beside model-Q4_K_M.gguf) or file: said so, not
    'no safetensors' alone or a NotADirectoryError."""
    import shutil

    from pagefleet.server.models.hub import ModelNotFoundError, resolve_model
    from pagefleet.server.models.linear import WeightLoadError
    from tests.server.quant_helpers import load_decoder

    d = tmp_path / "gguf"
    d.mkdir()
    shutil.copy(ckpts["bf16"] / "config.json", d / "config.json")
    (d / "model-Q4_K_M.gguf").write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(WeightLoadError, match=r"GGUF \(model-Q4_K_M.gguf\).*not supported"):
        load_decoder(d)
    with pytest.raises(ModelNotFoundError, match="GGUF"):
        resolve_model(str(d / "model-Q4_K_M.gguf"))


@pytest.mark.parametrize("fmt,edit,names", [
    ("awq", lambda t: t.pop("model.layers.0.self_attn.k_proj.qzeros"),
     ["lacks weights for: model.layers.0.self_attn.k_proj.qzeros"]),
    ("gptq", lambda t: t.pop("model.layers.0.mlp.down_proj.scales"),
     ["lacks weights for: model.layers.0.mlp.down_proj.scales"]),
    ("compressed-tensors", lambda t: t.pop("model.layers.0.mlp.up_proj.weight_scale"),
     ["lacks weights for: model.layers.0.mlp.up_proj.weight_scale"]),
    ("awq", lambda t: t.__setitem__("model.layers.0.mlp.gate_proj.scales",
                                    t["model.layers.0.mlp.gate_proj.scales"][:-1]),
     ["model.layers.0.mlp.gate_proj.scales (model.safetensors): ",
      "does not match the layer's"]),
    # llm-compressor W4A16
    ("ct-w4a16", lambda t: t.pop("model.layers.0.mlp.up_proj.weight_scale"),
     ["lacks weights for: model.layers.0.mlp.up_proj.weight_scale"]),
    ("ct-w4a16", lambda t: t.pop("model.layers.0.self_attn.k_proj.weight_zero_point"),
     ["lacks weights for: model.layers.0.self_attn.k_proj.weight_zero_point"]),
    ("ct-w4a16", lambda t: t.pop("model.layers.0.self_attn.o_proj.weight_packed"),
     ["lacks weights for: model.layers.0.self_attn.o_proj.weight_packed"]),
    ("ct-w4a16", lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight_packed",
                                         t["model.layers.0.self_attn.k_proj.weight_packed"][:, 1:].clone()),
     ["model.layers.0.self_attn.k_proj.weight_packed (model.safetensors): ",
      "does not match the layer's"]),
    ("ct-w4a16", lambda t: t.__setitem__("model.layers.0.mlp.down_proj.weight_scale",
                                         t["model.layers.0.mlp.down_proj.weight_scale"][:, :2].clone()),
     ["model.layers.0.mlp.down_proj.weight_scale (model.safetensors): ",
      "does not match the layer's"]),
    ("ct-w4a16", lambda t: t.__setitem__("model.layers.0.mlp.gate_proj.weight_shape",
                                         torch.tensor([160, 96])),
     ["model.layers.0.mlp.gate_proj.weight_shape (model.safetensors): ",
      "the checkpoint says the weight is [160, 96], but the model's config makes it [160, 64]"]),
    # HF fp8 names its scales weight_scale_inv (the layer's parameter is weight_scale)
    ("fp8", lambda t: t.pop("model.layers.0.self_attn.k_proj.weight_scale_inv"),
     ["lacks weights for: model.layers.0.self_attn.k_proj.weight_scale_inv"]),
])
def test_missing_and_misshapen_tensors_are_named_as_the_checkpoint_names_them(
        ckpts, tmp_path, fmt, edit, names):
    """Errors name the checkpoint's tensor (k_proj.qzeros), not only the fused layer's
    parameter the user's files do not have (qkv_proj.qzeros[k])."""
    from pagefleet.server.models.linear import WeightLoadError
    from tests.server.quant_helpers import load_decoder

    d = _edit(ckpts[fmt], tmp_path / fmt, tensors=edit)
    with pytest.raises(WeightLoadError) as e:
        load_decoder(d)
    for n in names:
        assert n in str(e.value), str(e.value)


@pytest.mark.parametrize("fmt,proj,tensor", [("gptq-actorder", "self_attn", "g_idx"),
                                              ("ct-w4a16-actorder", "mlp", "weight_g_idx")])
def test_bad_act_order_groups_are_named_as_the_checkpoint_names_them(ckpts, tmp_path, fmt,
                                                                     proj, tensor):
    """A g_idx that is no act-order permutation of the groups is found when the fused
    layer is complete: the error names the checkpoint's tensors (q_proj.g_idx, ...,
    gate_proj.weight_g_idx), not the fused layer's (qkv_proj.g_idx, gate_up_proj...),
    which no file has."""
    from pagefleet.server.models.linear import WeightLoadError
    from tests.server.quant_helpers import load_decoder

    parts = ("q_proj", "k_proj", "v_proj") if proj == "self_attn" else ("gate_proj", "up_proj")

    def one_group(t):
        for p in parts:
            t[f"model.layers.0.{proj}.{p}.{tensor}"].zero_()

    d = _edit(ckpts[fmt], tmp_path / fmt, tensors=one_group)
    with pytest.raises(WeightLoadError) as e:
        load_decoder(d)
    msg = str(e.value)
    assert "groups are not all of size 32" in msg, msg
    for p in parts:
        assert f"model.layers.0.{proj}.{p}.{tensor}" in msg, msg
    assert "_proj." + tensor in msg and "qkv_proj" not in msg and "gate_up_proj" not in msg, msg


def test_compressed_tensors_act_order_without_g_idx_is_refused(ckpts, tmp_path):
    """actorder group: each layer's rows are grouped by its weight_g_idx; without them
    (stripped by a converter) the plain groups would serve garbage."""
    from tests.server.quant_helpers import load_decoder

    d = _edit(ckpts["ct-w4a16-actorder"], tmp_path / "no-g-idx", tensors=lambda t: [
        t.pop(n) for n in list(t) if n.endswith(".weight_g_idx")])
    with pytest.raises(ConfigError) as e:
        load_decoder(d)
    msg = str(e.value)
    assert "actorder group" in msg and "model.layers.0.self_attn.q_proj.weight_g_idx" in msg, msg


def test_tensor_parallel_check_refuses_compressed_tensors_act_order(ckpts):
    from pagefleet.server.distributed.checks import check_quantization
    from pagefleet.server.models.config import ModelConfig

    cfg = ModelConfig.from_dir(ckpts["ct-w4a16-actorder"])
    with pytest.raises(ConfigError, match="actorder: group"):
        check_quantization(2, cfg.quantization_config, cfg.quantization_config_file)
    check_quantization(1, cfg.quantization_config, cfg.quantization_config_file)
    plain = ModelConfig.from_dir(ckpts["ct-w4a16"])
    check_quantization(2, plain.quantization_config, plain.quantization_config_file)
