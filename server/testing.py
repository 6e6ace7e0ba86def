"""Tiny offline HF models for tests: real architectures, random weights.

No weights can be downloaded here, so tests build a complete model
directory on the spot: `config.json` in the format real checkpoints use (`rope_theta`,
`rope_scaling`), safetensors weights (optionally sharded with an index), a byte-level
BPE tokenizer trained on a generated corpus, special tokens, a ChatML chat template and
`generation_config.json`.

Weights are drawn with a std of 0.3 (not HF's 0.02): a tiny model at 0.02 greedily
repeats one token whatever the prompt, so parity with it proves nothing. Norm weights
are jittered around 1 so that a forgotten norm weight is caught too.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch
from safetensors.torch import save_file

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{%- if not (loop.last and continue_final_message is defined and continue_final_message) -%}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' }}{%- endif -%}"
)

_WORDS = (
    "the a an of to in and is was for on with as by at from it that this be are were "
    "model token cache block batch queue request server GPU memory prefix chunk decode "
    "prefill latency throughput kernel attention layer head vector matrix sample greedy "
    "paged pool hash scheduler runner engine stream reply client user system assistant "
    "hello world question answer long short fast slow first last next red green blue "
    "one two three four five six seven eight nine ten hundred thousand data time "
    "deploy scale replica pod node cluster service metric alert limit budget policy"
).split()


def _corpus(seed: int, lines: int = 3000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 16)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 9999)))
        sentence = " ".join(words).capitalize() + rng.choice([".", "?", "!", ","])
        out.append(sentence)
    return out


def _build_tokenizer(path: Path, seed: int, vocab_size: int,
                     chat_template: str = CHAT_TEMPLATE, added_tokens: tuple[str, ...] = ()) -> int:
    """Train a byte-level BPE and save it as an HF fast tokenizer; returns its length."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    if added_tokens:   # single tokens that stay text (e.g. <think>, </think>)
        fast.add_tokens(list(added_tokens))
    fast.chat_template = chat_template
    fast.model_max_length = 1 << 20
    fast.save_pretrained(str(path))
    return len(fast)


def _arch_config(arch: str, vocab_size: int, hidden_size: int, num_layers: int,
                 num_heads: int, num_kv_heads: int, tie: bool, max_pos: int,
                 eos_ids: list[int], pad_id: int, intermediate_size: int | None = None) -> dict:
    head_dim = hidden_size // num_heads
    cfg: dict = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or hidden_size * 2 + 32,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.3,
        "tie_word_embeddings": tie,
        "torch_dtype": "float32",
        "bos_token_id": eos_ids[-1],
        "eos_token_id": eos_ids[0],
        "pad_token_id": pad_id,
        "use_cache": True,
    }
    if arch == "llama":
        cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=500000.0,
                   attention_bias=False, mlp_bias=False, head_dim=head_dim,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64})
    elif arch == "qwen2":
        cfg.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1000000.0,
                   use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
    elif arch == "qwen3":
        cfg.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", rope_theta=1000000.0,
                   head_dim=head_dim * 2, attention_bias=False, use_sliding_window=False,
                   sliding_window=None, max_window_layers=num_layers)
    elif arch == "mistral":
        cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", rope_theta=10000.0,
                   head_dim=head_dim, sliding_window=None)
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}")
    return cfg


