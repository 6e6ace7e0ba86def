"""The parts of an HF `config.json` the decoders need, read once into a typed record.

Reads both the classic checkpoint format (`rope_theta`, `rope_scaling`) and
transformers v5's `rope_parameters`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

# Per-architecture differences of the supported decoders.
ARCH_FEATURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    torch_dtype: str | None
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    # config.json's `quantization_config` (or its older `compression_config`, or a
    # quantize_config.json / quant_config.json side file's content), as is;
    # models/quantization/ interprets it. `quantization_config_file` says where it came
    # from: "config.json", "config.json compression_config" or the side file's name.
    quantization_config: dict | None = field(default=None, compare=False, hash=False)
    quantization_config_file: str | None = field(default=None, compare=False, hash=False)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        model_dir = Path(model_dir)
        cfg = json.loads((model_dir / "config.json").read_text())
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCH_FEATURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architecture {archs or cfg.get('model_type')} is not supported; "
                f"supported: {', '.join(ARCH_FEATURES)}")
        rope = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        eos = _eos_ids(model_dir, cfg)
        qcfg, qfile = _quantization_config(model_dir, cfg)
        num_heads = cfg["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            sliding_window=sliding,
            eos_token_ids=eos,
            quantization_config=qcfg,
            quantization_config_file=qfile,
            **ARCH_FEATURES[arch],
        )


SIDE_FILES = ("quantize_config.json", "quant_config.json")


def _quantization_config(model_dir: Path, cfg: dict) -> tuple[dict | None, str | None]:
    """(the quantization config, where it was read): config.json's quantization_config,
    else its `compression_config` (older llm-compressor), else a side file of AutoGPTQ
    (quantize_config.json) or AutoAWQ (quant_config.json), as vLLM falls back to them."""
    if cfg.get("quantization_config"):
        return dict(cfg["quantization_config"]), "config.json"
    if cfg.get("compression_config"):
        return dict(cfg["compression_config"]), "config.json compression_config"
    for name in SIDE_FILES:
        path = model_dir / name
        if path.exists():
            return json.loads(path.read_text()), name
    return None, None


# Keys only AutoAWQ's quant_config.json (AwqConfig.to_dict) or only AutoGPTQ's
# quantize_config.json (BaseQuantizeConfig.to_dict) has: their older versions wrote no
# quant_method there.
_AWQ_KEYS = {"w_bit", "q_group_size", "zero_point"}
_GPTQ_KEYS = {"desc_act", "damp_percent", "static_groups", "true_sequential",
              "model_file_base_name", "sym"}


def quantization_method(qcfg: dict | None, source: str | None = None,
                        flag: str | None = None) -> str:
    """The checkpoint's quant_method ("" when not quantized or unknown). A side file
    without one is read as vLLM reads it: AWQ or GPTQ by its keys (w_bit, q_group_size,
    zero_point: AutoAWQ; desc_act, sym, damp_percent...: AutoGPTQ), else by
    `--quantization` (awq or gptq, and their _marlin names), else by its name."""
    if not qcfg:
        return ""
    method = str(qcfg.get("quant_method") or "").lower()
    if method or source not in SIDE_FILES:
        return method
    keys = set(qcfg)
    if keys & _AWQ_KEYS:
        return "awq"
    if keys & _GPTQ_KEYS:
        return "gptq"
    family = (flag or "").split("_")[0]
    if family in ("awq", "gptq"):
        return family
    return "awq" if source == "quant_config.json" else "gptq"


def _as_list(x: int | list[int] | None) -> list[int]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _eos_ids(model_dir: Path, cfg: dict) -> tuple[int, ...]:
    """EOS ids from generation_config.json (which may list several) and config.json."""
    ids = _as_list(cfg.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        gen = json.loads(gen_path.read_text())
        ids = _as_list(gen.get("eos_token_id")) + ids
    return tuple(dict.fromkeys(ids))


def resolve_generation_defaults(mode: str, model_dir: str | Path,
                                override: str | None = None) -> dict:
    """`--generation-config` (auto | vllm | a folder) plus `--override-generation-config`
    (a JSON object) -> the sampling defaults of requests that leave a field unset."""
    if mode == "auto":
        defaults = generation_defaults(model_dir)
    elif mode == "vllm":
        defaults = {}
    else:
        folder = Path(mode)
        if not (folder / "generation_config.json").exists():
            from pagefleet.server.config import ConfigError
            raise ConfigError(f"--generation-config {mode}: expected 'auto', 'vllm' or a "
                              "folder with a generation_config.json")
        defaults = generation_defaults(folder)
    if override:
        from pagefleet.server.config import ConfigError
        try:
            extra = json.loads(override)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--override-generation-config: not JSON ({e})") from None
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        if not isinstance(extra, dict) or any(k not in keys for k in extra):
            raise ConfigError("--override-generation-config: expected a JSON object with "
                              f"keys among {', '.join(keys)}")
        defaults = {**defaults, **extra}
    return defaults


def generation_defaults(model_dir: str | Path) -> dict:
    """Sampling defaults a checkpoint ships in generation_config.json."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return {}
    gen = json.loads(path.read_text())
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return {k: gen[k] for k in keys if k in gen and gen[k] is not None}
