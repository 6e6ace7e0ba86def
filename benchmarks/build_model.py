"""Build a real-size model directory with random weights (no downloads here).

Default shape: Qwen2.5-7B (hidden 3584, 28 layers, 28 heads / 4 KV heads, head_dim 128,
intermediate 18944, vocab 152064, q/k/v bias, rope_theta 1e6, untied lm_head), bf16
safetensors in shards, and a WordLevel tokenizer with one word per id (`t123`) plus
Qwen's special tokens, so the text path of the server works too. Weights are drawn on
the GPU when there is one (seconds), then written to disk.

    python benchmarks/build_model.py /tmp/qwen7b            # full size
    python benchmarks/build_model.py /tmp/q --layers 2 --hidden 256 --intermediate 512 \
        --heads 4 --kv-heads 2                               # small, for a CPU check
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

SPECIAL = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}


def build_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    special = {k: (v if v < vocab_size else vocab_size - 3 + i)
               for i, (k, v) in enumerate(SPECIAL.items())}
    ids_special = set(special.values())
    vocab = {f"t{i}": i for i in range(vocab_size) if i not in ids_special}
    vocab.update(special)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", bos_token=None)
    fast.save_pretrained(str(path))


def build(path: str | Path, *, hidden: int = 3584, layers: int = 28, heads: int = 28,
          kv_heads: int = 4, intermediate: int = 18944, vocab: int = 152064,
          max_pos: int = 32768, std: float = 0.02, seed: int = 0,
          shard_bytes: int = 4 << 30) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": max_pos,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "vocab_size": vocab,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
        "use_sliding_window": False, "sliding_window": max_pos, "max_window_layers": layers,
        "bos_token_id": 151643, "eos_token_id": 151645, "attention_dropout": 0.0,
        "initializer_range": std, "use_cache": True,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 151643, "eos_token_id": [151645, 151643]}, indent=2))
    build_tokenizer(path, vocab)

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*shape, scale=std):
        return (torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32) * scale
                ).to(torch.bfloat16).cpu()

    def norm_w(n):
        return (1 + 0.1 * torch.randn(n, generator=gen, device=dev)).to(torch.bfloat16).cpu()

    q, kv = heads * head_dim, kv_heads * head_dim
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    index: dict[str, str] = {}

    def put(name: str, t: torch.Tensor) -> None:
        nonlocal size
        if size + t.numel() * 2 > shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.numel() * 2

    put("model.embed_tokens.weight", rnd(vocab, hidden))
    for i in range(layers):
        p = f"model.layers.{i}."
        put(p + "input_layernorm.weight", norm_w(hidden))
        put(p + "self_attn.q_proj.weight", rnd(q, hidden))
        put(p + "self_attn.q_proj.bias", rnd(q))
        put(p + "self_attn.k_proj.weight", rnd(kv, hidden))
        put(p + "self_attn.k_proj.bias", rnd(kv))
        put(p + "self_attn.v_proj.weight", rnd(kv, hidden))
        put(p + "self_attn.v_proj.bias", rnd(kv))
        put(p + "self_attn.o_proj.weight", rnd(hidden, q))
        put(p + "post_attention_layernorm.weight", norm_w(hidden))
        put(p + "mlp.gate_proj.weight", rnd(intermediate, hidden))
        put(p + "mlp.up_proj.weight", rnd(intermediate, hidden))
        put(p + "mlp.down_proj.weight", rnd(hidden, intermediate))
    put("model.norm.weight", norm_w(hidden))
    put("lm_head.weight", rnd(vocab, hidden))
    total = 0
    for k, part in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(path / fname), metadata={"format": "pt"})
        for name, t in part.items():
            index[name] = fname
            total += t.numel() * 2
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": index}, indent=2))
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=18944)
    ap.add_argument("--vocab", type=int, default=152064)
    args = ap.parse_args()
    t0 = time.time()
    build(args.path, hidden=args.hidden, layers=args.layers, heads=args.heads,
          kv_heads=args.kv_heads, intermediate=args.intermediate, vocab=args.vocab)
    print(f"built {args.path} in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