def _random_weights(cfg: dict, arch: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    std = cfg["initializer_range"]
    h, v, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh

    def normal(*shape: int, s: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * s

    def norm_weight(n: int) -> torch.Tensor:
        return 1.0 + normal(n, s=0.1)

    # A tied head reads logits off the input embeddings: if they dominate the residual
    # stream the model just repeats its input token, so keep them small when tied.
    w = {"model.embed_tokens.weight": normal(v, h, s=0.1 if cfg["tie_word_embeddings"] else 1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight(h)
        w[p + "post_attention_layernorm.weight"] = norm_weight(h)
        # Scale projections by fan-in so activations stay O(1) through the layers.
        w[p + "self_attn.q_proj.weight"] = normal(nh * hd, h, s=std * 8 / h ** 0.5)
        w[p + "self_attn.k_proj.weight"] = normal(nkv * hd, h, s=std * 8 / h ** 0.5)
        w[p + "self_attn.v_proj.weight"] = normal(nkv * hd, h, s=std * 4 / h ** 0.5)
        w[p + "self_attn.o_proj.weight"] = normal(h, nh * hd, s=std * 4 / (nh * hd) ** 0.5)
        if arch == "qwen2":
            w[p + "self_attn.q_proj.bias"] = normal(nh * hd, s=0.5)
            w[p + "self_attn.k_proj.bias"] = normal(nkv * hd, s=0.5)
            w[p + "self_attn.v_proj.bias"] = normal(nkv * hd, s=0.5)
        if arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm_weight(hd)
            w[p + "self_attn.k_norm.weight"] = norm_weight(hd)
        w[p + "mlp.gate_proj.weight"] = normal(inter, h, s=std * 4 / h ** 0.5)
        w[p + "mlp.up_proj.weight"] = normal(inter, h, s=std * 4 / h ** 0.5)
        w[p + "mlp.down_proj.weight"] = normal(h, inter, s=std * 4 / inter ** 0.5)
    w["model.norm.weight"] = norm_weight(h)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(v, h, s=1.0)
    return {k: t.contiguous() for k, t in w.items()}


def _save_weights(path: Path, weights: dict[str, torch.Tensor], num_shards: int) -> None:
    if num_shards <= 1:
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(weights)
    per = -(-len(names) // num_shards)
    weight_map, total = {}, 0
    for s in range(num_shards):
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s * per:(s + 1) * per]}
        save_file(part, str(path / fname), metadata={"format": "pt"})
        for n, t in part.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def build_tiny_model(path: str | os.PathLike, arch: str = "qwen3", *, seed: int = 0,
                     num_shards: int = 1, tie_word_embeddings: bool | None = None,
                     hidden_size: int = 96, num_layers: int = 3, num_heads: int = 4,
                     num_kv_heads: int = 2, vocab_size: int = 512,
                     max_position_embeddings: int = 2048,
                     chat_template: str | None = None,
                     added_tokens: tuple[str, ...] = (),
                     rope_scaling: dict | None = None,
                     intermediate_size: int | None = None) -> Path:
    """Write a complete offline HF model directory and return its path.

    Deterministic for a given seed. Tied embeddings default to on for qwen3 (as the
    small Qwen3 checkpoints ship) and off for the others. `chat_template` replaces the
    plain ChatML one, e.g. `chat_templates.TOOLS_CHAT_TEMPLATE` to render tools;
    `added_tokens` become single vocabulary entries (a reasoning model's think tags).
    `rope_scaling` replaces the arch's (llama: llama3; the others: none), e.g. YaRN as
    Qwen2.5's model card adds it; the weights do not depend on it. `intermediate_size`
    defaults to `2 * hidden_size + 32`.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tie = (arch == "qwen3") if tie_word_embeddings is None else tie_word_embeddings
    n_tok = _build_tokenizer(path, seed, vocab_size, chat_template or CHAT_TEMPLATE,
                             tuple(added_tokens))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    eos_ids = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    cfg = _arch_config(arch, n_tok, hidden_size, num_layers, num_heads, num_kv_heads, tie,
                       max_position_embeddings, eos_ids, tok.pad_token_id, intermediate_size)
    if rope_scaling is not None:
        cfg["rope_scaling"] = dict(rope_scaling)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": eos_ids, "do_sample": True,
           "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
    _save_weights(path, _random_weights(cfg, arch, seed), num_shards)
    return path


def demo_model_path() -> Path:
    """The built-in demo model: the checkpoint shipped in the package (`server/demo/model`,
    trained by `python -m pagefleet.server.demo.train`; see docs/demo.md). Unlike the tiny
    models above, it was trained, so its replies are readable English."""
    from pagefleet.server.demo import demo_checkpoint

    return demo_checkpoint()
