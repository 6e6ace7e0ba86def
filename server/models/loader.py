"""Load HF safetensors checkpoints (single file or sharded with an index) by HF names.

HF keeps q/k/v and gate/up as separate tensors; the decoder fuses them, so each HF
tensor goes to its shard of the fused layer through the layer's weight loader
(`models/linear.py`), which also handles the quantized formats' tensors (`qweight`,
`scales`, `weight_scale`, ...). Tensors are read one at a time straight into the
preallocated parameters (no second full copy of the model in memory), and a linear
layer is converted to its kernel layout (or quantized, for `--quantization fp8`) as
soon as its last tensor is in, so at most one layer's temporaries exist at a time.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pagefleet.server.config import ConfigError
from pagefleet.server.models.config import ModelConfig
from pagefleet.server.models.lazy_tensor import LazyTensor, ReadStats
from pagefleet.server.models.decoder import DecoderForCausalLM, Ops
from pagefleet.server.models.linear import LinearBase, WeightLoadError, check_not_quantized
from pagefleet.server.models.quantization import QuantConfig, resolve_quantization, tensor_index

__all__ = ["WeightLoadError", "load_model", "safetensors_files", "QuantInfo"]

# HF projection -> (our fused layer, shard id)
_LINEAR = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\."
                     r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.(\w+)$")
_FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
          "o_proj": ("o_proj", None), "gate_proj": ("gate_up_proj", 0),
          "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None)}
_ELEM = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
GiB = 1 << 30


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in dict.fromkeys(weight_map.values())]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        gguf = sorted(p.name for p in model_dir.glob("*.gguf"))
        if gguf:   # llama.cpp's format: say so, not only that safetensors are missing
            raise WeightLoadError(
                f"the weights in {model_dir} are GGUF ({', '.join(gguf[:3])}), which is not "
                "supported; pagefleet loads Hugging Face safetensors checkpoints (bf16/fp16, "
                "or fp8, AWQ, GPTQ quantized)")
        raise WeightLoadError(f"no *.safetensors weights in {model_dir}")
    return files


@dataclass(frozen=True)
class QuantInfo:
    """What quantization saved, for the startup log."""

    method: str            # e.g. "AWQ 4-bit checkpoint (...)"
    linear_bytes: int      # the linear layers' weights as loaded (values, scales, zeros)
    dense_bytes: int       # the same layers in the activation dtype
    dtype: str

    def log_line(self, kv_bytes_per_token: int, kv_from_free_memory: bool = True) -> str:
        """`kv_from_free_memory`: the KV cache gets the memory the weights leave (a GPU
        without --kv-cache-memory or --num-gpu-blocks-override); only then is the room
        saved worth stating in KV tokens."""
        line = (f"Quantized weights: {self.method}; linear layers {self.linear_bytes / GiB:.3g} "
                f"GiB instead of {self.dense_bytes / GiB:.3g} GiB in {self.dtype}")
        if not kv_from_free_memory:
            return line
        saved = self.dense_bytes - self.linear_bytes
        tokens = saved // kv_bytes_per_token if kv_bytes_per_token else 0
        return f"{line}, which leaves {saved / GiB:.3g} GiB more for the KV cache (~{tokens} tokens)"


def _route(hf_name: str) -> tuple[str, str, object] | None:
    """(our linear layer path, tensor name, shard id) for a projection tensor."""
    m = _LINEAR.match(hf_name)
    if not m:
        return None
    layer, block, proj, tensor = m.groups()
    fused, shard = _FUSED[proj]
    return f"layers.{layer}.{block}.{fused}", tensor, shard


_HF_PART = {fused: proj for proj, fused in _FUSED.items()}


def _hf_module(layer_name: str, shard) -> str:
    """The checkpoint's module of one part of a fused layer (layers.0.self_attn.qkv_proj,
    shard 'k' -> model.layers.0.self_attn.k_proj)."""
    prefix, _, fused = layer_name.rpartition(".")
    return f"model.{prefix}{'.' if prefix else ''}{_HF_PART.get((fused, shard), fused)}"


def _hf_tensor(layer_name: str, missing: str, layer: LinearBase | None = None,
               suffixes: set[str] = frozenset()) -> str:
    """The checkpoint's name of a tensor a fused layer still lacks (`LinearBase.missing`:
    `qzeros[k]` of layers.0.self_attn.qkv_proj -> model.layers.0.self_attn.k_proj.qzeros).
    A parameter the method loads under another name (HF fp8's `weight_scale_inv` into
    `weight_scale`) is named as the checkpoint's other tensors (`suffixes`) name it."""
    name, _, sid = missing.partition("[")
    sid = sid.rstrip("]")
    shard = (int(sid) if sid.isdigit() else sid) if sid else None
    aliases = getattr(getattr(layer, "method", None), "aliases", {})
    names = [a for a, p in aliases.items() if p == name and a in suffixes]
    return f"{_hf_module(layer_name, shard)}.{names[0] if names else name}"


def _param_name(name: str) -> str:
    if name.startswith("model."):
        name = name[len("model."):]
    return name.replace("embed_tokens.weight", "embed_tokens").replace("lm_head.weight", "lm_head")


