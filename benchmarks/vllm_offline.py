"""vLLM's offline `LLM` on the same workload as pagefleet's offline figure (1,024 x 512 in /
256 out, greedy, ignore_eos, token-id prompts) and a single-request decode (512 in / 256
out: time per output token), with vLLM's own defaults unless flags are given. Run on the
device with vLLM carried by ../shared/tools/vllm-on-device (see benchmarks/README.md).

    python3 benchmarks/vllm_offline.py MODEL_DIR --out result.json [--quantization fp8]
"""

from __future__ import annotations

import argparse
import json
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-requests", type=int, default=1024)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    kw = {"quantization": args.quantization} if args.quantization else {}
    if args.max_model_len:
        kw["max_model_len"] = args.max_model_len
    llm = LLM(args.model, gpu_memory_utilization=args.gpu_memory_utilization, **kw)
    res = {"startup_s": time.time() - t0, "quantization": args.quantization}
    cfg = llm.llm_engine.vllm_config.scheduler_config
    res["defaults"] = {"max_num_seqs": cfg.max_num_seqs,
                       "max_num_batched_tokens": cfg.max_num_batched_tokens}
    rng = random.Random(21)

    def prompts(n, length):
        return [TokensPrompt(prompt_token_ids=[rng.randrange(10, 151000) for _ in range(length)])
                for _ in range(n)]
    p = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate(prompts(8, 512), p, use_tqdm=False)          # warm-up
    t0 = time.perf_counter()
    one = llm.generate(prompts(1, 512), p, use_tqdm=False)[0]
    dt = time.perf_counter() - t0
    m = one.metrics
    res["b1_s"] = dt
    res["b1_tpot_ms"] = 1e3 * dt / 256          # upper bound (includes the prefill)
    if m is not None and getattr(m, "first_token_time", None) and getattr(m, "last_token_time", None):
        res["b1_tpot_ms"] = 1e3 * (m.last_token_time - m.first_token_time) / 255
    t0 = time.perf_counter()
    outs = llm.generate(prompts(args.num_requests, 512), p, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    res.update(offline_s=dt, offline_tok_s=n / dt, output_tokens=n)
    print(json.dumps(res), flush=True)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
