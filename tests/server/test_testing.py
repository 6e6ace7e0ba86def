"""pagefleet.server.testing builds complete, deterministic offline model folders."""

from __future__ import annotations

import hashlib
import json

import pytest

from pagefleet.server.testing import ARCHS, build_tiny_model


def digest(path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.iterdir()) if p.is_file()}


def test_same_seed_same_files_other_seed_other_weights(tmp_path):
    a = build_tiny_model(tmp_path / "a", "llama", seed=3, num_shards=2)
    b = build_tiny_model(tmp_path / "b", "llama", seed=3, num_shards=2)
    c = build_tiny_model(tmp_path / "c", "llama", seed=4, num_shards=2)
    assert digest(a) == digest(b)
    assert digest(a)["model-00001-of-00002.safetensors"] != digest(c)["model-00001-of-00002.safetensors"]


@pytest.mark.parametrize("arch", ARCHS)
def test_directory_is_a_complete_hf_model(tiny_models, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_models(arch)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == arch
    tok = AutoTokenizer.from_pretrained(str(path))
    assert tok.eos_token == "<|im_end|>"
    assert "<|im_start|>" in tok.get_vocab()
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    text = "Hello, wörld! 12 tokens"
    assert tok.decode(tok.encode(text)) == text       # byte-level BPE round-trips
    gen = json.loads((path / "generation_config.json").read_text())
    assert len(gen["eos_token_id"]) == 2
    _, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_llama_has_llama3_rope_and_sharded_index(tmp_path):
    path = build_tiny_model(tmp_path / "l", "llama", num_shards=2)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["rope_scaling"]["rope_type"] == "llama3"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00002.safetensors",
                                                 "model-00002-of-00002.safetensors"}
