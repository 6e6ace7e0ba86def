"""Rope scaling (linear, YaRN) as transformers computes it, and the context length it
gives: cos/sin bit-identical to HF's rotary embedding for the config.json a checkpoint
ships (or --hf-overrides makes of it), the default max_model_len by vLLM's rule, and
a one-line startup error for the types not served. Greedy parity on whole models:
test_parity.py; the Triton kernel on the scaled cache: test_kernels_pointwise.py."""

from __future__ import annotations

import json

import pytest
import torch

from pagefleet.server.config import ConfigError, EngineConfig
from pagefleet.server.engine.core import resolve_max_model_len
from pagefleet.server.models.config import ModelConfig, UnsupportedModelError
from pagefleet.server.ops import rotary

QWEN25_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def write_config(tmp_path, arch: str = "qwen2", head_dim: int = 64, max_pos: int = 256,
                 **extra) -> str:
    cfg = {"architectures": [{"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[arch]],
           "model_type": arch, "vocab_size": 64, "hidden_size": head_dim * 4,
           "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": max_pos,
           "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}
    for key, value in extra.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def hf_cos_sin(model_dir: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[positions, head_dim]` from the model's own HF rotary embedding."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    config = AutoConfig.from_pretrained(model_dir)
    cls = {"qwen2": Qwen2RotaryEmbedding, "llama": LlamaRotaryEmbedding}[config.model_type]
    with torch.no_grad():
        cos, sin = cls(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    return cos[0], sin[0]


def our_cos_sin(cfg: ModelConfig, n: int) -> torch.Tensor:
    return rotary.cos_sin_cache(cfg.head_dim, n, cfg.rope_theta, cfg.rope_scaling)


# (arch, head_dim, max_position_embeddings, config.json keys)
SCALED = {
    # Qwen2.5's model card, verbatim: the old `type` key, 32K positions trained, x4.
    "qwen2.5-card": ("qwen2", 128, 32768, {"rope_scaling": QWEN25_YARN}),
    "yarn-explicit": ("qwen2", 64, 256, {"rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "attention_factor": 0.8, "beta_fast": 16, "beta_slow": 2, "truncate": False}}),
    "yarn-mscale": ("llama", 64, 256, {"rope_scaling": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.5}}),
    "yarn-not-truncated": ("llama", 32, 256, {"rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "truncate": False}}),
    # No original length: transformers takes max_position_embeddings.
    "yarn-no-original": ("qwen2", 64, 128, {"rope_scaling": {"rope_type": "yarn",
                                                             "factor": 2.0}}),
    # factor null: max_position_embeddings / original (DeepSeek's configs).
    "yarn-factor-null": ("qwen2", 64, 512, {"rope_scaling": {
        "rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}}),
    # A top-level original_max_position_embeddings wins over the dict's (Phi-3's layout).
    "yarn-top-level-original": ("qwen2", 64, 512, {
        "original_max_position_embeddings": 128,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 64}}),
    # transformers v5's format: rope_parameters holds theta and the scaling.
    "yarn-rope-parameters": ("qwen2", 64, 256, {"rope_theta": None, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "rope_theta": 500000.0}}),
    "linear": ("llama", 64, 256, {"rope_scaling": {"type": "linear", "factor": 2.5}}),
    "linear-qwen2": ("qwen2", 128, 256, {"rope_scaling": {"rope_type": "linear",
                                                          "factor": 4.0}}),
}


@pytest.mark.parametrize("name", list(SCALED))
def test_cos_sin_are_hf_rotary_embeddings_bit_for_bit(tmp_path, name):
    """Our cos/sin table (attention factor in) holds exactly what the HF model's
    rotary embedding computes for the same config.json, far past the original length."""
    arch, head_dim, max_pos, extra = SCALED[name]
    model_dir = write_config(tmp_path, arch, head_dim, max_pos, **extra)
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.rope_scaling["rope_type"] in ("yarn", "linear")
    n = 4 * max_pos                                 # 4x: the scaled range
    positions = torch.arange(n) if n <= 4096 else torch.cat([torch.arange(0, n, 61),
                                                             torch.tensor([n - 1])])
    cos, sin = hf_cos_sin(model_dir, positions)
    half = head_dim // 2
    ours = our_cos_sin(cfg, n)[positions]
    assert torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])
    assert torch.equal(ours[:, :half], cos[:, :half])
    assert torch.equal(ours[:, half:], sin[:, :half])


def test_yarn_attention_factor_scales_cos_and_sin(tmp_path):
    """YaRN's cos/sin are not unit: 0.1 ln(4) + 1 = 1.1386 for factor 4 (a cache without
    the factor would rotate by the right angles and still differ from HF)."""
    model_dir = write_config(tmp_path, **SCALED["qwen2.5-card"][3])
    cfg = ModelConfig.from_dir(model_dir)
    cs = our_cos_sin(cfg, 8)
    half = cfg.head_dim // 2
    norm = cs[:, :half] ** 2 + cs[:, half:] ** 2
    assert torch.allclose(norm, torch.full_like(norm, 1.138629436111989 ** 2))


def test_hf_overrides_make_the_config_qwen_card_asks_for(tmp_path):
    """--hf-overrides (a JSON object, vLLM's flag) gives the same rope and context as the
    edited config.json: a rope dict without theta keeps the checkpoint's."""
    (tmp_path / "plain").mkdir()
    plain = write_config(tmp_path / "plain", head_dim=128, max_pos=32768)
    edited = write_config(tmp_path, head_dim=128, max_pos=32768, rope_scaling=QWEN25_YARN)
    a = ModelConfig.from_dir(plain, json.dumps({"rope_scaling": QWEN25_YARN}))
    b = ModelConfig.from_dir(edited)
    assert a.rope_theta == b.rope_theta == 1000000.0
    assert a.context_limit()[0] == b.context_limit()[0] == 131072
    assert torch.equal(our_cos_sin(a, 256), our_cos_sin(b, 256))
    # A dict works too (the offline LLM's hf_overrides=...), and theta can be set.
    c = ModelConfig.from_dir(plain, {"rope_theta": 10000.0, "max_position_embeddings": 4096})
    assert (c.rope_theta, c.max_position_embeddings, c.rope_scaling) == (10000.0, 4096, None)


def test_hf_overrides_keep_or_replace_the_theta_of_a_v5_config(tmp_path):
    """A transformers v5 config keeps theta inside rope_parameters: replacing the rope
    dict keeps that theta, `"rope_scaling": null` turns the scaling off (and keeps it),
    an overridden rope_theta replaces it."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
            "rope_theta": 500000.0}
    model_dir = write_config(tmp_path, rope_theta=None, rope_parameters=yarn)
    cfg = ModelConfig.from_dir(model_dir)
    assert (cfg.rope_theta, cfg.rope_scaling["rope_type"]) == (500000.0, "yarn")
    cfg = ModelConfig.from_dir(model_dir, '{"rope_scaling": null}')
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.context_limit()[0]) == (500000.0, None, 256)
    cfg = ModelConfig.from_dir(model_dir, '{"rope_scaling": {"type": "linear", "factor": 2}}')
    assert (cfg.rope_theta, cfg.rope_scaling["rope_type"]) == (500000.0, "linear")
    cfg = ModelConfig.from_dir(model_dir, '{"rope_theta": 10000}')
    assert (cfg.rope_theta, cfg.rope_scaling["rope_type"]) == (10000.0, "yarn")


def test_hf_overrides_rope_parameters_replace_a_checkpoints_rope_scaling(tmp_path):
    """A Llama 3 config.json carries a llama3 rope_scaling; overriding the v5 spelling
    `rope_parameters` with yarn must take effect (rope_scaling was read first and the
    override silently did nothing), keeping the checkpoint's theta."""
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model_dir = write_config(tmp_path, arch="llama", rope_theta=500000.0, rope_scaling=llama3)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    cfg = ModelConfig.from_dir(model_dir, json.dumps({"rope_parameters": yarn}))
    assert (cfg.rope_theta, cfg.rope_scaling["rope_type"]) == (500000.0, "yarn")
    assert cfg.context_limit()[0] == 1024


@pytest.mark.parametrize("override,words", [
    ("{not json", "--hf-overrides: not JSON"),
    ('["rope_scaling"]', "--hf-overrides: expected a JSON object"),
    ('{"num_hidden_layers": 2}', "'num_hidden_layers' cannot be overridden here"),
    ('{"rope_scaling": "yarn"}', "rope_scaling must be a JSON object"),
    ('{"max_position_embeddings": "128k"}', "max_position_embeddings must be an integer"),
])
def test_bad_hf_overrides_are_one_line_errors(tmp_path, override, words):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dir(write_config(tmp_path), override)
    assert words in str(e.value)


# (rope_scaling, max_position_embeddings, the default max_model_len)
CONTEXT_LIMITS = [
    (None, 32768, 32768),
    (QWEN25_YARN, 32768, 131072),                                   # Qwen2.5, 128K
    ({"rope_type": "yarn", "factor": 4.0}, 32768, 131072),           # original: max_pos
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
     131072, 131072),                      # yarn counts from the original length
    ({"rope_type": "linear", "factor": 2.0}, 4096, 8192),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, 131072, 131072),   # already scaled
]


def test_default_max_model_len_follows_vllms_rule(tmp_path):
    """vLLM's `_get_and_verify_max_len`: max_position_embeddings, times the factor for
    linear, original_max_position_embeddings times the factor for yarn; llama3's
    max_position_embeddings is already the scaled length. Beyond it: refused."""
    for i, (rope, max_pos, expected) in enumerate(CONTEXT_LIMITS):
        (tmp_path / str(i)).mkdir()
        cfg = ModelConfig.from_dir(write_config(tmp_path / str(i), max_pos=max_pos,
                                                rope_scaling=rope))
        assert resolve_max_model_len(EngineConfig(), cfg) == expected, rope
        assert resolve_max_model_len(EngineConfig(max_model_len=expected), cfg) == expected
        with pytest.raises(ConfigError, match=f"use at most {expected}"):
            resolve_max_model_len(EngineConfig(max_model_len=expected + 1), cfg)


@pytest.mark.parametrize("rope", [
    {"type": "dynamic", "factor": 2.0},
    {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]},
    {"rope_type": "ntk-by-parts", "factor": 2.0},
])
def test_unsupported_rope_types_are_a_one_line_startup_error(tmp_path, rope):
    """The server's startup path (ServedEngine reads the config before anything starts):
    a ConfigError, which `pagefleet serve` prints as one line, naming what is served."""
    from pagefleet.server.engine.core_process import ServedEngine

    model_dir = write_config(tmp_path, rope_scaling=rope)
    with pytest.raises(ConfigError) as e:
        ServedEngine(EngineConfig(model=model_dir, device="cpu"), model_dir)
    kind = rope.get("rope_type", rope.get("type"))
    assert str(e.value) == (f"rope_scaling type {kind!r} is not supported; supported: "
                            "default, linear, llama3, yarn")
    assert isinstance(e.value, UnsupportedModelError)


def test_partial_rotary_factor_is_refused_with_scaling(tmp_path):
    """transformers would rotate part of the head for linear/yarn; the decoders here
    rotate it all, so such a config is refused rather than served differently."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
            "partial_rotary_factor": 0.5}
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.5"):
        ModelConfig.from_dir(write_config(tmp_path, rope_scaling=rope))
