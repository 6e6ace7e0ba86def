"""One device call's decision (twenty-eighth session): from engine_gemv_ab.json of the
rope_fused A/B, which of the two A/B'd keys the official run that follows ships, printed
as sed commands on the tree copy: rope_fused where it is faster than shipped with the same
bits; 16 warps for the deferred norm where that is faster again, with the same tokens."""
import json
import sys

rows = json.load(open(sys.argv[1]))["rows"]
base, rope, both = (r["median_ms"] for r in rows[:3])
print(f"# shipped {base:.4f} rope {rope:.4f} (bits {rows[1]['same_bits']}) rope+n16 {both:.4f}",
      file=sys.stderr)
if rope < base and rows[1]["same_bits"] and rows[1]["same_tokens"]:
    print("sed -i 's/\"rope_fused\": False,/\"rope_fused\": True,/' server/ops/triton_attention.py")
    if both < rope and rows[2]["same_tokens"]:
        print("sed -i 's/\"deferred_warps\": 8,/\"deferred_warps\": 16,/' "
              "server/ops/triton_layernorm.py")
