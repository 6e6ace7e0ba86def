"""One device call's decision (twenty-eighth session, second form): from the decode-split
A/B's engine_gemv_ab.json, the variant the official run that follows ships, as sed
commands on the tree copy: the fastest variant with the same greedy tokens, where it beats
shipped (the first row) by more than 3 us; its DECODE_CONFIG min_partition / block_n and
NORM_CONFIG deferred_warps edited in place."""
import json
import sys

rows = json.load(open(sys.argv[1]))["rows"]
for r in rows:
    print(f"# {r['variant']} {r['median_ms']:.4f} tokens {r['same_tokens']}", file=sys.stderr)
best = min((r for r in rows if r["same_tokens"]), key=lambda r: r["median_ms"])
if best is not rows[0] and best["median_ms"] < rows[0]["median_ms"] - 0.003:
    v = best["variant"]
    for key, value in v.get("DECODE_CONFIG", {}).items():
        print(f"sed -i 's/^    \"{key}\": [0-9]*,/    \"{key}\": {value},/' "
              "server/ops/triton_attention.py")
    if "NORM_CONFIG" in v:
        print("sed -i 's/\"deferred_warps\": 8}/\"deferred_warps\": 16}/' "
              "server/ops/triton_layernorm.py")
