"""Mixed steps through the pieces of the forward (engine/piecewise.py), run eagerly on
the CPU: the padding, the static buffers and the attention between the pieces must
give the tokens the plain forward gives. The CUDA graphs themselves are checked on the
GPU (benchmarks/gpu_check.py parity)."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from pagefleet.server import LLM, SamplingParams  # noqa: E402
from pagefleet.server.engine.piecewise import piece_sizes  # noqa: E402
from tests.server.helpers import random_prompts  # noqa: E402


def test_piece_sizes():
    sizes = piece_sizes(8192)
    assert sizes[:3] == [16, 32, 48] and sizes[-1] == 1024
    assert sizes == sorted(set(sizes))
    # At most an eighth of a step's tokens are padding above 128 tokens.
    assert all((b - a) * 8 <= b for a, b in itertools.pairwise(sizes) if a >= 128)
    assert piece_sizes(100) == [16, 32, 48, 64, 80, 96, 100]   # the cap is a size itself
    assert piece_sizes(16) == [16]
    assert piece_sizes(1) == []    # one token a step: never a mixed step to capture


def _generate(model_dir, pieces: bool, prompts, params):
    llm = LLM(model_dir, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=40,
              block_size=16, enforce_eager=True)
    runner = llm.engine.runner
    runner._setup_decode_path(force=True, pieces=pieces)
    outs = llm.generate(prompts, params)
    stats = llm.stats()
    llm.engine.kv.check_whole()
    used = runner._pieces.num_steps if runner._pieces is not None else 0

    def logprobs(o):
        def norm(lps):   # per position: {token id: logprob}, rounded past float noise
            return [{k: round(v, 4) for k, v in d.items()} if d else None
                    for d in (lps or [])]
        return norm(o.prompt_logprobs), norm(o.outputs[0].logprobs)
    return [(o.outputs[0].token_ids, logprobs(o)) for o in outs], stats, used


def test_mixed_steps_through_the_pieces_give_the_plain_forwards_tokens(tiny_models):
    """Prompts of different lengths, chunked (40 tokens a step) and sharing a prefix:
    steps mix decode rows with prefill chunks and padding (e.g. 27 tokens run as 32);
    greedy and seeded sampling give the same tokens as the plain forward."""
    model_dir = tiny_models("qwen3-pieces", arch="qwen3", num_layers=2)
    shared = random_prompts(11, [37], 512)[0]
    prompts = [shared + t for t in random_prompts(12, [5, 23], 512)] + random_prompts(13, [61, 9, 30], 512)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (7, 4, 9, 6)]
    params.append(SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=8, ignore_eos=True))
    # Prompt logprobs read the hidden rows of a padded step; output logprobs its samples.
    params[3] = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2,
                               logprobs=3)
    plain, _, used_plain = _generate(model_dir, False, prompts, params)
    pieced, stats, used = _generate(model_dir, True, prompts, params)
    assert used_plain == 0 and used > 3           # mixed steps really ran through the pieces
    assert stats["prefix_cache_hits"] > 0
    assert pieced == plain
    assert sum(len(set(s)) for s, _ in plain) >= 3 * len(prompts)
    assert plain[3][1][0] and plain[3][1][1]      # the logprobs were really there


def test_a_deleted_engine_with_pieces_is_freed_at_once(tiny_models):
    """The pieces hold tensors, not the runner: no reference cycle keeps a deleted
    engine (and its KV cache, most of a GPU) alive until a garbage collection. On the
    H200 a second LLM in one process found no memory for its KV cache because of one."""
    import gc
    import weakref

    model_dir = tiny_models("qwen3-pieces", arch="qwen3", num_layers=2)
    llm = LLM(model_dir, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=40,
              block_size=16, enforce_eager=True)
    runner = llm.engine.runner
    runner._setup_decode_path(force=True, pieces=True)
    assert runner._pieces is not None
    alive = weakref.ref(runner)
    del runner
    gc.disable()
    try:
        del llm
        assert alive() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("mode,pieces,decode_graphs", [("FULL_AND_PIECEWISE", True, True),
                                                       ("FULL_DECODE_ONLY", False, True),
                                                       ("NONE", False, False)])
def test_cudagraph_mode_picks_what_is_graphed(tiny_models, mode, pieces, decode_graphs):
    """--cudagraph-mode (vLLM's names) turns the pieces off alone, or every graph; the
    runner's padded decode path stays (its shapes are the graphs' either way)."""
    model_dir = tiny_models("qwen3-pieces", arch="qwen3", num_layers=2)
    llm = LLM(model_dir, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=40,
              block_size=16, cudagraph_mode=mode)
    runner = llm.engine.runner
    runner._setup_decode_path(force=True)
    assert (runner._pieces is not None) is pieces
    assert runner._graphs_off() is not decode_graphs
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))[0].outputs


def test_cudagraph_mode_flag_is_checked_at_the_edge():
    from pagefleet.server.cli import build_configs
    from pagefleet.server.config import ConfigError, EngineConfig
    engine, _, _ = build_configs(["some/model", "--cudagraph-mode", "FULL_DECODE_ONLY"])
    assert engine.cudagraph_mode == "FULL_DECODE_ONLY"
    with pytest.raises(SystemExit):   # argparse: not one of the choices
        build_configs(["some/model", "--cudagraph-mode", "PIECEWISE"])
    with pytest.raises(ConfigError, match="cudagraph-mode: must be one of FULL_AND_PIECEWISE"):
        EngineConfig(model="m", cudagraph_mode="FULL").validate()
