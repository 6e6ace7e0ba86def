"""Structured outputs: request fields -> GrammarSpec (400s at the edge), compile cache,
matchers, and the bitmask on the logits, through a plain torch sampling loop over the
HF model of a tiny random-weight checkpoint (float32, CPU, temperature 1).

The loop is the sampler's per-step path in miniature: `fill` the compact host bitmask
for the rows that have a grammar, `apply` it to those rows of the logits, sample, and
`accept` each row's token. Outputs of a random model are whatever the mask lets
through, so every one validating is the mask's doing.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import re
import time
from concurrent.futures import Future

import jsonschema
import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

import xgrammar as xgr

from pagefleet.server.api.errors import APIError
from pagefleet.server.api.json_schema_support import unsupported_feature
from pagefleet.server.api.structured_outputs import (grammar_spec_from_request,
                                                     spec_problem)
from pagefleet.server.engine import structured_output as so
from pagefleet.server.engine.structured_output import (BitmaskBuffers,
                                                       GrammarCompileError, GrammarSpec,
                                                       GrammarStatus, StructuredState)
from pagefleet.server.ops import bitmask as bitmask_ops

PAD_VOCAB = 40      # model vocab larger than the tokenizer, as real checkpoints have it

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 99},
                "role": {"type": "string", "enum": ["admin", "user"]},
                "active": {"type": "boolean"},
            },
            "required": ["id", "role"],
        },
        "points": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                               "label": {"anyOf": [{"type": "string", "maxLength": 4},
                                                   {"type": "null"}]}},
                "required": ["x", "label"],
            },
            "minItems": 1, "maxItems": 2,
        },
    },
    "required": ["name", "color", "owner", "points"],
}


# -- fixtures ------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tiny model's decode steps are microseconds of work: on a shared 2-core
    machine, torch's second thread only adds contention (20 ms vs 1 s a step here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("qwen3")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def eos_ids(model_dir):
    gen = json.loads((model_dir / "generation_config.json").read_text())
    return list(gen["eos_token_id"])


@pytest.fixture(scope="module")
def vocab_size(model_dir):
    return json.loads((model_dir / "config.json").read_text())["vocab_size"] + PAD_VOCAB


@pytest.fixture(scope="module")
def compiler(tokenizer, vocab_size, eos_ids):
    c = so.GrammarCompiler(so.tokenizer_info(tokenizer, vocab_size, eos_ids), max_workers=2,
                           compile_threads=1)
    yield c
    c.shutdown()


def compiled(compiler, spec):
    return compiler.submit(spec).result(timeout=60)


# -- the sampling loop ---------------------------------------------------------------
def _pad_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The model's logits padded to `vocab_size` with large values: a padded id that
    slipped through the mask would win every draw."""
    pad = torch.full((logits.shape[0], vocab_size - logits.shape[1]), 1e4)
    return torch.cat([logits.float(), pad], dim=1)


def sample(hf_model, tokenizer, states: list[StructuredState], vocab_size: int, *,
           prompt: str = "Reply in JSON:", max_new: int = 160, seed: int = 0,
           temperature: float = 1.0, rows_offset: int = 0, must_finish: bool = True
           ) -> list[list[int]]:
    """Batched multinomial sampling over the HF model with every row constrained by
    its state; `rows_offset` unconstrained rows come first, to check masking leaves
    them alone. Returns the constrained rows' generated ids (stop token included)."""
    n = rows_offset + len(states)
    ids = tokenizer(prompt)["input_ids"]
    gen = torch.Generator().manual_seed(seed)
    cache_kw = ("cache" if "cache" in inspect.signature(hf_model.forward).parameters
                else "past_key_values")
    bitmask = torch.empty(n, so.bitmask_words(vocab_size), dtype=torch.int32)
    outs: list[list[int]] = [[] for _ in states]
    live = list(range(len(states)))
    with torch.inference_mode():
        out = hf_model(input_ids=torch.tensor([ids] * n), use_cache=True)
        for _ in range(max_new):
            past = getattr(out, "cache", None) or out.past_key_values
            logits = _pad_logits(out.logits[:, -1, :], vocab_size)
            free = logits[:rows_offset].clone()
            rows = so.fill([(rows_offset + i, states[i]) for i in live], bitmask)
            so.apply(logits, bitmask[:len(rows)], torch.tensor(rows, dtype=torch.int32))
            assert torch.equal(logits[:rows_offset], free), "an unconstrained row was masked"
            probs = torch.softmax(logits / temperature, dim=-1)
            tokens = torch.multinomial(probs, 1, generator=gen)[:, 0]
            for i in live:
                tok = int(tokens[rows_offset + i])
                assert tok < vocab_size - PAD_VOCAB, f"padded id {tok} sampled"
                assert states[i].accept(tok), f"row {i}: grammar refused its own mask's {tok}"
                outs[i].append(tok)
            live = [i for i in live if not states[i].is_terminated()]
            if not live:
                break
            step = tokens.clamp_max(vocab_size - PAD_VOCAB - 1)[:, None]
            out = hf_model(input_ids=step, use_cache=True, **{cache_kw: past})
    assert not (must_finish and live), f"{len(live)} rows did not finish in {max_new} tokens"
    return outs


