"""The B=1 quantized GEMVs of a whole decode step, variant against variant, on one GPU.

A decode step at batch 1 reads every linear layer's weights once: 28 decoder layers x
(qkv, o, gate_up, down) of a Qwen2.5-7B shape. This builds that many distinct weights
(random: fp8 e4m3 with row scales, and AWQ-layout int4 with 128-row groups), so nothing
is served from L2 as it would be if one layer were timed over and over, captures the
step's 112 GEMVs (the down projections with SiLU-and-mul as the engine runs them) in
one CUDA graph with the process's PDL mode, and times its replay for each variant of
FP8_CONFIG / W4_CONFIG below. Each variant's output is compared with the first one's:
variants that move loads or where the K splits are summed give the same bits; tiles,
accumulator chunks and split counts sum in another order. A variant's "module" key
times another version of server/ops/triton_quant.py (its own configs, loaded beside
the current one), so a change to the kernels' code is timed against the code before it
on the same machine:

    git show HEAD~1:server/ops/triton_quant.py > .ab/tq_before.py     # .ab/ carried
    GEMV_VARIANTS='[{"module": ".ab/tq_before.py"}, {}, ...]' OUT=$OUT python3 ...

    OUT=$OUT python3 benchmarks/gemv_step_ab.py [fp8,w4]   # a table; $OUT/gemv_step_ab.json
                                                           # ("best": the fastest variants)

It runs the 112 GEMVs back to back, where the engine puts norms, rotary and attention
between them, and the two have disagreed (2026-12-03, fourth session: 8 programs an SM
for qkv / o slower here, faster in the engine; tiled words 3.6% faster here, equal in
the engine). Use it to look inside a change; decide with the engine's decode graph
(`run_quant.sh --phases engine_awq --tuned ...`, alternated on one machine).

GEMV_M=2 times a B=2 step's GEMVs instead. GEMV_SHAPES=1 also times each shape's 28
GEMVs in a graph of their own, beside a kernel that only reads the same bytes in the
same graph layout (`read floor`): the step's time split by layer shape, and how far
each shape is from streaming its bytes.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import log, median_ms  # noqa: E402

LAYERS = 28
# (N, K) of one Qwen2.5-7B decoder layer's linear layers; gate_up's output feeds down
SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584),
          "down": (3584, 18944)}
VARIANTS = {
    # the first is the shipped config; programs per SM and tile sizes change the splits or
    # the order of the sums (other bits)
    "fp8": [{}, {"gemv_kchunk": 1, "gemv_block_n": 16, "gemv_block_k": 512,
                 "gemv_programs_per_sm": 4},          # shipped until 2026-12-02 (night)
            {"fused_reduce": False}, {"gemv_kchunk": 8}, {"gemv_programs_per_sm": 6},
            {"gemv_programs_per_sm": 12}, {"gemv_block_n": 64, "gemv_block_k": 128},
            {"gemv_block_n": 32, "gemv_block_k": 512}, {"gemv_block_n": 16, "gemv_block_k": 256},
            {"gemv_block_n": 64, "gemv_block_k": 256, "gemv_warps": 8}, {"gemv_warps": 2},
            {"gemv_block_n": 32, "gemv_block_k": 128, "gemv_warps": 2}],
    # w4, 2026-12-03: column tiles a program (the activations loaded and scaled once for
    # all of them; since removed) cut SASS a nibble from 7.1 to 4.9 at 4 tiles but ran
    # slower (2.71 against 2.25 ms: 80 registers, fewer K iterations a program): the loop
    # waits on its loads, not on issue. So the next K tile's words loaded a step ahead
    # (`gemv_prefetch`, 40 registers at 16 x 256; shipped since: 2.22 against 2.62 ms on
    # one machine), and the tiles and split targets around it. 2026-12-03 (third
    # session): the scales and zero points a step ahead too (`gemv_prefetch` 2) and the
    # wide layers at 512-row tiles, shipped; the variants below are the steps back.
    "w4": [{}, {"gemv_prefetch": 1}, {"gemv_prefetch": 0}, {"gemv_wide": {"gemv_warps": 2}},
           {"gemv_programs_per_sm": 8}, {"gemv_programs_per_sm": 16}],
}


def _fp8_layers(torch, quant):
    layers = []
    for i in range(LAYERS):
        layer = {}
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            layer[name] = quant.quantize_fp8_rows(w)
            del w
        layers.append(layer)
    return layers


def _w4_layers(torch):
    layers = []
    for i in range(LAYERS):
        layer = {}
        for name, (n, k) in SHAPES.items():
            qw = torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), device="cuda", dtype=torch.int32)
            s = (torch.rand(k // 128, n, device="cuda") * 0.01 + 0.001).half()
            z = torch.randint(0, 16, (k // 128, n), device="cuda", dtype=torch.uint8)
            layer[name] = (qw, s, z)
        layers.append(layer)
    return layers


def _step(fmt, tq, layers, xs):
    """The step's GEMVs in engine order; returns the last layer's outputs."""
    outs = []
    for layer in layers:
        outs = []
        for name, (n, k) in SHAPES.items():
            if fmt == "fp8":
                w, ws = layer[name]
                if name == "down":
                    outs.append(tq.fp8_silu_linear(xs["gate_up2"], w, ws, (1, k)))
                else:
                    outs.append(tq.fp8_linear(xs[name], w, ws, (1, k)))
            else:
                qw, s, z = layer[name]
                outs.append(tq.w4a16_linear(xs[name], qw, s, z, 128))
    return outs


_READ_US: dict = {}


@functools.cache
def _read_floor_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _read(src, out, n, BLOCK: tl.constexpr):
        # Each program sums a stride of BLOCK-word chunks and writes one word: reads every
        # byte once, writes almost nothing.
        pid = tl.program_id(0)
        acc = tl.zeros((BLOCK,), dtype=tl.int32)
        for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(src + offs, mask=offs < n, other=0)
        tl.store(out + pid, tl.sum(acc, axis=0))
    return _read


def _per_shape(fmt, mod, layers, xs, torch) -> dict:
    """Each shape's 28 GEMVs in one graph, and a read of the same weights' bytes."""
    res = {}
    read = _read_floor_kernel()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sink = torch.empty(sms * 8, device="cuda", dtype=torch.int32)
    for name, (n, k) in SHAPES.items():
        def gemvs():
            for layer in layers:
                if fmt == "fp8":
                    w, ws = layer[name]
                    mod.fp8_linear(xs[name], w, ws, (1, k))
                else:
                    qw, s, z = layer[name]
                    mod.w4a16_linear(xs[name], qw, s, z, 128)

        def reads():
            for layer in layers:
                w = layer[name][0].view(torch.int32).reshape(-1)
                read[(sms * 8,)](w, sink, w.numel(), BLOCK=1024)
        row = {}
        for label, fn in (("gemv", gemvs), ("read", reads)):
            if label == "read" and (fmt, name) in _READ_US:   # the same bytes each variant
                row["read_us"] = _READ_US[fmt, name]
                continue
            fn()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            row[f"{label}_us"] = median_ms(g.replay, n=30) * 1e3 / LAYERS
            del g
        _READ_US[fmt, name] = row["read_us"]
        wbytes = layers[0][name][0].numel() * layers[0][name][0].element_size()
        row["weight_MB"] = wbytes / 1e6
        row["gemv_TBps"] = wbytes / row["gemv_us"] / 1e6
        row["read_TBps"] = wbytes / row["read_us"] / 1e6
        res[name] = row
        log(f"  {name:8s} {row['weight_MB']:6.1f} MB  gemv {row['gemv_us']:6.1f} us "
            f"({row['gemv_TBps']:.2f} TB/s)  read {row['read_us']:6.1f} us "
            f"({row['read_TBps']:.2f} TB/s)")
    return res


def _kernels(var: dict, tq, loaded: dict):
    """The kernels module a variant times: `tq`, or the file its "module" names."""
    path = var.get("module")
    if not path:
        return tq
    if path not in loaded:
        name = f"pagefleet.server.ops._gemv_ab{len(loaded)}"
        spec = importlib.util.spec_from_file_location(name, path)
        loaded[path] = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded[path])
    return loaded[path]


def main() -> None:
    import torch

    from pagefleet.server.ops import quant
    from pagefleet.server.ops import triton_quant as tq
    fmts = sys.argv[1].split(",") if len(sys.argv) > 1 else ["fp8", "w4"]
    out_dir = Path(os.environ.get("OUT", "/tmp/pagefleet-bench"))
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    batch = int(os.environ.get("GEMV_M", "1"))   # GEMV_M=2 times a B=2 step
    xs = {name: torch.randn(batch, k, device="cuda", dtype=torch.bfloat16)
          for name, (n, k) in SHAPES.items()}
    xs["gate_up2"] = torch.randn(batch, 2 * SHAPES["down"][1], device="cuda",
                                 dtype=torch.bfloat16)
    rows = []
    loaded: dict = {}
    for fmt in fmts:
        layers = _fp8_layers(torch, quant) if fmt == "fp8" else _w4_layers(torch)
        per_layer = sum(n * k for n, k in SHAPES.values())
        nbytes = LAYERS * per_layer * (1 if fmt == "fp8" else 0.5 + 3 / 128)
        ref = None
        variants = VARIANTS[fmt]
        if os.environ.get("GEMV_VARIANTS"):   # a JSON list of config dicts, in timing order
            variants = json.loads(os.environ["GEMV_VARIANTS"])
        for var in variants:
            row = {"format": fmt, "variant": var or "shipped"}
            cfg, base = {}, {}
            try:
                mod = _kernels(var, tq, loaded)
                cfg = mod.FP8_CONFIG if fmt == "fp8" else mod.W4_CONFIG
                base = dict(cfg)
                cfg.update({k: v for k, v in var.items() if k != "module"})
                out = _step(fmt, mod, layers, xs)          # compiles, allocates counters
                torch.cuda.synchronize()
                ref = ref or out
                row["bit_identical"] = all(torch.equal(a, b) for a, b in zip(out, ref))
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    _step(fmt, mod, layers, xs)
                row["step_gemv_ms"] = median_ms(g.replay, n=30)
                row["TBps"] = nbytes / (row["step_gemv_ms"] / 1e3) / 1e12
                del g
                if os.environ.get("GEMV_SHAPES"):
                    row["per_shape"] = _per_shape(fmt, mod, layers, xs, torch)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile
                row["error"] = repr(e)[:300]
            finally:
                cfg.clear()
                cfg.update(base)
            log(f"gemv step {row}")
            rows.append(row)
            (out_dir / "gemv_step_ab.json").write_text(json.dumps({"rows": rows}, indent=1))
        del layers
        torch.cuda.empty_cache()
    for r in rows:
        print(f"{r['format']:4s} {json.dumps(r['variant']):48s} "
              f"{r.get('step_gemv_ms', float('nan')):7.3f} ms  {r.get('TBps', 0):5.2f} TB/s  "
              f"same bits: {r.get('bit_identical')}  {r.get('error', '')}")
    best = {}
    for fmt in fmts:
        ok = [r for r in rows if r["format"] == fmt and "step_gemv_ms" in r]
        if ok:
            pick = min(ok, key=lambda r: r["step_gemv_ms"])
            best["FP8_CONFIG" if fmt == "fp8" else "W4_CONFIG"] = \
                pick["variant"] if isinstance(pick["variant"], dict) else {}
    print(f"best: {json.dumps(best)}")
    (out_dir / "gemv_step_ab.json").write_text(json.dumps({"rows": rows, "best": best},
                                                          indent=1))


if __name__ == "__main__":
    main()
