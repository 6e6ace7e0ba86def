"""The 4-bit checkpoint formats on a GPU, against HF transformers on the weights each
file means: a small Qwen2-shape model (hidden 512, 4 layers, weights std 0.3, so
greedy choices are not near ties), quantized by `pagefleet.server.testing_quant` with
its float32 dequantized twin, then greedy tokens from the engine (the GPU's int4
kernels: the Gluon / TMA GEMVs at 1-8 rows, the dequantize path for prefill) beside
HF's on the twin. The CPU suite checks the same formats through the torch twins; this
is the check that the GPU kernels serve each format's layout (compressed-tensors
W4A16's bf16 scales and zero points included).

    python3 benchmarks/quant_gpu_parity.py [format ...]   # results in $OUT/quant_gpu_parity.json

Formats: ct-sym, ct-asym (compressed-tensors W4A16, group 128), ct-channel, awq,
gptq-actorder. Each prints one line as it finishes.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

OUT = Path(os.environ.get("OUT", "/tmp/pagefleet-check"))
ROOT = Path("/dev/shm/pf-quant-parity")
FORMATS = {
    "ct-sym": ("compressed-tensors", dict(scheme="w4a16", group_size=128, sym=True)),
    "ct-asym": ("compressed-tensors", dict(scheme="w4a16", group_size=128, sym=False)),
    "ct-channel": ("compressed-tensors", dict(scheme="w4a16", group_size=-1, sym=True)),
    "awq": ("awq", dict(group_size=128)),
    "gptq-actorder": ("gptq", dict(group_size=128, desc_act=True)),
}
NEW_TOKENS = 16


def main() -> None:
    import torch
    from build_model import build
    from gpu_check import hf_greedy

    from pagefleet.server.engine.llm import LLM
    from pagefleet.server.engine.sampling_params import SamplingParams
    from pagefleet.server.testing_quant import quantize_checkpoint

    names = sys.argv[1:] or list(FORMATS)
    OUT.mkdir(parents=True, exist_ok=True)
    src = ROOT / "bf16"
    if not (src / "config.json").exists():
        build(src, hidden=512, layers=4, heads=8, kv_heads=2, intermediate=1024, vocab=32000,
              max_pos=4096, std=0.3)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 32000) for _ in range(n)] for n in (5, 17, 64, 130, 300, 9)]
    results = {}
    for name in names:
        fmt, kw = FORMATS[name]
        t0 = time.time()
        dst, ref = ROOT / name, ROOT / f"{name}-ref"
        quantize_checkpoint(src, dst, fmt, dequantized_dir=ref, device="cuda", **kw)
        llm = LLM(dst, max_model_len=1024, max_num_seqs=8)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                    ignore_eos=True))
        got = [list(o.outputs[0].token_ids) for o in outs]
        del llm
        torch.cuda.empty_cache()
        want = hf_greedy(ref, prompts, NEW_TOKENS)
        same = sum(g == w for g, w in zip(got, want))
        match = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) / (
            NEW_TOKENS * len(prompts))
        results[name] = {"sequences_equal": same, "of": len(prompts), "token_match": match,
                         "seconds": round(time.time() - t0, 1)}
        print(f"{name}: {same}/{len(prompts)} sequences equal HF's, token match {match:.3f} "
              f"({results[name]['seconds']} s)", flush=True)
        (OUT / "quant_gpu_parity.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