def texts(tokenizer, outs: list[list[int]], eos_ids: list[int]) -> list[str]:
    for o in outs:
        assert o[-1] in eos_ids, "a finished grammar must end on a stop token"
    return [tokenizer.decode(o[:-1]) for o in outs]


# -- the tokenizer -------------------------------------------------------------------
def test_tiny_tokenizer_spells_json_from_bytes(tokenizer, vocab_size, eos_ids):
    """The tiny byte-level BPE carries all 256 bytes, so any JSON (any UTF-8) is
    spellable; xgrammar sees it as byte-level and pads it to the model's vocab."""
    assert 512 <= len(tokenizer) <= 1024
    text = "".join(chr(c) for c in range(32, 127)) + "\n\t{\"é\": [1, -2.5e3, null]}"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    info = so.tokenizer_info(tokenizer, vocab_size, eos_ids)
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL
    assert info.vocab_size == vocab_size and sorted(info.stop_token_ids) == sorted(eos_ids)
    # The first token of a JSON object: never a padded id nor a special token.
    c = so.GrammarCompiler(info, max_workers=1, compile_threads=1)
    st = StructuredState(compiled(c, GrammarSpec.json_object()))
    bm = torch.zeros(1, so.bitmask_words(vocab_size), dtype=torch.int32)
    st.fill_bitmask(bm, 0)
    allowed = allowed_ids(bm[0], vocab_size)
    assert allowed and all(i < len(tokenizer) for i in allowed)
    assert not set(allowed) & set(tokenizer.all_special_ids)
    assert all(tokenizer.decode([i]).lstrip().startswith("{") for i in allowed)
    c.shutdown()


