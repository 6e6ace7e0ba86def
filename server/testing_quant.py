"""Write quantized checkpoints the way the quantization tools write them.

No quantized checkpoint can be downloaded here, so this turns an unquantized HF
checkpoint (bf16, fp16 or fp32 safetensors) into each supported format, with the
tools' tensor names, packing, dtypes and `quantization_config`:

| `fmt` | as written by | tensors per linear layer |
| --- | --- | --- |
| `awq` | AutoAWQ (`WQLinear_GEMM.from_linear`, `to_transformers_dict`) | `qweight`, `qzeros`, `scales`, `bias` |
| `gptq` | GPTQModel (`pack_block`, v2 -> v1 `qzeros`, `QuantizeConfig.to_dict`) | `qweight`, `qzeros`, `scales`, `g_idx`, `bias` |
| `fp8` | HF transformers (`Fp8Quantize`, `FineGrainedFP8Config`) | `weight` e4m3, `weight_scale_inv` |
| `compressed-tensors` | llm-compressor / compressed-tensors (FP8_DYNAMIC, FP8, FP8_BLOCK) | `weight` e4m3, `weight_scale` |
| `compressed-tensors`, `scheme="w4a16"` | llm-compressor / compressed-tensors (W4A16, W4A16_ASYM: the pack-quantized compressor) | `weight_packed`, `weight_scale`, `weight_shape` (, `weight_zero_point`, `weight_g_idx`) |

The weights are quantized by rounding to nearest (no calibration data exists here: no
AWQ scale search, no GPTQ error feedback), which changes how accurate the model is, not
the file format. For GPTQ act-order, the column order GPTQ takes from the Hessian's
diagonal comes from a seeded stand-in per input (so q/k/v, and gate/up, share one order
as they do in real checkpoints, since they read one input); the same for
compressed-tensors W4A16 with `desc_act=True` (older llm-compressor's `actorder: group`,
which stored `weight_g_idx`). compressed-tensors' `ignore` (`ignore=`, default
`["lm_head"]`) takes module names and `re:` patterns as llm-compressor's recipes do;
the projections it names are written unquantized.

`legacy=True` writes what the older tools wrote instead, which carried the config only
in a side file, with no `quant_method`: AutoGPTQ 0.4 (`BaseQuantizeConfig.to_dict()` in
quantize_config.json, one `gptq_model-4bit-{G}g.safetensors` with its metadata) and
AutoAWQ 0.1 (the `quant_config` dict given to `quantize()`, dumped as is to
quant_config.json); config.json then has no `quantization_config`.

`dequantized_dir` also writes the model the quantized file means, in float32 and
unquantized (`(q - z) * s`, `weight * scale`): HF transformers loads it as the
reference. Tensors are read and written one at a time; output shards hold at most
`shard_bytes`.

    python -m pagefleet.server.testing_quant SRC DST --format awq [--group-size 128]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pagefleet.server.ops.int4_packing import (AWQ_ORDER, ct_pack, gptq_v1_qzeros, pack_cols,
                                               pack_rows)

FORMATS = ("awq", "gptq", "fp8", "compressed-tensors")
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
_PROJ = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\."
                   r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")
# Which input each projection reads (act-order: one column order per input).
_INPUT = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "down"}
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


# -- per-format quantizers: (tensors for the file, dequantized float32 weight) ----------------

def awq_quantize(w: torch.Tensor, group_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """AutoAWQ's zero-point quantization (`pseudo_quantize_tensor`) and GEMM packing."""
    n, k = w.shape
    g = group_size if group_size > 0 else k
    if k % g:
        raise ValueError(f"AWQ needs in_features ({k}) to be a multiple of the group size ({g})")
    if n % 8:
        raise ValueError(f"AWQ needs out_features ({n}) to be a multiple of 8")
    wg = w.float().reshape(n, k // g, g)
    mx, mn = wg.amax(-1), wg.amin(-1)
    scales = ((mx - mn).clamp(min=1e-5) / 15).half()          # stored float16 [N, K/G]
    s = scales.float()
    zeros = (-torch.round(mn / s)).clamp(0, 15)
    q = (torch.round(wg / s[..., None]) + zeros[..., None]).clamp(0, 15)
    deq = ((q - zeros[..., None]) * s[..., None]).reshape(n, k)
    q = q.reshape(n, k).to(torch.int32)
    return {"qweight": pack_cols(q.t(), AWQ_ORDER),                   # [K, N/8]
            "qzeros": pack_cols(zeros.t().to(torch.int32), AWQ_ORDER),  # [K/G, N/8]
            "scales": scales.t().contiguous()}, deq                    # [K/G, N]


def act_order(k: int, seed: int, device) -> torch.Tensor:
    """GPTQ's `argsort(diag(H), descending=True)` with a seeded stand-in for diag(H)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    diag = torch.rand(k, generator=gen).to(device)
    return torch.argsort(diag, descending=True)


def gptq_quantize(w: torch.Tensor, group_size: int, sym: bool, perm: torch.Tensor | None,
                  v1: bool = True) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GPTQ's `Quantizer.find_params` per group (round to nearest) and GPTQModel's
    packing; with `perm` (act-order) the groups run over the permuted columns and
    `g_idx` maps each original column to its group."""
    n, k = w.shape
    if k % 8 or n % 8:
        raise ValueError(f"GPTQ packing needs both dims to be multiples of 8, got {n}x{k}")
    g = group_size if group_size > 0 else k
    maxq = 15
    wf = w.float()
    perm = perm if perm is not None else torch.arange(k, device=w.device)
    wp = wf[:, perm]
    ngroups = -(-k // g)
    scales = torch.empty(ngroups, n, device=w.device)
    zeros = torch.empty(ngroups, n, device=w.device)
    qp = torch.empty(n, k, device=w.device)
    for j in range(ngroups):
        cols = wp[:, j * g:(j + 1) * g]
        xmin = cols.amin(1).clamp(max=0)
        xmax = cols.amax(1).clamp(min=0)
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = torch.where(xmin < 0, -xmax, xmin)
        both0 = (xmin == 0) & (xmax == 0)
        xmin, xmax = torch.where(both0, -1.0, xmin), torch.where(both0, 1.0, xmax)
        scale = ((xmax - xmin) / maxq).half().float()           # the file stores float16
        zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale)
        qp[:, j * g:(j + 1) * g] = (torch.round(cols / scale[:, None]) + zero[:, None]).clamp(0, maxq)
        scales[j], zeros[j] = scale, zero
    q = torch.empty_like(qp)
    q[:, perm] = qp
    g_idx = torch.empty(k, dtype=torch.int32, device=w.device)
    g_idx[perm] = (torch.arange(k, device=w.device) // g).to(torch.int32)
    gi = g_idx.long()
    deq = (q - zeros[gi].t()) * scales[gi].t()
    zi = zeros.to(torch.int32)
    return {"qweight": pack_rows(q.t().to(torch.int32)),                # [K/8, N]
            "qzeros": gptq_v1_qzeros(zi) if v1 else pack_cols(zi),      # [G, N/8]
            "scales": scales.half(),                                    # [G, N]
            "g_idx": g_idx}, deq


def hf_fp8_quantize(w: torch.Tensor, block: tuple[int, int] | None
                    ) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
    """HF transformers' `Fp8Quantize`: per-block max-abs scales, `weight_scale_inv`
    float32 `[N / bm, K / bn]` (per tensor: `[1, 1]`). None where the shape does not
    tile, which HF leaves unquantized as well."""
    n, k = w.shape
    bm, bn = block or (n, k)
    if n % bm or k % bn:
        return None
    t = w.float().reshape(n // bm, bm, k // bn, bn)
    max_abs = t.abs().amax(dim=(1, 3))
    scales = torch.where(max_abs > 0, FP8_MAX / torch.where(max_abs > 0, max_abs, 1.0),
                         torch.ones_like(max_abs))
    inv = (1.0 / scales).float()
    q = (t * scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(n, k)
    deq = (q.float().reshape(n // bm, bm, k // bn, bn) * inv[:, None, :, None]).reshape(n, k)
    return {"weight": q, "weight_scale_inv": inv}, deq


def ct_fp8_quantize(w: torch.Tensor, strategy: str, block: tuple[int, int] | None,
                    scale_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors' symmetric fp8: scale = max|w| / 448 over the tensor, each
    output channel or each block, stored in the model's dtype, `weight / scale` cast."""
    n, k = w.shape
    wf = w.float()
    if strategy == "tensor":
        amax = wf.abs().amax().reshape(1)
        expand = lambda s: s.reshape(1, 1)   # noqa: E731
    elif strategy == "channel":
        amax = wf.abs().amax(1, keepdim=True)
        expand = lambda s: s                 # noqa: E731
    elif strategy == "block":
        bn, bk = block
        pn, pk = -(-n // bn) * bn, -(-k // bk) * bk
        padded = torch.zeros(pn, pk, device=w.device)
        padded[:n, :k] = wf.abs()
        amax = padded.reshape(pn // bn, bn, pk // bk, bk).amax(dim=(1, 3))
        expand = lambda s: s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]  # noqa: E731
    else:
        raise ValueError(f"strategy {strategy!r}")
    scale = (amax / FP8_MAX).clamp_min(torch.finfo(scale_dtype).eps).to(scale_dtype)
    sf = expand(scale.float())
    q = (wf / sf).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return {"weight": q, "weight_scale": scale}, q.float() * sf


def ct_w4_quantize(w: torch.Tensor, group_size: int, sym: bool, scale_dtype: torch.dtype,
                   perm: torch.Tensor | None = None
                   ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors' int4 weights (W4A16 / W4A16_ASYM; the min-max observer's
    `calculate_qparams`, round to nearest) as its pack-quantized compressor stores them.
    Values q in -8..7; symmetric: scale = max|w| / 7.5, no zero point; asymmetric:
    scale = (max - min) / 15, zero point round(-8 - min / scale) in -8..7; the weight
    is (q - zero) * scale. `group_size` -1: the channel strategy (one group a row).
    `perm` (act-order): the groups run over the permuted columns, `weight_g_idx` maps
    each original column to its group."""
    n, k = w.shape
    g = group_size if group_size > 0 else k
    if k % g:   # compressed-tensors' _process_group refuses it too
        raise ValueError(f"compressed-tensors needs in_features ({k}) to be a multiple of "
                         f"the group size ({g})")
    wf = w.float() if perm is None else w.float()[:, perm]
    wg = wf.reshape(n, k // g, g)
    mn, mx = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    scale = (torch.maximum(mn.abs(), mx) / 7.5 if sym else (mx - mn) / 15).to(scale_dtype)
    scale = torch.where(scale == 0, torch.finfo(scale_dtype).eps, scale.float()).to(scale_dtype)
    s = scale.float()
    zp = torch.zeros_like(s) if sym else torch.round(-8 - mn / s).clamp(-8, 7)
    qg = torch.round(wg / s[..., None] + zp[..., None]).clamp(-8, 7)
    qp = qg.reshape(n, k)
    deqp = ((qg - zp[..., None]) * s[..., None]).reshape(n, k)
    tensors = {}
    if perm is None:
        q, deq = qp, deqp
    else:
        q, deq = torch.empty_like(qp), torch.empty_like(deqp)
        q[:, perm], deq[:, perm] = qp, deqp
    tensors["weight_packed"] = ct_pack(q.to(torch.int8), dim=1)            # [N, K/8]
    tensors["weight_scale"] = scale                                         # [N, K/G]
    tensors["weight_shape"] = torch.tensor([n, k])                          # int64
    if not sym:
        tensors["weight_zero_point"] = ct_pack(zp.to(torch.int8), dim=0)    # [N/8, K/G]
    if perm is not None:
        g_idx = torch.empty(k, dtype=torch.int32, device=w.device)
        g_idx[perm] = (torch.arange(k, device=w.device) // g).to(torch.int32)
        tensors["weight_g_idx"] = g_idx
    return tensors, deq


def ct_ignored(module: str, ignore: list[str]) -> bool:
    """Whether compressed-tensors' `ignore` names this module (a name, or `re:` a
    pattern matched from the start, as its `match_name` does)."""
    return any(re.match(e[3:], module) if e.startswith("re:") else e == module
               for e in ignore)


# -- quantization_config as each tool writes it -------------------------------------------------

def awq_config(group_size: int) -> dict:
    return {"quant_method": "awq", "zero_point": True, "group_size": group_size, "bits": 4,
            "version": "gemm", "modules_to_not_convert": None}


def autoawq_legacy_config(group_size: int) -> dict:
    """AutoAWQ 0.1's quant_config.json: `json.dumps(self.quant_config)`, the dict its
    README passes to `model.quantize(tokenizer, quant_config=...)`."""
    return {"zero_point": True, "q_group_size": group_size, "w_bit": 4, "version": "GEMM"}


def autogptq_legacy_config(group_size: int, sym: bool, desc_act: bool) -> dict:
    """AutoGPTQ 0.4's quantize_config.json: `BaseQuantizeConfig.to_dict()` as
    `save_quantized` writes it (before it sets model_name_or_path and the file name)."""
    return {"bits": 4, "group_size": group_size, "damp_percent": 0.01, "desc_act": desc_act,
            "static_groups": False, "sym": sym, "true_sequential": True,
            "model_name_or_path": None, "model_file_base_name": None}


def gptq_config(group_size: int, sym: bool, desc_act: bool, checkpoint_format: str) -> dict:
    return {"bits": 4, "group_size": group_size, "desc_act": desc_act, "lm_head": False,
            "method": "gptq", "quant_method": "gptq", "format": checkpoint_format,
            "checkpoint_format": checkpoint_format, "pack_dtype": "int32", "sym": sym,
            "meta": {"quantizer": ["pagefleet.testing_quant:0.1.0"], "damp_percent": 0.05,
                     "damp_auto_increment": 0.01, "static_groups": False,
                     "true_sequential": True, "mse": 0.0, "act_group_aware": False}}


def hf_fp8_config(block: tuple[int, int] | None) -> dict:
    from transformers import FineGrainedFP8Config

    cfg = FineGrainedFP8Config(weight_block_size=block, activation_scheme="dynamic")
    return json.loads(json.dumps(cfg.to_dict()))


def _ct_args(**kw) -> dict:
    """compressed-tensors' QuantizationArgs, every field as it serializes them."""
    base = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
            "strategy": None, "block_structure": None, "dynamic": False, "actorder": None,
            "scale_dtype": None, "zp_dtype": None, "observer": None, "observer_kwargs": {}}
    base.update(kw)
    return base


def _ct_quantization_config(group: dict, fmt: str, ignore: list[str]) -> dict:
    return {
        "config_groups": {"group_0": dict(group, format=fmt)},
        "format": fmt, "global_compression_ratio": None, "ignore": list(ignore),
        "kv_cache_scheme": None, "quant_method": "compressed-tensors",
        "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
        "version": "0.20.1"}


def ct_config(strategy: str, block: tuple[int, int] | None, scale_dtype: torch.dtype,
              ignore: list[str] = ("lm_head",)) -> dict:
    weights = _ct_args(strategy=strategy,
                       block_structure=list(block) if strategy == "block" else None,
                       observer="minmax")
    if strategy == "block":
        acts = _ct_args(strategy="group", group_size=block[1], dynamic=True)
    else:
        acts = _ct_args(strategy="token", dynamic=True)
    return _ct_quantization_config({"targets": ["Linear"], "weights": weights,
                                    "input_activations": acts, "output_activations": None},
                                   "float-quantized", ignore)


def ct_w4_config(group_size: int, sym: bool, actorder: bool,
                 ignore: list[str] = ("lm_head",)) -> dict:
    """llm-compressor's W4A16 (symmetric) / W4A16_ASYM presets, or the channel strategy
    (`group_size` -1); `actorder`: older llm-compressor's `actorder: group`."""
    weights = _ct_args(num_bits=4, type="int", symmetric=sym,
                       group_size=group_size if group_size > 0 else None,
                       strategy="group" if group_size > 0 else "channel",
                       actorder="group" if actorder else None, observer="minmax")
    return _ct_quantization_config({"targets": ["Linear"], "weights": weights,
                                    "input_activations": None, "output_activations": None},
                                   "pack-quantized", ignore)


# -- the writer ------------------------------------------------------------------------------

class ShardWriter:
    """Collects tensors into safetensors shards of at most `shard_bytes`, with an index."""

    def __init__(self, path: Path, shard_bytes: int, single_name: str = "model.safetensors",
                 metadata: dict[str, str] | None = None) -> None:
        self.path, self.shard_bytes = path, shard_bytes
        self.single_name, self.metadata = single_name, {"format": "pt", **(metadata or {})}
        path.mkdir(parents=True, exist_ok=True)
        self.shards: list[dict[str, torch.Tensor]] = [{}]
        self.size = 0
        self.files: list[str] = []
        self.weight_map: dict[str, str] = {}
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.size + nbytes > self.shard_bytes and self.shards[-1]:
            self._flush()
        self.shards[-1][name] = t.detach().contiguous().cpu()
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        part = self.shards.pop()
        tmp = f"part-{len(self.files):05d}.safetensors"
        save_file(part, str(self.path / tmp), metadata=self.metadata)
        self.files.append(tmp)
        self.weight_map.update({n: tmp for n in part})
        self.shards.append({})
        self.size = 0

    def close(self) -> None:
        if self.shards[-1] or not self.files:
            self._flush()
        n = len(self.files)
        if n == 1:
            (self.path / self.files[0]).rename(self.path / self.single_name)
            return
        names = {f: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, f in enumerate(self.files)}
        for old, new in names.items():
            (self.path / old).rename(self.path / new)
        index = {"metadata": {"total_size": self.total},
                 "weight_map": {k: names[v] for k, v in self.weight_map.items()}}
        (self.path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _source_files(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.exists():
        return [src / f for f in dict.fromkeys(json.loads(index.read_text())["weight_map"].values())]
    return sorted(src.glob("*.safetensors"))


def _copy_side_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (
                "config.json", "model.safetensors.index.json", "quantize_config.json",
                "quant_config.json"):
            shutil.copy2(f, dst / f.name)


def quantize_checkpoint(src: str | Path, dst: str | Path, fmt: str, *, group_size: int = 128,
                        sym: bool = True, desc_act: bool = False,
                        checkpoint_format: str = "gptq",
                        block: tuple[int, int] | None = (128, 128), strategy: str = "channel",
                        dtype: torch.dtype | None = None,
                        dequantized_dir: str | Path | None = None, device: str = "cpu",
                        shard_bytes: int = 4 << 30, seed: int = 0, legacy: bool = False,
                        scheme: str = "fp8", ignore: list[str] = ("lm_head",)) -> Path:
    """Write `src` quantized to `fmt` into `dst` (see the module docstring).

    `dtype`: the dtype of everything left unquantized (and of scales where the format
    takes the model's dtype); default float16 for AWQ/GPTQ (as those tools save) and the
    source dtype for the fp8 formats. `block`: fp8 weight blocks (None: per tensor, for
    `fp8`); `strategy`: compressed-tensors' weight strategy (tensor, channel, block).
    `legacy`: AWQ and GPTQ (v1 zero points) with the older tools' side file only (see
    the module docstring). compressed-tensors: `scheme` fp8 or w4a16 (4-bit int
    weights: `group_size` (-1: channel), `sym`, `desc_act` for `actorder: group`), and
    `ignore`, the modules left unquantized."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}")
    if scheme not in ("fp8", "w4a16"):
        raise ValueError("scheme must be fp8 or w4a16 (compressed-tensors)")
    w4 = fmt == "compressed-tensors" and scheme == "w4a16"
    if legacy and (fmt not in ("awq", "gptq") or checkpoint_format != "gptq"):
        raise ValueError("legacy: AutoAWQ 0.1 or AutoGPTQ 0.4 (v1 zero points) files only")
    src, dst = Path(src), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    src_dtype = {v: k for k, v in _DTYPE_NAMES.items()}.get(
        cfg.get("torch_dtype") or cfg.get("dtype"), torch.bfloat16)
    out_dtype = dtype or (torch.float16 if fmt in ("awq", "gptq") else src_dtype)
    _copy_side_files(src, dst)
    if legacy and fmt == "gptq":   # AutoGPTQ 0.4's save_quantized: one file, its metadata
        writer = ShardWriter(dst, 1 << 62, f"gptq_model-4bit-{group_size}g.safetensors", {
            "auto_gptq_version": "0.4.2", "gptq_bits": "4", "gptq_group_size": str(group_size),
            "gptq_desc_act": str(desc_act), "gptq_damp_percent": "0.01"})
    else:
        writer = ShardWriter(dst, shard_bytes)
    ref = ShardWriter(Path(dequantized_dir), shard_bytes) if dequantized_dir else None
    if ref is not None:
        _copy_side_files(src, Path(dequantized_dir))
    perms: dict[tuple[int, str], torch.Tensor] = {}
    for path in _source_files(src):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                t = f.get_tensor(name).to(device)
                m = _PROJ.match(name)
                out = None
                prefix = name[:-len(".weight")]
                if m is not None and not (fmt == "compressed-tensors" and
                                          ct_ignored(prefix, ignore)):
                    w = t.to(out_dtype).float()   # the tool sees the model in its dtype
                    if fmt == "awq":
                        out = awq_quantize(w, group_size)
                    elif fmt == "gptq" or w4:
                        perm = None
                        if desc_act:
                            key = (int(m.group(1)), _INPUT[m.group(3)])
                            if key not in perms:
                                s = zlib.crc32(f"{seed}:{key}".encode())
                                perms[key] = act_order(w.shape[1], s, w.device)
                            perm = perms[key]
                        out = (ct_w4_quantize(w, group_size, sym, out_dtype, perm) if w4 else
                               gptq_quantize(w, group_size, sym, perm, checkpoint_format == "gptq"))
                    elif fmt == "fp8":
                        out = hf_fp8_quantize(w, block)
                    else:
                        out = ct_fp8_quantize(w, strategy, block if strategy == "block" else None,
                                              out_dtype)
                if out is None:
                    kept = t.to(out_dtype) if t.is_floating_point() else t
                    writer.add(name, kept)
                    if ref is not None:
                        ref.add(name, kept.float() if kept.is_floating_point() else kept)
                    continue
                tensors, deq = out
                for suffix, value in tensors.items():
                    writer.add(f"{prefix}.{suffix}", value)
                if ref is not None:
                    ref.add(name, deq.float())
    writer.close()
    qcfg = {"awq": lambda: awq_config(group_size),
            "gptq": lambda: gptq_config(group_size, sym, desc_act, checkpoint_format),
            "fp8": lambda: hf_fp8_config(block),
            "compressed-tensors": lambda: (ct_w4_config(group_size, sym, desc_act, ignore) if w4
                                           else ct_config(strategy, block, out_dtype, ignore)),
            }[fmt]()
    out_cfg = dict(cfg, torch_dtype=_DTYPE_NAMES[out_dtype], quantization_config=qcfg)
    out_cfg.pop("dtype", None)
    if legacy:   # the old tools left config.json as transformers saved it
        del out_cfg["quantization_config"]
        side, qcfg = (("quant_config.json", autoawq_legacy_config(group_size)) if fmt == "awq"
                      else ("quantize_config.json",
                            autogptq_legacy_config(group_size, sym, desc_act)))
        (dst / side).write_text(json.dumps(qcfg, indent=4 if fmt == "awq" else 2))
    (dst / "config.json").write_text(json.dumps(out_cfg, indent=2))
    if fmt == "gptq" and not legacy:   # GPTQModel writes its config beside config.json too
        (dst / "quantize_config.json").write_text(json.dumps(qcfg, indent=2))
    if ref is not None:
        ref.close()
        ref_cfg = dict(cfg, torch_dtype="float32")
        ref_cfg.pop("dtype", None)
        (Path(dequantized_dir) / "config.json").write_text(json.dumps(ref_cfg, indent=2))
    return dst


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Quantize an HF checkpoint to AWQ, GPTQ, fp8 or "
                                 "compressed-tensors (fp8, W4A16) files as the standard tools "
                                 "write them (round to nearest).")
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--format", choices=FORMATS, required=True)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--asym", action="store_true", help="GPTQ sym=false; compressed-tensors "
                    "w4a16: W4A16_ASYM (zero points)")
    ap.add_argument("--desc-act", action="store_true", help="GPTQ act-order (compressed-tensors "
                    "w4a16: actorder group)")
    ap.add_argument("--scheme", default="fp8", choices=("fp8", "w4a16"),
                    help="compressed-tensors: fp8 weights or 4-bit int weights "
                    "(pack-quantized; --group-size -1: channel)")
    ap.add_argument("--checkpoint-format", default="gptq", choices=("gptq", "gptq_v2"))
    ap.add_argument("--block", default="128,128", help="fp8 weight block, or 'none'")
    ap.add_argument("--strategy", default="channel", choices=("tensor", "channel", "block"))
    ap.add_argument("--legacy", action="store_true", help="awq/gptq as AutoAWQ 0.1 / "
                    "AutoGPTQ 0.4 wrote them: the config only in a side file, no quant_method")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    block = None if a.block == "none" else tuple(int(x) for x in a.block.split(","))
    quantize_checkpoint(a.src, a.dst, a.format, group_size=a.group_size, sym=not a.asym,
                        desc_act=a.desc_act, checkpoint_format=a.checkpoint_format, block=block,
                        strategy=a.strategy, device=a.device, legacy=a.legacy,
                        scheme=a.scheme)
    print(f"wrote {a.dst}")


if __name__ == "__main__":
    main()
