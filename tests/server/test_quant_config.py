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
                                       ("compressed-tensors", "fp8"), ("bf16", "fp8")])
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
    ("compressed-tensors", {"format": "pack-quantized"}, "only fp8 weights"),
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
