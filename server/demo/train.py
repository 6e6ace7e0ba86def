"""Train the built-in demo model and write it as a normal HF model directory.

    python -m pagefleet.server.demo.train --out server/demo/model --log docs/demo/train_log.json

Seeded end to end (corpus, tokenizer, initialisation, batch order), so the same command
with the same torch build writes the same weights. It runs on the CPU in a few minutes:
the model is a Qwen3-shaped decoder (tied embeddings, q/k norms, GQA) of about two
million parameters, trained with HF transformers' own `Qwen3ForCausalLM`, so the
checkpoint is by construction what HF loads, and pagefleet's greedy output can be
checked against HF's token for token.

The loss only counts the assistant's tokens (its replies, tool calls and `<|im_end|>`):
the prompts are random by design and predicting them would spend the model's small
capacity on noise.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pagefleet.server.demo.corpus import Dialogue, dialogues

ASSISTANT_OPEN = "<|im_start|>assistant\n"
TURN_END = "<|im_end|>"


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    vocab_size: int = 2048           # BPE merges target; the embedding is padded to 64
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 64
    intermediate_size: int = 384
    max_len: int = 384               # longer dialogues are skipped
    steps: int = 2000
    tokens_per_batch: int = 1024     # padded tokens per step
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 30
    weight_decay: float = 0.05
    eval_every: int = 50
    threads: int = 2


def encode(tok, d: Dialogue, max_len: int) -> tuple[list[int], list[int]] | None:
    """Token ids and labels (-100 outside the assistant's turns) of one dialogue, rendered
    by the tokenizer's chat template exactly as the server will render a request."""
    text = tok.apply_chat_template(d.messages, tools=d.tools, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    if len(ids) > max_len:
        return None
    spans = []
    pos = 0
    while (i := text.find(ASSISTANT_OPEN, pos)) != -1:
        start = i + len(ASSISTANT_OPEN)
        end = text.index(TURN_END, start) + len(TURN_END)
        spans.append((start, end))
        pos = end
    labels = [-100] * len(ids)
    for j, (a, _) in enumerate(enc["offset_mapping"]):
        if any(s <= a < e for s, e in spans):
            labels[j] = ids[j]
    return ids, labels


def batches(tok, seed: int, cfg: TrainConfig) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Length-bucketed, right-padded batches of about `tokens_per_batch` tokens.

    Right padding needs no attention mask: under a causal mask, pad tokens come after
    every real token and so never change them; their labels are -100.
    """
    rng = random.Random(seed)
    stream = dialogues(seed)
    pad = tok.pad_token_id
    while True:
        pool = [e for e in (encode(tok, next(stream), cfg.max_len) for _ in range(512)) if e]
        pool.sort(key=lambda e: len(e[0]))
        group: list[list[tuple[list[int], list[int]]]] = [[]]
        for e in pool:
            width = max(len(e[0]), max((len(g[0]) for g in group[-1]), default=0))
            if group[-1] and width * (len(group[-1]) + 1) > cfg.tokens_per_batch:
                group.append([])
            group[-1].append(e)
        rng.shuffle(group)
        for g in group:
            yield _pad(g, pad)


def _pad(group: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, labels) right-padded to the group's longest: pad ids, -100 labels."""
    width = max(len(ids) for ids, _ in group)
    x = torch.full((len(group), width), pad, dtype=torch.long)
    y = torch.full((len(group), width), -100, dtype=torch.long)
    for r, (ids, labels) in enumerate(group):
        x[r, :len(ids)] = torch.tensor(ids)
        y[r, :len(labels)] = torch.tensor(labels)
    return x, y


def build_model(cfg: TrainConfig, tok):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = -(-len(tok) // 64) * 64
    im_end = tok.convert_tokens_to_ids(TURN_END)
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    mcfg = Qwen3Config(
        vocab_size=vocab, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, initializer_range=0.02, use_sliding_window=False,
        bos_token_id=endoftext, eos_token_id=im_end, pad_token_id=endoftext,
        attn_implementation="sdpa")
    torch.manual_seed(cfg.seed)
    return Qwen3ForCausalLM(mcfg)


def masked_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the labelled positions only; the LM head runs on those rows alone
    (half the tokens are prompt, and the head is a fifth of the model's work)."""
    hidden = model.model(input_ids=x).last_hidden_state[:, :-1]
    keep = y[:, 1:] != -100
    logits = model.lm_head(hidden[keep])
    return torch.nn.functional.cross_entropy(logits.float(), y[:, 1:][keep])


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * t))


GENERATION_CONFIG = {
    # A small model's distribution has a long tail of broken phrases: sample from its
    # head. These keep sampled replies grammatical and still varied (docs/demo.md).
    "do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
}


def save(model, tok, out: Path) -> None:
    from pagefleet.server.demo.template import CHAT_TEMPLATE

    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    # transformers 5 writes its own key names; add the classic ones that older
    # transformers and other servers (vLLM, llama.cpp's converter) read.
    _patch_json(out / "config.json", torch_dtype="float32",
                rope_theta=model.config.rope_parameters["rope_theta"])
    _patch_json(out / "tokenizer_config.json", tokenizer_class="PreTrainedTokenizerFast",
                additional_special_tokens=["<|im_start|>"], chat_template=CHAT_TEMPLATE)
    gen = {"bos_token_id": model.config.bos_token_id,
           "eos_token_id": [model.config.eos_token_id, model.config.pad_token_id],
           "pad_token_id": model.config.pad_token_id, **GENERATION_CONFIG}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _patch_json(path: Path, **keys) -> None:
    data = json.loads(path.read_text())
    data.update(keys)
    data.pop("extra_special_tokens", None) if "additional_special_tokens" in keys else None
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def train(cfg: TrainConfig, out: Path, log_path: Path | None) -> dict:
    from pagefleet.server.demo.tokenizer import train_tokenizer

    torch.set_num_threads(cfg.threads)
    t0 = time.time()
    tok = train_tokenizer(cfg.seed, cfg.vocab_size)
    model = build_model(cfg, tok)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    evals = [e for e in (encode(tok, d, cfg.max_len) for d, _ in
                         zip(dialogues(cfg.seed + 1_000_003), range(64))) if e]
    eval_batches = [b for b in _fixed_batches(evals, tok.pad_token_id, 8)]
    data = batches(tok, cfg.seed + 1, cfg)
    log = {"config": asdict(cfg), "params": n_params, "train": [], "eval": []}
    print(f"demo model: {n_params / 1e6:.2f}M parameters, vocab {len(tok)}; "
          f"tokenizer ready in {time.time() - t0:.1f}s", flush=True)
    tokens = 0
    model.train()
    for step in range(cfg.steps):
        x, y = next(data)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = masked_loss(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += x.numel()
        log["train"].append({"step": step + 1, "loss": round(loss.item(), 4), "tokens": tokens,
                             "seconds": round(time.time() - t0, 1)})
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            ev = evaluate(model, eval_batches)
            log["eval"].append({"step": step + 1, "loss": round(ev, 4)})
            print(f"step {step + 1}/{cfg.steps}  train {loss.item():.3f}  eval {ev:.3f}  "
                  f"{tokens} tokens  {time.time() - t0:.0f}s", flush=True)
    log["seconds"] = round(time.time() - t0, 1)
    save(model, tok, out)
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(json.dumps(log, indent=1) + "\n")
    return log


def _fixed_batches(examples, pad: int, size: int):
    for i in range(0, len(examples), size):
        yield _pad(examples[i:i + size], pad)


@torch.no_grad()
def evaluate(model, eval_batches) -> float:
    """Mean assistant-token loss on a fixed held-out set (another seed of the corpus)."""
    model.eval()
    total, count = 0.0, 0
    for x, y in eval_batches:
        n = int((y[:, 1:] != -100).sum())
        total += masked_loss(model, x, y).item() * n
        count += n
    model.train()
    return total / count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="model directory to write")
    p.add_argument("--log", type=Path, default=None, help="write the loss log (JSON) here")
    for f, v in asdict(TrainConfig()).items():
        p.add_argument("--" + f.replace("_", "-"), type=type(v), default=v)
    args = p.parse_args(argv)
    cfg = TrainConfig(**{f: getattr(args, f) for f in asdict(TrainConfig())})
    train(cfg, args.out, args.log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