def allowed_ids(row: torch.Tensor, vocab_size: int) -> list[int]:
    return [j for j in range(vocab_size) if (int(row[j // 32]) >> (j % 32)) & 1]


# -- sampled outputs validate --------------------------------------------------------
def test_json_schema_twenty_samples_validate(hf_model, tokenizer, compiler, vocab_size,
                                             eos_ids):
    """Issue 11's acceptance check: nested objects, enums and arrays, 20 samples at
    temperature 1, every one valid. Compact JSON (`disable_any_whitespace`): a random
    model given free whitespace spends its budget on it (see the next test)."""
    body = {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "thing", "schema": SCHEMA,
                                                "strict": True}},
            "structured_outputs": {"disable_any_whitespace": True}}
    spec = grammar_spec_from_request(body)
    assert spec is not None and spec.kind == "json_schema" and not spec.any_whitespace
    cg = compiled(compiler, spec)
    states = [StructuredState(cg, eos_ids) for _ in range(20)]
    outs = sample(hf_model, tokenizer, states, vocab_size, max_new=300, seed=1,
                  rows_offset=2)
    got = texts(tokenizer, outs, eos_ids)
    values = [json.loads(t) for t in got]
    for v in values:
        jsonschema.validate(v, SCHEMA)
    assert all(json.dumps(v, ensure_ascii=False) == t for v, t in zip(values, got)), \
        "compact JSON: json.dumps' separators, no other whitespace"
    # A real sampler over a real model: outputs differ, the optional fields come and go.
    assert len({json.dumps(v, sort_keys=True) for v in values}) >= 15
    assert {v["color"] for v in values} == {"red", "green", "blue"}
    assert any("tags" in v for v in values) and any("tags" not in v for v in values)


def test_any_whitespace_is_the_default(hf_model, tokenizer, compiler, vocab_size, eos_ids):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                               "n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["color", "n"]}
    spec = grammar_spec_from_request({"structured_outputs": {"json": schema}})
    assert spec.any_whitespace
    states = [StructuredState(compiled(compiler, spec), eos_ids) for _ in range(8)]
    outs = sample(hf_model, tokenizer, states, vocab_size, max_new=200, seed=2,
                  must_finish=False)
    done = [o for o, st in zip(outs, states) if st.is_terminated()]
    assert len(done) >= 4
    got = texts(tokenizer, done, eos_ids)
    for t in got:
        jsonschema.validate(json.loads(t), schema)
    assert any(re.search(r"[\s]{2}", t) for t in got), "whitespace between tokens is allowed"


def test_json_object_gives_an_object(hf_model, tokenizer, compiler, vocab_size, eos_ids):
    # The server-wide default for compact JSON, as `--structured-outputs-config` sets it.
    spec = grammar_spec_from_request({"response_format": {"type": "json_object"}},
                                     disable_any_whitespace=True)
    assert spec == GrammarSpec.json_object(any_whitespace=False)
    states = [StructuredState(compiled(compiler, spec), eos_ids) for _ in range(8)]
    # Unbounded JSON from a random model can run long: a bounded budget, and whatever
    # finished must be a JSON object.
    outs = sample(hf_model, tokenizer, states, vocab_size, max_new=120, seed=3,
                  must_finish=False)
    done = [o for o, st in zip(outs, states) if st.is_terminated()]
    assert len(done) >= 2, "too few JSON objects finished in 120 tokens"
    for t in texts(tokenizer, done, eos_ids):
        assert isinstance(json.loads(t), dict)


@pytest.mark.parametrize("pattern", [r"[a-z]{2,6}-\d{2,4}", r"(yes|no|maybe)!?",
                                     r"\(\d{3}\) \d{3}-\d{4}"])
def test_regex_outputs_match(hf_model, tokenizer, compiler, vocab_size, eos_ids, pattern):
    spec = grammar_spec_from_request({"structured_outputs": {"regex": pattern}})
    states = [StructuredState(compiled(compiler, spec), eos_ids) for _ in range(8)]
    for t in texts(tokenizer, sample(hf_model, tokenizer, states, vocab_size, seed=4),
                   eos_ids):
        assert re.fullmatch(pattern, t), (pattern, t)


def test_choice_outputs_are_choices(hf_model, tokenizer, compiler, vocab_size, eos_ids):
    choices = ["red", "green", "blue jeans", 'say "hi"', "naïve"]
    spec = grammar_spec_from_request({"guided_choice": choices})     # the legacy name
    assert spec == GrammarSpec.choice(choices)
    states = [StructuredState(compiled(compiler, spec), eos_ids) for _ in range(16)]
    got = texts(tokenizer, sample(hf_model, tokenizer, states, vocab_size, seed=5), eos_ids)
    assert set(got) <= set(choices) and len(set(got)) >= 3


@pytest.mark.parametrize("grammar", [
    'root ::= item ("," item)*\nitem ::= [a-c]+ | "<" [0-9] ">"',                 # EBNF
    'start: item ("," item)*\nitem: /[a-c]+/ | "<" DIGIT ">"\nDIGIT: /[0-9]/',   # Lark
])
def test_grammar_outputs_parse(hf_model, tokenizer, compiler, vocab_size, eos_ids, grammar):
    spec = grammar_spec_from_request({"structured_outputs": {"grammar": grammar}})
    assert spec.syntax == ("ebnf" if "::=" in grammar else "lark")
    states = [StructuredState(compiled(compiler, spec), eos_ids) for _ in range(8)]
    for t in texts(tokenizer, sample(hf_model, tokenizer, states, vocab_size, seed=6),
                   eos_ids):
        assert re.fullmatch(r"([a-c]+|<[0-9]>)(,([a-c]+|<[0-9]>))*", t), t


# -- matcher state -------------------------------------------------------------------
def test_finished_grammar_allows_only_stop_tokens(tokenizer, compiler, vocab_size, eos_ids):
    st = StructuredState(compiled(compiler, GrammarSpec.choice(["yes"])), eos_ids)
    for tok in tokenizer("yes")["input_ids"]:
        assert st.accept(tok)
    bm = torch.zeros(1, so.bitmask_words(vocab_size), dtype=torch.int32)
    st.fill_bitmask(bm, 0)
    assert allowed_ids(bm[0], vocab_size) == sorted(eos_ids)
    assert not st.is_terminated() and not st.accept(tokenizer("x")["input_ids"][0])
    assert st.accept(eos_ids[-1]) and st.is_terminated()
    assert not st.accept(eos_ids[0]), "nothing is accepted after termination"


def test_next_allowed_tells_a_dead_end_from_a_finished_grammar(tokenizer, compiler, eos_ids):
    """What the engine reads when a sampled token broke the grammar (core._grammar_refused)."""
    st = StructuredState(compiled(compiler, GrammarSpec.choice(["yes"])), eos_ids)
    assert st.next_allowed() == "some"
    for tok in tokenizer("yes")["input_ids"]:
        assert st.accept(tok)
    assert st.next_allowed() == "stop"
    dead = StructuredState(compiled(compiler, GrammarSpec.regex(r"[^\s\S]")), eos_ids)
    assert dead.next_allowed() == "none"


def test_request_stop_token_ids_end_a_finished_grammar(tokenizer, compiler, vocab_size):
    extra = tokenizer.convert_tokens_to_ids("<|im_start|>")
    st = StructuredState(compiled(compiler, GrammarSpec.choice(["ok"])), [2, extra])
    for tok in tokenizer("ok")["input_ids"]:
        st.accept(tok)
    bm = torch.zeros(1, so.bitmask_words(vocab_size), dtype=torch.int32)
    st.fill_bitmask(bm, 0)
    assert allowed_ids(bm[0], vocab_size) == sorted([2, extra])


def test_reasoning_then_enforcing_and_rollback(tokenizer, compiler, vocab_size, eos_ids):
    end = tokenizer.convert_tokens_to_ids("<|im_start|>")      # stands in for </think>
    cg = compiled(compiler, GrammarSpec.regex(r"[0-9]+"))
    st = StructuredState(cg, eos_ids, reasoning_end_token_id=end)
    bm = torch.zeros(2, so.bitmask_words(vocab_size), dtype=torch.int32)
    thought = tokenizer("thinking about it")["input_ids"]
    for tok in thought:
        assert not st.enforcing and st.accept(tok)
    assert so.fill([(5, st)], bm) == [], "a reasoning row is not masked"
    st.fill_bitmask(bm, 0)
    assert (bm[0] == -1).all()
    assert st.accept(end) and st.enforcing and not st.is_terminated()
    assert so.fill([(5, st)], bm) == [5]
    digits = allowed_ids(bm[0], vocab_size)
    assert digits and all(tokenizer.decode([i]).isdigit() for i in digits)
    assert not st.accept(tokenizer("a")["input_ids"][0])
    assert st.accept(digits[0]) and st.accept(digits[1])
    st.rollback(2)                       # undo the two digits: back to just after </think>
    st.fill_bitmask(bm, 1)
    assert torch.equal(bm[1], bm[0])
    st.rollback(1)                       # undo </think> itself: free again
    assert not st.enforcing
    assert st.accept(end) and st.enforcing
    with pytest.raises(ValueError):
        st.rollback(len(thought) + 2)


@pytest.mark.parametrize("thinks", [False, True])
def test_undecided_start_allows_think_beside_the_grammar(tokenizer, compiler, vocab_size,
                                                         eos_ids, thinks):
    """Output starting outside the reasoning (review finding 2): the first step allows
    the grammar's tokens and <think>; <think> frees the output until </think>, any
    other first token is the grammar's (enforced from there, never unmasked)."""
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")   # stands in for <think>
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")       # stands in for </think>
    cg = compiled(compiler, GrammarSpec.regex(r"[0-9]+"))
    st = StructuredState(cg, eos_ids, reasoning_end_token_id=end,
                         reasoning_start_token_id=start)
    bm = torch.zeros(2, so.bitmask_words(vocab_size), dtype=torch.int32)
    assert st.enforcing and so.fill([(3, st)], bm) == [3], "the first step is masked"
    first = allowed_ids(bm[0], vocab_size)
    digits = [i for i in first if i != start]
    assert start in first and end not in first
    assert digits and all(tokenizer.decode([i]).isdigit() for i in digits)
    st.fill_bitmask(bm, 1)
    assert torch.equal(bm[1], bm[0])
    if thinks:
        assert st.accept(start) and not st.enforcing
        assert so.fill([(3, st)], bm) == []
        for tok in tokenizer("hmm, 12 or 13")["input_ids"]:
            assert st.accept(tok)
        assert st.accept(end) and st.enforcing
        so.fill([(3, st)], bm)
        assert start not in allowed_ids(bm[0], vocab_size), "<think> only as the first token"
        st.rollback(1)                       # undo </think>: still thinking
        assert not st.enforcing
        st.rollback(st._free)                # back to the start: undecided again
        so.fill([(3, st)], bm)
        assert allowed_ids(bm[0], vocab_size) == first
    else:
        assert st.accept(digits[0]) and st.enforcing
        so.fill([(3, st)], bm)
        after = allowed_ids(bm[0], vocab_size)
        assert start not in after and all(tokenizer.decode([i]).isdigit() for i in after
                                          if i not in eos_ids)
        assert not st.accept(tokenizer("a")["input_ids"][0])
        st.rollback(1)                       # undo the digit: undecided again
        so.fill([(3, st)], bm)
        assert allowed_ids(bm[0], vocab_size) == first
    with pytest.raises(ValueError):
        StructuredState(cg, eos_ids, reasoning_start_token_id=start)


# -- bitmask kernels -----------------------------------------------------------------
def random_case(seed: int, batch: int, vocab: int, n_rows: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    words = so.bitmask_words(vocab)
    bits = torch.randint(0, 2, (n_rows, words * 32), generator=g, dtype=torch.int64)
    weights = torch.ones(32, dtype=torch.int64) << torch.arange(32)
    packed = (bits.view(n_rows, words, 32) * weights).sum(-1)
    bitmask = ((packed + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)  # as int32
    logits = torch.randn(batch, vocab, generator=g).to(dtype)
    rows = torch.tensor(random.Random(seed).sample(range(batch), n_rows), dtype=torch.int32)
    return logits, bitmask, rows, bits[:, :vocab].bool()


@pytest.mark.parametrize("batch,vocab,n_rows", [(1, 31, 1), (4, 64, 2), (7, 515, 7),
                                                (9, 1000, 3)])
def test_torch_twin_matches_xgrammar_cpu_kernel(batch, vocab, n_rows):
    logits, bitmask, rows, bits = random_case(batch * vocab, batch, vocab, n_rows)
    ours = logits.clone()
    bitmask_ops.apply_token_bitmask(ours, bitmask, rows)
    # xgrammar's indices address bitmask and logits rows alike: scatter ours to match.
    full = torch.full((batch, bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows.long()] = bitmask
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, full, indices=rows.tolist())
    assert torch.equal(ours, ref)
    expect = logits.clone()
    for i, r in enumerate(rows.tolist()):
        expect[r][~bits[i]] = float("-inf")
    assert torch.equal(ours, expect)
    # Without indices: bitmask row i is logits row i.
    if n_rows == batch:
        plain = logits.clone()
        bitmask_ops.apply_token_bitmask(plain, bitmask, None)
        expect = logits.clone()
        expect[~bits] = float("-inf")
        assert torch.equal(plain, expect)


def test_twin_masks_ids_past_the_bitmask():
    logits = torch.zeros(2, 70)
    bitmask = torch.full((2, 2), -1, dtype=torch.int32)     # covers 64 ids of 70
    bitmask_ops.apply_token_bitmask(logits, bitmask, None)
    assert torch.isinf(logits[:, 64:]).all() and (logits[:, :64] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch,vocab,n_rows,with_rows", [(3, 100, 2, True),
                                                         (5, 4200, 5, False),
                                                         (6, 2049, 3, True)])
def test_triton_kernel_matches_twin(dtype, batch, vocab, n_rows, with_rows):
    triton = pytest.importorskip("triton")  # noqa: F841
    from pagefleet.server.ops import triton_bitmask

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 on a machine without CUDA")
    dev = "cpu" if not torch.cuda.is_available() else "cuda"
    logits, bitmask, rows, _ = random_case(vocab + batch, batch, vocab, n_rows, dtype)
    idx = rows if with_rows else None
    ref = logits.clone()
    bitmask_ops.apply_token_bitmask(ref, bitmask, idx)
    out = logits.clone().to(dev)
    triton_bitmask.apply_token_bitmask(out, bitmask.to(dev),
                                       None if idx is None else idx.to(dev))
    assert torch.equal(out.cpu(), ref)


def test_bitmask_buffers_stage_on_cpu(compiler, tokenizer, vocab_size, eos_ids):
    buf = BitmaskBuffers(max_rows=8, vocab_size=vocab_size, device="cpu", fill_threads=2)
    cg = compiled(compiler, GrammarSpec.regex(r"[0-9]+"))
    states = [StructuredState(cg, eos_ids) for _ in range(3)]
    assert buf.stage([]) is None
    for _ in range(3):                          # both halves of the double buffer, twice
        bm, idx = buf.stage([(6, states[0]), (1, states[1]), (3, states[2])])
        assert idx.tolist() == [6, 1, 3] and bm.shape == (3, so.bitmask_words(vocab_size))
        logits = torch.zeros(8, vocab_size)
        so.apply(logits, bm, idx)
        masked = {r for r in range(8) if torch.isinf(logits[r]).any()}
        assert masked == {6, 1, 3}
        kept = (~torch.isinf(logits[6])).nonzero().flatten().tolist()
        assert kept and all(tokenizer.decode([i]).isdigit() for i in kept)


# -- compiling -----------------------------------------------------------------------
def test_compile_is_cached_and_off_the_caller(tokenizer, vocab_size, eos_ids):
    c = so.GrammarCompiler(so.tokenizer_info(tokenizer, vocab_size, eos_ids), max_workers=1,
                           compile_threads=1)
    spec = GrammarSpec.json_schema(SCHEMA)
    f1 = c.submit(spec)
    f2 = c.submit(GrammarSpec.json_schema(json.loads(json.dumps(SCHEMA))))  # equal spec
    assert f2 is f1 and c.stats.compiles == 1 and c.stats.hits == 1
    assert isinstance(f1.result(timeout=60), xgr.CompiledGrammar) and c.is_ready(spec)
    assert c.submit(spec) is f1 and c.stats.compiles == 1 and c.stats.hits == 2
    other = GrammarSpec.json_schema(SCHEMA, any_whitespace=False)
    assert not c.is_ready(other) and c.submit(other) is not f1 and c.stats.compiles == 2
    # A spec that fails to compile fails its future and is not kept: a retry compiles.
    bad = GrammarSpec.grammar('root ::= undefined_rule')
    with pytest.raises(GrammarCompileError, match="undefined_rule"):
        c.submit(bad).result(timeout=60)
    deadline = time.monotonic() + 10
    while c.stats.failures < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.stats.failures == 1 and not c.is_ready(bad)
    c.submit(bad).exception(timeout=60)
    assert c.stats.compiles == 4
    c.shutdown()


def test_compile_cache_is_bounded(tokenizer, vocab_size, eos_ids):
    c = so.GrammarCompiler(so.tokenizer_info(tokenizer, vocab_size, eos_ids), max_workers=1,
                           compile_threads=1, cache_size=2)
    specs = [GrammarSpec.regex(f"a{{{i}}}") for i in range(1, 4)]
    for s in specs:
        c.submit(s).result(timeout=60)
    assert not c.is_ready(specs[0]) and c.is_ready(specs[1]) and c.is_ready(specs[2])
    c.shutdown()


def test_grammar_status():
    waiting: Future = Future()
    assert so.grammar_status(waiting, 1.0, 30.0) is GrammarStatus.WAITING
    assert so.grammar_status(waiting, 1.0, None) is GrammarStatus.WAITING
    assert so.grammar_status(waiting, 30.0, 30.0) is GrammarStatus.TIMED_OUT
    done: Future = Future()
    done.set_result(object())
    assert so.grammar_status(done, 99.0, 30.0) is GrammarStatus.READY
    failed: Future = Future()
    failed.set_exception(GrammarCompileError("x"))
    assert so.grammar_status(failed, 0.0, 30.0) is GrammarStatus.FAILED
    cancelled: Future = Future()
    cancelled.cancel()
    assert so.grammar_status(cancelled, 0.0, 30.0) is GrammarStatus.FAILED


def test_grammar_syntax_detection():
    assert so.grammar_syntax('root ::= "a"') == "ebnf"
    assert so.grammar_syntax('# a comment with ::= in it\nstart: "a"') == "lark"
    assert so.grammar_syntax('start: "a"\n// root ::= x') == "lark"
    with pytest.raises(ValueError):
        GrammarSpec("grammar", "x")
    with pytest.raises(ValueError):
        GrammarSpec("yaml", "x")


# -- the API edge --------------------------------------------------------------------
def rf_schema(schema, **extra):
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "s", "schema": schema, **extra}}}


