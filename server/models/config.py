"""The parts of an HF `config.json` the decoders need, read once into a typed record.

Reads both the classic checkpoint format (`rope_theta`, `rope_scaling`) and
transformers v5's `rope_parameters`, with `--hf-overrides` (vLLM's flag) applied on top.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pagefleet.server.config import ConfigError

# Per-architecture differences of the supported decoders.
ARCH_FEATURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
}


class UnsupportedModelError(ConfigError):
    """The checkpoint (or what --hf-overrides makes of it) asks for something pagefleet
    does not implement: a startup error, one line naming what is supported."""


# The rope types served (ops/rotary.py computes them); the others (dynamic NTK, longrope,
# ...) are refused at startup, naming these.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_type_of(scaling: dict | None) -> str:
    """HF's reading: `rope_type`, else the older `type`, else default."""
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default")) or "default"


# Types whose original_max_position_embeddings HF fills in (`standardize_rope_params`).
_ORIGINAL_LEN_TYPES = ("llama3", "yarn", "longrope")
# What --hf-overrides may set: the keys that extend the context (rope scaling) and the
# position limit. Other keys change the checkpoint's shapes or what pagefleet never reads
# (silently ignored would be worse than refused): edit config.json for those.
HF_OVERRIDE_KEYS = ("rope_scaling", "rope_parameters", "rope_theta", "max_position_embeddings")


def parse_hf_overrides(text: str | dict | None) -> dict:
    """`--hf-overrides` (a JSON object, as vLLM takes it) -> the dict, checked: only
    HF_OVERRIDE_KEYS, rope dicts as objects, numbers as numbers. ConfigError otherwise."""
    if text is None or text == "":
        return {}
    if isinstance(text, dict):
        data = text
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--hf-overrides: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError("--hf-overrides: expected a JSON object, e.g. "
                          '{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, '
                          '"original_max_position_embeddings": 32768}}')
    other = [k for k in data if k not in HF_OVERRIDE_KEYS]
    if other:
        raise ConfigError(f"--hf-overrides: {', '.join(map(repr, other))} cannot be "
                          f"overridden here; the keys taken are {', '.join(HF_OVERRIDE_KEYS)} "
                          "(edit the model's config.json for anything else)")
    for key in ("rope_scaling", "rope_parameters"):
        if key in data and not (data[key] is None or isinstance(data[key], dict)):
            raise ConfigError(f"--hf-overrides: {key} must be a JSON object or null")
    if "rope_theta" in data and not _is_number(data["rope_theta"], 0):
        raise ConfigError("--hf-overrides: rope_theta must be a number > 0")
    if "max_position_embeddings" in data and not (
            isinstance(data["max_position_embeddings"], int)
            and not isinstance(data["max_position_embeddings"], bool)
            and data["max_position_embeddings"] >= 1):
        raise ConfigError("--hf-overrides: max_position_embeddings must be an integer >= 1")
    return data


