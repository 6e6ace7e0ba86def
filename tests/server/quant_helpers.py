"""Shared pieces of the quantization tests: tiny quantized checkpoints with their
dequantized twins, a one-sequence forward of our decoder, and the dense weight a loaded
linear layer stands for."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagefleet.server.models.config import ModelConfig
from pagefleet.server.models.decoder import AttentionMetadata, Ops
from pagefleet.server.models.loader import load_model
from pagefleet.server.ops import quant

FP8 = torch.float8_e4m3fn
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_row_reference(src: Path, dst: Path) -> Path:
    """`src` with each projection weight replaced by its per-row e4m3 round trip (what
    `--quantization fp8` loads), written independently of the loader's code."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and "index" not in f.name:
            (dst / f.name).write_bytes(f.read_bytes())
    out = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name).float()
                if name.endswith(".weight") and any(f".{p}." in name for p in PROJ):
                    scale = t.abs().amax(1, keepdim=True) / 448.0
                    t = (t / scale).to(FP8).float() * scale
                out[name] = t
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(dict(cfg, torch_dtype="float32")))
    return dst


def decoder_logits(model, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits `[T, vocab]` of one prompt run as a single prefill through our decoder."""
    cfg = model.cfg
    t = len(ids)
    nb = -(-t // block_size)
    shape = (nb, block_size, cfg.num_kv_heads, cfg.head_dim)
    for attn in model.attention_layers():
        attn.k_cache, attn.v_cache = torch.zeros(shape), torch.zeros(shape)
    meta = AttentionMetadata(
        positions=torch.arange(t), slot_mapping=torch.arange(t),
        cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32),
        context_lens=torch.tensor([t], dtype=torch.int32),
        block_tables=torch.arange(nb, dtype=torch.int32)[None], max_query_len=t)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), meta))


def load_decoder(model_dir: Path, ops: type[Ops] = Ops, quantization: str | None = None):
    cfg = ModelConfig.from_dir(model_dir)
    return load_model(model_dir, cfg, torch.float32, torch.device("cpu"), ops,
                      quantization=quantization)


def hf_logits(model_dir: Path, ids: list[int], **kw) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **kw)
    with torch.inference_mode():
        return hf(input_ids=torch.tensor([ids])).logits[0]


def dense_weight(layer) -> torch.Tensor:
    """The `[N, K]` float32 weight a loaded (processed) linear layer multiplies by."""
    if hasattr(layer, "qweight"):
        w = quant.w4_dequantize(layer.qweight, layer.scales, layer.zeros, layer.group_size).t()
        if layer.perm is not None:
            w = w[:, torch.argsort(layer.perm)]
        return w
    if layer.weight.dtype == FP8:
        return quant.fp8_dequantize(layer.weight, layer.weight_scale, layer.fp8_block)
    return layer.weight.float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