SCHEMA_PARAM = "response_format.json_schema.schema"
INVALID = [
    ({"response_format": "json"}, "response_format", "expected an object"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be one of"),
    ({"response_format": {"type": "structural_tag", "format": {}}}, "response_format.type",
     "not supported"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}},
     SCHEMA_PARAM, "required"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema",
     "unknown field"),
    (rf_schema({}, strict="yes"), "response_format.json_schema.strict", "boolean"),
    (rf_schema({}, extra=1), "response_format.json_schema.extra", "unknown field"),
    (rf_schema([1, 2]), SCHEMA_PARAM, "expected a JSON Schema object"),
    (rf_schema({"type": "strin"}), SCHEMA_PARAM, "invalid JSON schema"),
    (rf_schema({"type": "object", "required": "a"}), SCHEMA_PARAM, "invalid JSON schema"),
    (rf_schema({"type": "string", "maxLength": "3"}), SCHEMA_PARAM, "invalid JSON schema"),
    (rf_schema({"type": "integer", "minimum": 5, "maximum": 3}), SCHEMA_PARAM,
     "minimum greater than maximum"),
    (rf_schema({"$ref": "#/$defs/Missing"}), SCHEMA_PARAM, "Missing"),
    (rf_schema({"$schema": "http://example.com/my-meta", "type": "object"}), SCHEMA_PARAM,
     "unsupported $schema"),
    (rf_schema({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
     SCHEMA_PARAM, "cannot enforce `uniqueItems` (at #)"),
    (rf_schema({"type": "object", "properties": {"a": {"type": "string", "pattern": "^a",
                                                       "maxLength": 3}}}),
     SCHEMA_PARAM, "at #/properties/a"),
    ({"structured_outputs": "regex"}, "structured_outputs", "expected an object"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", "unknown field"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json",
     "not valid JSON"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex",
     "parenthesis is not closed"),
    ({"structured_outputs": {"regex": "(?i)abc"}}, "structured_outputs.regex",
     "invalid regex"),
    ({"structured_outputs": {"regex": r"(a)\1"}}, "structured_outputs.regex",
     "Backreference"),
    ({"structured_outputs": {"regex": r"\A[a-z]+\Z"}}, "structured_outputs.regex",
     r"the escape \A at position 0 is not supported"),
    ({"guided_regex": r"[\d\h]+"}, "guided_regex", r"the escape \h at position 3"),
    ({"structured_outputs": {"regex": r"\xZZ"}}, "structured_outputs.regex",
     "needs two hex digits"),
    (rf_schema({"type": "string", "pattern": r"^\w+\Z"}), SCHEMA_PARAM,
     r"cannot enforce the pattern '^\\w+\\Z' (the escape \Z at position 4"),
    (rf_schema({"type": "object", "patternProperties": {r"^\Qx": {"type": "integer"}}}),
     SCHEMA_PARAM, r"the escape \Q"),
    # in a schema xgrammar drops what it refuses in a bare regex (with a log line only)
    (rf_schema({"type": "string", "pattern": "^(?=b)[ab]{3}$"}), SCHEMA_PARAM,
     "the group '(?=b'... at position 1"),
    (rf_schema({"type": "string", "pattern": r"^(a)\1$"}), SCHEMA_PARAM,
     r"the escape \1 at position 4"),
    (rf_schema({"type": "object", "properties": {"a": {"$ref": "file:///etc/passwd"}}}),
     SCHEMA_PARAM, "the external `$ref` 'file:///etc/passwd'"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "non-empty"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "non-empty string"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty list"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice",
     "list of strings"),
    ({"structured_outputs": {"grammar": 'foo ::= "a"'}}, "structured_outputs.grammar",
     'root rule with name "root"'),
    ({"structured_outputs": {"grammar": 'root ::= "a'}}, "structured_outputs.grammar",
     "invalid EBNF grammar"),
    ({"structured_outputs": {"grammar": 'root: "a"'}}, "structured_outputs.grammar",
     "no start rule"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object",
     "expected true"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag",
     "not supported"),
    ({"structured_outputs": {"json": {}, "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "not supported"),
    ({"structured_outputs": {"json": {}, "disable_any_whitespace": 1}},
     "structured_outputs.disable_any_whitespace", "boolean"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs.regex",
     "only one structured-output constraint"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs.regex", "response_format is set too"),
    ({"structured_outputs": {"choice": ["a"]}, "guided_regex": "b"}, "guided_regex",
     "only one"),
    ({"guided_json": {"type": "strin"}}, "guided_json", "invalid JSON schema"),
    ({"guided_grammar": "root ::= nope"}, "guided_grammar", 'Rule "nope" is not defined'),
    ({"guided_json": {}, "guided_whitespace_pattern": r"\s*"}, "guided_whitespace_pattern",
     "not supported"),
    ({"guided_json": {}, "guided_decoding_backend": 3}, "guided_decoding_backend", "string"),
    ({"structured_outputs": {"regex": "a" * (1 << 18) + "b"}}, "structured_outputs.regex",
     "too large"),
    # vLLM <= 0.11's top-level name: refused like structured_outputs.structural_tag,
    # never ignored (review finding 7)
    ({"structural_tag": '{"type": "structural_tag", "structures": [], "triggers": []}'},
     "structural_tag", "structural tags are not supported"),
    # a valid draft-07 tuple is not "invalid": the message names what cannot be enforced
    # (review finding 11)
    (rf_schema({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                "properties": {"xy": {"type": "array", "items": [{"type": "number"},
                                                                {"type": "number"}]}}}),
     SCHEMA_PARAM, "cannot enforce array-form `items` (draft-07 tuples; write them as "
                   "`prefixItems`, with `items` for the rest) (at #/properties/xy)"),
]


@pytest.mark.parametrize("body,param,message", INVALID)
def test_invalid_specs_are_400_naming_the_field(body, param, message):
    with pytest.raises(APIError) as err:
        grammar_spec_from_request(body)
    assert err.value.status == 400 and err.value.param == param
    assert message in err.value.message and err.value.message.startswith(param)
    assert "/project/cpp" not in err.value.message      # xgrammar's source paths cut


def test_valid_request_fields():
    assert grammar_spec_from_request({}) is None
    assert grammar_spec_from_request({"response_format": {"type": "text"}}) is None
    assert grammar_spec_from_request({"response_format": None,
                                      "structured_outputs": {"json_object": False}}) is None
    assert grammar_spec_from_request({"response_format": {"type": "json_object"}}) == \
        GrammarSpec.json_object()
    s = {"type": "object", "properties": {"a": {"type": "integer"}}}
    want = GrammarSpec.json_schema(s)
    assert grammar_spec_from_request(rf_schema(s, strict=True, description="d")) == want
    assert grammar_spec_from_request({"structured_outputs": {"json": s}}) == want
    assert grammar_spec_from_request({"structured_outputs": {"json": json.dumps(s)}}) == want
    assert grammar_spec_from_request({"guided_json": s,
                                      "guided_decoding_backend": "outlines"}) == want
    assert grammar_spec_from_request({"guided_regex": "a+"}) == GrammarSpec.regex("a+")
    for ok in (r"[\b\d]\x41\u0041\.\\\/", r"\w+\s\S\W\D\0\t\n\r\f\v"):
        assert grammar_spec_from_request({"structured_outputs": {"regex": ok}}).text == ok
    assert grammar_spec_from_request({"structured_outputs": {
        "json_object": True, "disable_any_whitespace": True, "disable_fallback": True,
        "disable_additional_properties": True}}) == GrammarSpec.json_object(False)
    # response_format text plus a structured_outputs constraint is one constraint.
    assert grammar_spec_from_request({"response_format": {"type": "text"},
                                      "structured_outputs": {"regex": "a"}}) == \
        GrammarSpec.regex("a")
    # pydantic's schemas pass: $defs/$ref, Optional (anyOf null), enums with titles.
    pyd = {"$defs": {"Color": {"enum": ["r", "g"], "title": "Color", "type": "string"},
                     "Addr": {"properties": {"city": {"title": "City", "type": "string"}},
                              "required": ["city"], "title": "Addr", "type": "object"}},
           "properties": {"color": {"$ref": "#/$defs/Color"},
                          "addr": {"$ref": "#/$defs/Addr", "description": "where"},
                          "note": {"anyOf": [{"type": "string"}, {"type": "null"}],
                                   "default": None, "title": "Note"}},
           "required": ["color", "addr"], "title": "Thing", "type": "object"}
    assert grammar_spec_from_request(rf_schema(pyd)).kind == "json_schema"


def test_edge_checks_are_cached():
    spec_problem.cache_clear()
    body = rf_schema(SCHEMA)
    for _ in range(5):
        grammar_spec_from_request(body)
    info = spec_problem.cache_info()
    assert info.misses == 1 and info.hits == 4
    for _ in range(3):
        with pytest.raises(APIError):
            grammar_spec_from_request({"structured_outputs": {"regex": "(ab"}})
    info = spec_problem.cache_info()
    assert info.misses == 2 and info.hits == 6


# -- the refused-keyword list stays true to xgrammar -------------------------------
REFUSED = {
    "uniqueItems": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2},
                    "uniqueItems": True, "minItems": 2, "maxItems": 3},
    "contains": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3},
                 "contains": {"const": 2}, "minItems": 1, "maxItems": 3},
    "not": {"type": "integer", "not": {"minimum": 0}},
    "if": {"type": "integer", "if": {"minimum": 0}, "then": {"maximum": 9}},
    "dependentRequired": {"type": "object", "properties": {"a": {"type": "integer"},
                                                           "b": {"type": "integer"}},
                          "dependentRequired": {"a": ["b"]}},
    "dependentSchemas": {"type": "object", "properties": {"a": {"type": "integer"},
                                                          "b": {"type": "integer"}},
                         "dependentSchemas": {"a": {"required": ["b"]}}},
    "multipleOf": {"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 3},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                         "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "integer"}},
                         "required": ["b"]}]},
    "required": {"type": "object", "properties": {"a": {"type": "integer"}},
                 "required": ["a", "zz"]},
    "pattern+maxLength": {"type": "string", "pattern": "^[a-c]+$", "maxLength": 2},
    "format+minLength": {"type": "string", "format": "date", "minLength": 20},
    "$ref+maximum": {"$defs": {"X": {"type": "integer"}}, "$ref": "#/$defs/X",
                     "minimum": 0, "maximum": 3},
    "enum+maxLength": {"type": "string", "enum": ["abc", "d"], "maxLength": 1},
    "pattern lookahead": {"type": "string", "pattern": "^(?=b)[ab]{3}$"},
}
ENFORCED = {
    "integer multipleOf": {"type": "integer", "multipleOf": 7},
    "min/max": {"type": "integer", "minimum": 3, "maximum": 17},
    "exclusive": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "items bounds": {"type": "array", "items": {"type": "integer"}, "minItems": 2,
                     "maxItems": 3},
    "string length": {"type": "string", "minLength": 2, "maxLength": 4},
    "nested lengths": {"type": "object", "properties": {
        "a": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}]},
        "b": {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 2}},
        "required": ["a", "b"], "propertyNames": {"maxLength": 1}},
    "pattern": {"type": "string", "pattern": "^[a-c]{2}$"},
    "format": {"type": "string", "format": "date"},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
    "const": {"const": {"a": 1}},
    "enum": {"enum": ["x", 1, None]},
    "minProperties": {"type": "object", "additionalProperties": {"type": "integer"},
                      "minProperties": 2, "maxProperties": 2},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^x"},
                      "additionalProperties": {"type": "integer"}},
    "patternProperties": {"type": "object", "patternProperties": {"^x": {"type": "integer"}},
                          "additionalProperties": False},
    "strict additionalProperties": {"type": "object",
                                    "properties": {"a": {"type": "integer"}}},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}],
                    "items": False},
    "single allOf": {"$defs": {"X": {"type": "integer", "minimum": 1, "maximum": 3}},
                     "type": "object", "properties": {"a": {"allOf": [{"$ref": "#/$defs/X"}]}},
                     "required": ["a"]},
    "type list": {"type": ["integer", "null"]},
}