def _dense_dtype_name(index) -> str | None:
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in index:
            return {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(index[name].dtype)
    return None


def load_model(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype,
               device: torch.device, ops: type[Ops] = Ops,
               max_positions: int | None = None,
               quantization: str | None = None, tp=None) -> DecoderForCausalLM:
    """The model with its weights; `quantization` is `--quantization` (None: the
    checkpoint's own format). A flag that does not fit the checkpoint is a ConfigError.

    `tp`: this rank's tensor-parallel group (None: one device). Then every checkpoint
    tensor is handed to its loader as a `LazyTensor`, so the rank reads from the files
    only the rows/columns its shard keeps; `last_load_stats` says how many bytes that
    was and how much the process's peak memory grew while loading.
    """
    model_dir = Path(model_dir)
    rss0 = _reset_peak_rss()
    stats = ReadStats()
    files = safetensors_files(model_dir)
    index = tensor_index(files)
    quant = resolve_quantization(model_dir, cfg.quantization_config, quantization, index,
                                 _dense_dtype_name(index) or cfg.torch_dtype,
                                 cfg.quantization_config_file)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DecoderForCausalLM(cfg, ops, max_positions, quant, tp=tp)
    finally:
        torch.set_default_dtype(prev)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}
    for n, layer in linears.items():   # for errors found once a layer is complete
        layer.checkpoint_prefixes = [_hf_module(n, sid) for sid in layer.shard_ids]
    params = {n: p for n, p in model.named_parameters() if not any(
        n.startswith(ln + ".") for ln in linears)}
    filled = dict.fromkeys(params, False)
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            if tp is None:
                get = f.get_tensor
            else:
                def get(name: str, f=f) -> LazyTensor:
                    return LazyTensor(f.get_slice(name), stats)
            for hf_name in f.keys():
                if "rotary_emb.inv_freq" in hf_name:
                    continue
                route = _route(hf_name)
                if route is not None:
                    layer_name, tensor, shard = route
                    layer = linears[layer_name]
                    try:
                        layer.load_weight(tensor, get(hf_name), shard)
                    except (WeightLoadError, ConfigError) as e:
                        # the layer speaks of its fused name (qkv_proj); say the file's too
                        raise type(e)(f"{hf_name} ({path.name}): {e}") from None
                    if not layer.missing():
                        layer.finish_loading()
                    continue
                name = _param_name(hf_name)
                if name == "lm_head" and cfg.tie_word_embeddings:
                    continue
                if name not in params:
                    raise WeightLoadError(f"{path.name}: unexpected tensor {hf_name!r} "
                                          f"for {cfg.architecture}")
                tensor = get(hf_name)
                check_not_quantized(tensor.dtype, params[name].dtype, hf_name)
                vocab_loader = getattr(params[name], "vocab_loader", None)
                if vocab_loader is not None:   # a vocabulary range (tensor parallel)
                    vocab_loader(tensor, hf_name)
                    filled[name] = True
                    continue
                dest = params[name].data
                if tuple(dest.shape) != tuple(tensor.shape):
                    raise WeightLoadError(f"{hf_name}: shape {tuple(tensor.shape)} does not "
                                          f"match the config's {tuple(dest.shape)}")
                dest.copy_(tensor.to(dtype))
                filled[name] = True
    missing = [n for n, ok in filled.items() if not ok]
    suffixes = {name.rsplit(".", 1)[-1] for name in index}
    missing += [_hf_tensor(n, t, layer, suffixes) for n, layer in linears.items()
                for t in layer.missing()]
    if missing:
        raise WeightLoadError(f"checkpoint in {model_dir} lacks weights for: {', '.join(missing[:8])}"
                              + (" ..." if len(missing) > 8 else ""))
    for layer in linears.values():
        layer.finish_loading()
    model.quant = quant
    model.quant_info = _quant_info(quant, linears.values(), dtype)
    last_load_stats.clear()
    last_load_stats.update(
        bytes_read=stats.bytes_read if tp is not None else sum(p.stat().st_size for p in files),
        checkpoint_bytes=sum(p.stat().st_size for p in files),
        param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        # Peak resident memory while loading minus resident memory before (None where
        # /proc cannot reset the peak).
        peak_rss_growth=max(0, _peak_rss_bytes() - rss0) if rss0 is not None else None)
    return model


# What the last load_model in this process read, for the startup log and the tests.
last_load_stats: dict = {}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise ValueError(field)


def _reset_peak_rss() -> int | None:
    """Reset the process's peak resident memory to its current value (Linux: "5" to
    /proc/self/clear_refs) and return that value in bytes; None if not possible. A
    plain ru_maxrss would include peaks from before, even from before an exec."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return _status_kib("VmRSS") * 1024
    except (OSError, ValueError):
        return None


def _peak_rss_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def _quant_info(quant: QuantConfig | None, linears, dtype: torch.dtype) -> QuantInfo | None:
    if quant is None:
        return None
    actual = sum(p.numel() * p.element_size() for layer in linears for p in layer.parameters())
    dense = sum((layer.input_size_per_partition * sum(layer.output_partition_sizes)
                 + (layer.bias.numel() if layer.bias is not None else 0)) * _ELEM.get(dtype, 2)
                for layer in linears)
    return QuantInfo(quant.describe(), actual, dense, str(dtype).removeprefix("torch."))
