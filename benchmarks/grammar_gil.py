"""Does xgrammar release the GIL while it compiles? (CPU; no GPU needed.)

A ticker thread sleeps 1 ms in a loop and records the gaps between its wake-ups while
the main thread compiles a large JSON schema for a 150k-token vocabulary. If the compile
held the GIL, the ticker could not run until it returned: its longest gap would be the
compile's whole duration. A control does the same around `sorted()` of a big list (C
code that keeps the GIL). Also times `fill()` of the per-step bitmask at several batch
sizes, the structured-output work on the step loop's host side.

    python benchmarks/grammar_gil.py [--vocab 150000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import string
import threading
import time

import torch
import xgrammar as xgr

from pagefleet.server.engine import structured_output as so


def big_vocab(n: int, seed: int = 0) -> list[str]:
    """A vocabulary shaped like a real BPE one: mostly (space-prefixed) words, some
    numbers, a few punctuation runs, every printable character on its own."""
    rng = random.Random(seed)
    lower = string.ascii_lowercase
    words: set[str] = set()
    while len(words) < n:
        r = rng.random()
        if r < 0.8:
            w = "".join(rng.choice(lower) for _ in range(rng.randint(2, 10)))
            w = w.capitalize() if rng.random() < 0.15 else w
            words.add((" " if rng.random() < 0.6 else "") + w)
        elif r < 0.9:
            words.add("".join(rng.choice(string.digits) for _ in range(rng.randint(1, 3))))
        else:
            words.add("".join(rng.choice(' {}[]":,.-_\n') for _ in range(rng.randint(2, 3))))
    base = ["<eos>"] + list(string.printable)
    return base + sorted(words - set(base))[:n - len(base)]


def schema(fields: int) -> dict:
    item = {"type": "object", "properties": {
        "kind": {"enum": ["a", "b", "c"]}, "n": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "x": {"type": "number"}}, "required": ["kind", "n"]}
    return {"type": "object", "properties": {f"f{i}": item for i in range(fields)},
            "required": [f"f{i}" for i in range(fields)]}


def longest_gap_during(fn) -> tuple[float, float, float]:
    """(call seconds, ticker's longest gap, ticker's median gap) while `fn` runs."""
    stop, gaps = threading.Event(), []

    def tick() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    th = threading.Thread(target=tick)
    th.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    stop.set()
    th.join()
    gaps.sort()
    return dt, gaps[-1], gaps[len(gaps) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=150_000)
    ap.add_argument("--fields", type=int, default=40)
    ap.add_argument("--json")
    args = ap.parse_args()
    vocab = big_vocab(args.vocab)
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[0])
    spec = so.GrammarSpec.json_schema(schema(args.fields))
    out: dict = {"vocab": len(vocab), "fields": args.fields}
    for threads in (1, 4):
        comp = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        dt, gap, med = longest_gap_during(
            lambda c=comp: c.compile_grammar(so.parse_grammar(spec)))
        out[f"compile_threads_{threads}"] = {"compile_s": dt, "longest_gap_s": gap,
                                             "median_gap_s": med}
        print(f"compile (max_threads={threads}): {dt * 1e3:.0f} ms; ticker's longest gap "
              f"{gap * 1e3:.1f} ms, median {med * 1e3:.2f} ms")
    data = [random.random() for _ in range(3_000_000)]
    dt, gap, med = longest_gap_during(lambda: sorted(data))
    out["control_sorted"] = {"call_s": dt, "longest_gap_s": gap, "median_gap_s": med}
    print(f"control sorted(): {dt * 1e3:.0f} ms; ticker's longest gap {gap * 1e3:.1f} ms")
    compiled = xgr.GrammarCompiler(info, max_threads=4).compile_grammar(so.parse_grammar(spec))
    words = so.bitmask_words(len(vocab))
    out["fill_ms"] = {}
    positions = {"object start": "", "in a string": '{"f0": {"kind": "a", "n": 1, "tags": ["x',
                 "in a number": '{"f0": {"kind": "a", "n": 1'}
    for where, prefix in positions.items():
        for rows in (1, 16, 64, 256):
            states = [so.StructuredState(compiled, [0]) for _ in range(rows)]
            for st in states:
                assert not prefix or st.matcher.accept_string(prefix)
            bm = torch.empty(rows, words, dtype=torch.int32)
            pairs = list(enumerate(states))
            so.fill(pairs, bm)
            reps = max(3, 100 // rows)
            t0 = time.perf_counter()
            for _ in range(reps):
                so.fill(pairs, bm)
            ms = (time.perf_counter() - t0) / reps * 1e3
            out["fill_ms"][f"{where}, {rows} rows"] = ms
            print(f"fill at {where:12s} {rows:>3} rows: {ms:8.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
