"""Host (Python) cost of one engine step at a large decode batch, on the CPU.

The GPU step at batch 256 is ~11 ms; everything the engine does around the forward
(schedule, batch prep, sampling, per-request update) runs with the GPU idle, so it is
measured here on its own: a tiny model, the forward timed separately and subtracted.

    python benchmarks/host_overhead.py [--batch 256] [--context 512] [--steps 40]
"""

from __future__ import annotations

import argparse
import collections
import random
import tempfile
import time

from pagefleet.server import LLM, SamplingParams
from pagefleet.server.testing import build_tiny_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--stream", action="store_true", help="per-step outputs (server mode)")
    ap.add_argument("--sampled", action="store_true", help="Qwen2.5's sampling defaults")
    args = ap.parse_args()
    path = build_tiny_model(tempfile.mkdtemp(), "qwen2", hidden_size=32, num_layers=1,
                            num_heads=2, num_kv_heads=1)
    llm = LLM(path, max_model_len=args.context + args.steps + 8, max_num_seqs=args.batch,
              max_num_batched_tokens=max(8192, args.context), num_kv_blocks=args.batch * 64)
    eng = llm.engine
    rng = random.Random(0)
    kind = "delta" if args.stream else "final"
    if args.sampled:
        params = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05,
                                max_tokens=args.steps + 2, ignore_eos=True, output_kind=kind)
    else:
        params = SamplingParams(temperature=0, max_tokens=args.steps + 2, ignore_eos=True,
                                output_kind=kind)
    for i in range(args.batch):
        eng.add_request(str(i), [rng.randrange(3, 500) for _ in range(args.context)], params)
    while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                       for r in eng.scheduler.running.values()):
        eng.step()
    spent = collections.Counter()

    def timed(obj, name, key):
        orig = getattr(obj, name)

        def f(*a, **k):
            t = time.perf_counter()
            r = orig(*a, **k)
            spent[key] += time.perf_counter() - t
            return r
        setattr(obj, name, f)

    timed(eng.scheduler, "schedule", "schedule")
    timed(eng.runner.model, "forward", "forward (CPU model, excluded)")
    timed(eng.runner.model, "compute_logits", "logits (CPU model, excluded)")
    timed(eng.core.sampler, "sample", "sample (queue)")
    timed(eng.core.sampler, "stage", "sampler stage")
    timed(eng.runner, "stage", "runner stage (pack inputs)")
    timed(eng.runner, "execute", "runner execute (incl. model)")
    timed(eng.scheduler, "advance", "advance")
    timed(eng.core, "_resolve", "resolve (read back, stop checks)")
    timed(eng.processor, "process", "output processor (detokenize)")
    n, t0 = 0, time.perf_counter()
    for _ in range(args.steps):
        eng.step()
        n += 1
    total = time.perf_counter() - t0
    model = spent["forward (CPU model, excluded)"] + spent["logits (CPU model, excluded)"]
    host = total - model
    print(f"batch {args.batch}, context {args.context}, {n} decode steps")
    print(f"host work per step: {host / n * 1e3:.3f} ms")
    for k, v in spent.most_common():
        print(f"  {k:32s} {v / n * 1e3:8.3f} ms")
    accounted = sum(v for k, v in spent.items() if "excluded" not in k and "execute" not in k)
    accounted += spent["runner execute (incl. model)"] - model
    print(f"  {'rest':32s} {(host - accounted) / n * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
