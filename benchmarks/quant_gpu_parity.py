"""The 4-bit checkpoint formats on a GPU, against HF transformers on the weights each
file means: a small Qwen2-shape model, quantized by `pagefleet.server.testing_quant`
with its float32 dequantized twin; the engine serves the quantized file (the GPU's int4
kernels: the Gluon / TMA GEMVs at 1-8 rows, the dequantize path for prefill) and, as
the baseline, the twin itself in the same 16-bit dtype (dense GEMMs).

Why not greedy tokens against HF in float32: the engine computes in fp16 / bf16 (the
int4 kernels have no float32 form), so on random weights a greedy run leaves float32's
path at the first near-tie and every later token differs; the first version of this
script did exactly that on an H100 (twenty-seventh session: 0-2 of 6 sequences equal for
every format, the dense bf16 twin as bad). Here each generated position is scored
teacher-forced: HF float32 reads the engine's own sequence, and the engine's top-20
logprobs at each step are compared with HF's for the same tokens. A layout error (a
nibble order, a zero point, a group's scale) moves logprobs by whole nats; 16-bit
rounding by hundredths, and the dense twin in the same dtype says how much.

A format passes when its worst logprob error is at most twice the dense twin's plus
0.05 and its greedy choice is HF's argmax at least as often as the twin's, less 5
points. The model's weights have std 0.05 (hidden 512: about unit gain a layer), so
16-bit rounding does not blow up through the layers.

    python3 benchmarks/quant_gpu_parity.py [format ...]   # $OUT/quant_gpu_parity.json; rc 1 on a failure

Formats: ct-sym, ct-asym (compressed-tensors W4A16, group 128), ct-channel, awq,
gptq-actorder. Each prints one line as it finishes. Prompts run together (5-8 decode
rows: the cp.async-ring / MMA GEMVs) and the first one alone (one row: the TMA GEMV).
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
FORMATS = {   # name: (format, quantize_checkpoint kwargs, the engine's dtype)
    "ct-sym": ("compressed-tensors", dict(scheme="w4a16", group_size=128, sym=True),
               "bfloat16"),
    "ct-asym": ("compressed-tensors", dict(scheme="w4a16", group_size=128, sym=False),
                "bfloat16"),
    "ct-channel": ("compressed-tensors", dict(scheme="w4a16", group_size=-1, sym=True),
                   "bfloat16"),
    "awq": ("awq", dict(group_size=128), "float16"),
    "gptq-actorder": ("gptq", dict(group_size=128, desc_act=True), "float16"),
}
NEW_TOKENS = 16
TOP = 20


def _device() -> str:
    """cuda; the CPU only for a dry run of the script's steps."""
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_run(path: Path, dtype: str, prompts: list[list[int]]) -> list[tuple]:
    """(prompt, generated tokens, per-step {token: logprob}) for the prompts run together,
    then the first one alone."""
    import torch

    from pagefleet.server.engine.llm import LLM
    from pagefleet.server.engine.sampling_params import SamplingParams
    llm = LLM(str(path), dtype=dtype, max_model_len=1024, max_num_seqs=8)
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
    runs = []
    for batch in (prompts, prompts[:1]):
        for p, o in zip(batch, llm.generate(batch, sp)):
            c = o.outputs[0]
            runs.append((p, list(c.token_ids), c.logprobs))
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return runs


def score(ref_dir: Path, runs: list[tuple]) -> dict:
    """Teacher-forced against HF float32 on the twin: the worst and mean |logprob error|
    over the engine's top-20 at every generated position, and how often the engine's
    token is HF's argmax."""
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32).to(_device()).eval()
    worst, total, count, agree, steps = 0.0, 0.0, 0, 0, 0
    with torch.inference_mode():
        for p, toks, lps in runs:
            ids = torch.tensor([p + toks], device=_device())
            ref = torch.log_softmax(m(input_ids=ids).logits[0].float(), -1)
            for i, (tok, lp) in enumerate(zip(toks, lps)):
                row = ref[len(p) - 1 + i]
                agree += int(int(row.argmax()) == tok)
                steps += 1
                for t, v in lp.items():
                    err = abs(float(v) - float(row[t]))
                    worst, total, count = max(worst, err), total + err, count + 1
    del m
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"worst": round(worst, 4), "mean": round(total / max(count, 1), 5),
            "argmax_agree": round(agree / max(steps, 1), 3)}


def main() -> int:
    from build_model import build

    from pagefleet.server.testing_quant import quantize_checkpoint

    names = sys.argv[1:] or list(FORMATS)
    OUT.mkdir(parents=True, exist_ok=True)
    src = ROOT / "bf16-s05"
    if not (src / "config.json").exists():
        build(src, hidden=512, layers=4, heads=8, kv_heads=2, intermediate=1024, vocab=32000,
              max_pos=4096, std=0.05)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 32000) for _ in range(n)] for n in (5, 17, 64, 130, 300, 9)]
    results, failed = {}, 0
    for name in names:
        fmt, kw, dtype = FORMATS[name]
        t0 = time.time()
        dst, ref = ROOT / name, ROOT / f"{name}-ref"
        quantize_checkpoint(src, dst, fmt, dequantized_dir=ref, device=_device(), **kw)
        quant = score(ref, engine_run(dst, dtype, prompts))
        dense = score(ref, engine_run(ref, dtype, prompts))
        ok = (quant["worst"] <= 2 * dense["worst"] + 0.05
              and quant["argmax_agree"] >= dense["argmax_agree"] - 0.05)
        failed += not ok
        results[name] = {"pass": ok, "quantized": quant, "dense_twin": dense, "dtype": dtype,
                         "seconds": round(time.time() - t0, 1)}
        print(f"{name} ({dtype}): {'pass' if ok else 'FAIL'}; logprob error worst / mean "
              f"{quant['worst']} / {quant['mean']} (dense twin {dense['worst']} / "
              f"{dense['mean']}); argmax agreement {quant['argmax_agree']} (twin "
              f"{dense['argmax_agree']}) ({results[name]['seconds']} s)", flush=True)
        (OUT / "quant_gpu_parity.json").write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
