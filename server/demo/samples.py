"""Ask a running server the questions docs/demo.md shows, and print the replies as
Markdown (how the doc's sample replies were made: real requests to `pagefleet serve`).

    pagefleet serve &            # the demo model
    python -m pagefleet.server.demo.samples --base-url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import json

QUESTIONS = (
    "Hello, who are you?",
    "What is pagefleet?",
    "What is paged attention?",
    "How do I serve a real model?",
    "What is the capital of Japan?",
    "How do you say hello in Japanese?",
    "Tell me a story about a fox.",
    "Tell me a joke.",
    "What is 17 times 23?",
    "Can you fix my car?",
)


def main(argv: list[str] | None = None) -> int:
    from openai import OpenAI

    from pagefleet.server.demo.corpus import WEATHER_TOOL

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="pagefleet-demo")
    p.add_argument("--seeds", type=int, default=2, help="sampled replies per question")
    args = p.parse_args(argv)
    client = OpenAI(base_url=args.base_url + "/v1", api_key="none", max_retries=0)

    def ask(messages, **kw) -> str:
        r = client.chat.completions.create(model=args.model, messages=messages, max_tokens=160, **kw)
        return r.choices[0].message.content

    print("| question | greedy (`temperature: 0`) | sampled (the model's defaults, `seed` 0..) |")
    print("| --- | --- | --- |")
    for q in QUESTIONS:
        msgs = [{"role": "user", "content": q}]
        sampled = "<br>".join(ask(msgs, seed=s) for s in range(args.seeds))
        print(f"| {q} | {ask(msgs, temperature=0)} | {sampled} |")
    named = [{"role": "system", "content": "You are Ada, a helpful assistant."},
             {"role": "user", "content": "What is your name?"}]
    print(f"| (system: You are Ada, a helpful assistant.) What is your name? | "
          f"{ask(named, temperature=0)} | |")
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    print(f"| What is the weather in Paris? (no tools) | {ask(weather, temperature=0)} | |")
    # The tools go in through chat_template_kwargs (vLLM's field too), so the raw
    # hermes-style text shows whether or not the server parses tool calls.
    raw = ask(weather, temperature=0,
              extra_body={"chat_template_kwargs": {"tools": [WEATHER_TOOL]}})
    print(f"| What is the weather in Paris? (get_weather tool) | `{json.dumps(raw)}` | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