@pytest.fixture(scope="module")
def char_compiler():
    vocab = ["<eos>", "\t", "\x01"] + [chr(i) for i in range(32, 127)]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[0])
    return vocab, xgr.GrammarCompiler(info, max_threads=1)


def walk_outputs(char_compiler, schema, n: int, seed: int) -> list[str]:
    """Up to `n` random finished strings of the compiled schema over a one-char
    vocabulary (closing characters favoured, so walks end), at least n // 2."""
    vocab, comp = char_compiler
    cg = comp.compile_grammar(so.parse_grammar(GrammarSpec.json_schema(schema, False)))
    rng, outs = random.Random(seed), []
    bm = torch.zeros(1, so.bitmask_words(len(vocab)), dtype=torch.int32)
    shifts = torch.arange(32, dtype=torch.int32)
    weights = [6.0 if ch in '"}],' else 1.0 for ch in vocab]
    for _ in range(2 * n):
        m, text = xgr.GrammarMatcher(cg), []
        for _ in range(80):
            m.fill_next_token_bitmask(bm)
            bits = ((bm[0].unsqueeze(-1) >> shifts) & 1).flatten()[:len(vocab)]
            allowed = bits.nonzero().flatten().tolist()
            if 0 in allowed and (rng.random() < 0.5 or allowed == [0]):
                outs.append("".join(text))
                break
            choices = [a for a in allowed if a != 0]
            tok = rng.choices(choices, [weights[a] for a in choices])[0]
            assert m.accept_token(tok)
            text.append(vocab[tok])
        if len(outs) == n:
            break
    assert len(outs) >= n // 2, f"only {len(outs)} walks finished"
    return outs