def _is_number(x, above: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > above


def apply_hf_overrides(cfg: dict, overrides: dict) -> dict:
    """config.json with vLLM's --hf-overrides applied: each key replaced as a whole (a
    rope dict is not merged into the checkpoint's; `rope_scaling` replaces transformers
    v5's `rope_parameters` too, so `"rope_scaling": null` turns scaling off, and
    `rope_parameters` replaces `rope_scaling`). The rope
    theta stays the checkpoint's unless `rope_theta` is overridden, which then also
    replaces the one inside a rope dict (read first otherwise)."""
    if not overrides:
        return cfg
    theta = _theta(cfg)
    out = dict(cfg)
    for key, value in overrides.items():
        out[key] = dict(value) if isinstance(value, dict) else value
    # One rope dict wins: the one overridden replaces the checkpoint's other spelling
    # (a Llama 3 config.json's llama3 rope_scaling would otherwise be read first).
    if "rope_scaling" in overrides and "rope_parameters" not in overrides:
        out.pop("rope_parameters", None)
    if "rope_parameters" in overrides and "rope_scaling" not in overrides:
        out.pop("rope_scaling", None)
    if "rope_theta" in overrides:
        for key in ("rope_scaling", "rope_parameters"):
            if isinstance(out.get(key), dict) and "rope_theta" in out[key]:
                out[key]["rope_theta"] = overrides["rope_theta"]
    elif theta is not None and _theta(out) is None:
        out["rope_theta"] = theta
    return out


def _theta(cfg: dict) -> float | None:
    """The rope base a config gives: its rope dict's rope_theta (transformers reads it
    first), else the top-level rope_theta."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(key)
        if isinstance(rope, dict) and rope.get("rope_theta") is not None:
            return rope["rope_theta"]
    return cfg.get("rope_theta")


def _rope_scaling(cfg: dict) -> dict | None:
    """The rope scaling of a config, standardized as transformers does it
    (`standardize_rope_params`): `type` read as `rope_type`, `original_max_position_embeddings`
    filled in from max_position_embeddings (a top-level one wins, as for Phi-3), YaRN's
    factor null read as max_position_embeddings / original. None for plain rope; an
    unsupported type is an UnsupportedModelError naming the supported ones."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
    if not rope:
        return None
    if not isinstance(rope, dict):
        raise UnsupportedModelError(f"rope_scaling {rope!r}: expected an object")
    rope_type = rope_type_of(rope)
    if rope_type == "default":
        return None
    where = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{where} type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    scaling = dict(rope, rope_type=rope_type)
    max_pos = cfg.get("max_position_embeddings", 4096)
    if rope_type in _ORIGINAL_LEN_TYPES:
        if "original_max_position_embeddings" in cfg:
            scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        else:
            scaling.setdefault("original_max_position_embeddings", max_pos)
    if "factor" not in scaling:
        raise UnsupportedModelError(f"{where} type {rope_type!r} needs a factor")
    if scaling["factor"] is None and rope_type == "yarn":
        scaling["factor"] = max_pos / scaling["original_max_position_embeddings"]
    if not _is_number(scaling["factor"], 0):
        raise UnsupportedModelError(f"{where} factor must be a number > 0, got "
                                    f"{scaling['factor']!r}")
    partial = scaling.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if rope_type in ("linear", "yarn") and partial not in (None, 1, 1.0):
        raise UnsupportedModelError(f"partial_rotary_factor {partial} is not supported "
                                    "(the whole head is rotated)")
    return scaling


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

    def context_limit(self) -> tuple[int, str]:
        """(the longest context the config allows, how it was derived): vLLM's rule
        (`_get_and_verify_max_len`): max_position_embeddings, times the rope scaling
        factor for the types that do not already count it there (linear; for yarn the
        original_max_position_embeddings times the factor: Qwen2.5's 32768 x 4 = 131072);
        llama3 configs already give the scaled length."""
        limit = self.max_position_embeddings
        scaling = self.rope_scaling
        if not scaling or scaling["rope_type"] in ("llama3", "longrope", "su"):
            return limit, f"max_position_embeddings {limit}"
        factor, key = scaling["factor"], "max_position_embeddings"
        if scaling["rope_type"] == "yarn":
            key = "original_max_position_embeddings"
            limit = scaling[key]
        return int(limit * factor), f"{key} {limit} x {scaling['rope_type']} factor {factor:g}"

    @classmethod
    def from_dir(cls, model_dir: str | Path,
                 hf_overrides: str | dict | None = None) -> "ModelConfig":
        """`hf_overrides`: `--hf-overrides` (JSON text or its dict), applied to config.json."""
        model_dir = Path(model_dir)
        cfg = json.loads((model_dir / "config.json").read_text())
        cfg = apply_hf_overrides(cfg, parse_hf_overrides(hf_overrides))
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCH_FEATURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architecture {archs or cfg.get('model_type')} is not supported; "
                f"supported: {', '.join(ARCH_FEATURES)}")
        theta = _theta(cfg)
        theta = 10000.0 if theta is None else theta
        scaling = _rope_scaling(cfg)
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
