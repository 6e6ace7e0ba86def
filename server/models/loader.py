"""Load HF safetensors checkpoints (single file or sharded with an index) by HF names.

HF keeps q/k/v and gate/up as separate tensors; the decoder fuses them, so each HF
tensor is copied into its slice of the fused parameter. Tensors are read one at a time
straight into the preallocated parameters (no second full copy of the model in memory).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from pagefleet.server.models.config import ModelConfig
from pagefleet.server.models.decoder import DecoderForCausalLM, Ops

# HF name fragment -> (fused fragment, shard index among the fused parts)
_FUSED = {
    ".self_attn.q_proj.": (".self_attn.qkv_proj.", 0),
    ".self_attn.k_proj.": (".self_attn.qkv_proj.", 1),
    ".self_attn.v_proj.": (".self_attn.qkv_proj.", 2),
    ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
    ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
}


class WeightLoadError(RuntimeError):
    pass


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in dict.fromkeys(weight_map.values())]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors weights in {model_dir}")
    return files


def _target(name: str, cfg: ModelConfig) -> tuple[str, int | None]:
    """Our parameter name for an HF tensor name, and its slice index if fused."""
    if name.startswith("model."):
        name = name[len("model."):]
    name = name.replace("embed_tokens.weight", "embed_tokens").replace("lm_head.weight", "lm_head")
    for frag, (fused, idx) in _FUSED.items():
        if frag in name:
            return name.replace(frag, fused), idx
    return name, None


def _slice(param: torch.Tensor, name: str, idx: int, cfg: ModelConfig) -> torch.Tensor:
    if "qkv_proj" in name:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        sizes = [q, kv, kv]
    else:
        sizes = [cfg.intermediate_size] * 2
    start = sum(sizes[:idx])
    return param.narrow(0, start, sizes[idx])


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype,
               device: torch.device, ops: type[Ops] = Ops,
               max_positions: int | None = None) -> DecoderForCausalLM:
    model_dir = Path(model_dir)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DecoderForCausalLM(cfg, ops, max_positions)
    finally:
        torch.set_default_dtype(prev)
    params = dict(model.named_parameters())
    filled: dict[str, int] = {n: 0 for n in params}
    parts = {n: (3 if "qkv_proj" in n else 2 if "gate_up_proj" in n else 1) for n in params}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                if "rotary_emb.inv_freq" in hf_name:
                    continue
                name, idx = _target(hf_name, cfg)
                if name == "lm_head" and cfg.tie_word_embeddings:
                    continue
                if name not in params:
                    raise WeightLoadError(f"{path.name}: unexpected tensor {hf_name!r} "
                                          f"for {cfg.architecture}")
                tensor = f.get_tensor(hf_name)
                dest = params[name].data if idx is None else _slice(params[name].data, name, idx, cfg)
                if tuple(dest.shape) != tuple(tensor.shape):
                    raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} does not "
                                          f"match the config's {tuple(dest.shape)}")
                dest.copy_(tensor.to(dtype))
                filled[name] += 1
    missing = [n for n, c in filled.items() if c < parts[n]]
    if missing:
        raise WeightLoadError(f"checkpoint in {model_dir} lacks weights for: {', '.join(missing[:8])}"
                              + (" ..." if len(missing) > 8 else ""))
    return model