def violations(schema, outs: list[str]) -> int:
    """Outputs that are not strict JSON valid against `schema`."""
    bad = 0
    for s in outs:
        try:
            jsonschema.validate(json.loads(s), schema)
        except (ValueError, jsonschema.ValidationError):
            bad += 1
    return bad


def test_length_bounded_strings_are_strict_json(char_compiler):
    """xgrammar's own minLength/maxLength path lets raw control characters into the
    string (mlc-ai/xgrammar#800); ours rewrites it as a pattern and does not. When the
    first assertion fails, xgrammar is fixed: drop `xgrammar_workarounds.py`."""
    _, comp = char_compiler
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 6}},
              "required": ["s"]}
    raw = comp.compile_json_schema(json.dumps(schema), any_whitespace=False)
    m = xgr.GrammarMatcher(raw)
    assert m.accept_string('{"s": "a\tb\x01"}'), "xgrammar fixed its length path?"
    outs = walk_outputs(char_compiler, schema, 60, seed=9)
    assert violations(schema, outs) == 0
    assert len({len(json.loads(o)["s"]) for o in outs}) >= 5


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_keywords_are_ones_xgrammar_drops(char_compiler, name):
    """Each refused keyword: refused at the edge, and xgrammar (still) lets outputs
    through that break it. When an upgrade starts enforcing one, this fails: then
    take it off the list in json_schema_support.py."""
    schema = REFUSED[name]
    assert unsupported_feature(schema) is not None
    assert violations(schema, walk_outputs(char_compiler, schema, 60, seed=7)) > 0


@pytest.mark.parametrize("name", sorted(ENFORCED))
def test_accepted_keywords_are_enforced(char_compiler, name):
    schema = ENFORCED[name]
    assert unsupported_feature(schema) is None and spec_problem(
        GrammarSpec.json_schema(schema)) is None
    assert violations(schema, walk_outputs(char_compiler, schema, 60, seed=8)) == 0
