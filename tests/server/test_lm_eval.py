"""lm-evaluation-harness runs a local multiple-choice task (inline data, no download)
through `local-completions` against a real server, and its loglikelihoods equal those
computed directly from the HF model on the same weights (float32, CPU) within 1e-4
(issue 11: completion logprobs + echo make loglikelihood tasks work)."""

from __future__ import annotations

import json

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from tests.server.helpers_serve import ThreadServer  # noqa: E402

DOCS = [
    {"question": "The model reads the cache and the", "choices": ["block", "queue", "red"],
     "answer": 0},
    {"question": "One two three", "choices": ["four", "ten", "hello world"], "answer": 0},
    {"question": "Deploy the replica on the", "choices": ["node", "cluster", "GPU"],
     "answer": 1},
    {"question": "Fast or slow, the decode", "choices": ["kernel", "latency", "prefill"],
     "answer": 2},
]


def task_dir(tmp_path) -> tuple[str, str]:
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps(d) for d in DOCS) + "\n")
    (tmp_path / "pf_tiny_mc.yaml").write_text(f"""task: pf_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    return str(tmp_path), "pf_tiny_mc"


def hf_loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    with torch.inference_mode():
        lp = model(input_ids=ids).logits[0].float().log_softmax(-1)
    n = len(context)
    return sum(lp[n - 1 + k, t].item() for k, t in enumerate(continuation))


def test_lm_eval_loglikelihoods_equal_hf(tiny_models, tmp_path, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model_dir = tiny_models("qwen3")
    include, task = task_dir(tmp_path)
    srv = ThreadServer(model_dir, max_model_len=512, max_num_seqs=8).start()
    try:
        args = dict(model="tiny", base_url=srv.url + "/v1/completions",
                    tokenizer_backend="huggingface", tokenizer=str(model_dir),
                    tokenized_requests=True, num_concurrent=1, max_retries=1, max_length=512)
        out = simple_evaluate(model="local-completions", model_args=args, tasks=[task],
                              task_manager=TaskManager(include_path=include), log_samples=True,
                              batch_size=1)
    finally:
        srv.stop()
    samples = out["samples"][task]
    assert len(samples) == len(DOCS)
    lm = LocalCompletionsAPI(**args)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    compared = 0
    for s in samples:
        for (ctx, cont), resp in zip(s["arguments"], s["resps"]):
            ll = resp[0][0]
            ctx_enc, cont_enc = lm._encode_pair(ctx, cont)
            ref = hf_loglikelihood(hf, ctx_enc, cont_enc)
            assert ll == pytest.approx(ref, abs=1e-4), (ctx, cont, ll, ref)
            compared += 1
    assert compared == sum(len(d["choices"]) for d in DOCS)
    assert "acc,none" in out["results"][task]
