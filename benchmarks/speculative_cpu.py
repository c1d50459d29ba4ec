"""Speculative decoding on CPU: SmolLM2-135M-Instruct, batch 1, greedy; plain decoding vs n-gram prompt lookup.

    python3 benchmarks/speculative_cpu.py [--workspace DIR] [--max-new-tokens 128] [--num-wiki 4] [--num-mt 8]
        [--num-speculative-tokens 2,4] [--draft-layers 8 --draft-tokens 3] [--dtype fp32|bf16]

Prompt sets: `wiki-rewrite` and `wiki-summary` (a WikiText-2 test paragraph to rewrite / summarise), `code-edit` (a
Python block to return with one change), `mt-bench` (MT-bench first turns: little to copy). Each prompt runs on
both engines, alternately first, so the load of a shared machine falls on both alike; a run is timed from its first
token to its last (decode only: the prompt's prefill is the same work in both), in wall time and in this process's
CPU time. torch runs one thread: on 2 cores shared with other work, two threads spin against each other (a plain
decode step measured 100 ms of CPU with one thread, 300 ms with two). Outputs are checked against plain decoding:
identical prompts and the share of tokens before the first difference. `--dtype bf16`: oneDNN's bf16 GEMMs cost about
the same for 1 to 8 token rows on AVX512-BF16 CPUs (fp32 ones grow with the rows), so a verification costs about a
plain step. In bf16 the outputs may part from plain decoding at a near-tie: a verification's rows go through oneDNN's
GEMM where a plain step's one row takes its GEMV, and SDPA's sums depend on the key count of the chunk, so the same
position rounds differently (as any change of batch shape does in bf16; fp32 is token-identical, the tests' case).
Writes ./speculative_cpu.json (or $OUT/) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmd.turbomind.engine import Engine  # noqa: E402
from lmd.turbomind.gen_config import GenerationConfig  # noqa: E402
from lmd.turbomind.speculative.config import SpeculativeConfig  # noqa: E402
from lmd.turbomind.speculative.layer_draft import first_layers_workspace  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared"

CODE_BLOCKS = [
    '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out''',
    '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1] if self.items else None

    def __len__(self):
        return len(self.items)''',
    '''def read_config(path):
    config = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config''',
    '''def binary_search(items, target):
    low, high = 0, len(items) - 1
    while low <= high:
        mid = (low + high) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            low = mid + 1
        else:
            high = mid - 1
    return -1''',
]
CODE_EDITS = ["Add a docstring to the function", "Rename the class to LifoStack", "Add type hints to the function",
              "Rename the variable `mid` to `middle`"]


def wiki_paragraphs(count: int, min_words: int = 90, max_words: int = 160) -> list[str]:
    text = (SHARED / "data" / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    text = re.sub(r" @(.)@ ", r"\1", text)  # WikiText's split number separators: 1 @,@ 000 -> 1,000
    paragraphs = [p.strip() for p in text.split("\n") if p.strip() and not p.strip().startswith("=")]
    picked = [p for p in paragraphs if min_words <= len(p.split()) <= max_words]
    return picked[:count]


def prompt_sets(num_wiki: int, num_mt: int) -> dict[str, list[str]]:
    paragraphs = wiki_paragraphs(num_wiki)
    mt = [json.loads(line)["turns"][0]
          for line in (SHARED / "data" / "chat_prompts" / "mt_bench_question.jsonl").read_text().splitlines()]
    return {
        "wiki-rewrite": [f"Rewrite the following paragraph in clear English, keeping every fact:\n\n{p}"
                         for p in paragraphs],
        "wiki-summary": [f"Summarise the following paragraph in a few sentences:\n\n{p}" for p in paragraphs],
        "code-edit": [f"{edit}. Return the whole code.\n\n```python\n{code}\n```"
                      for edit, code in zip(CODE_EDITS, CODE_BLOCKS, strict=True)],
        "mt-bench": mt[:num_mt],
    }


def timed(engine: Engine, prompt: str, config: GenerationConfig) -> tuple[list[int], float, float, int]:
    """(tokens, decode wall and CPU seconds from the first token to the last, engine steps)."""
    steps_before = engine.stats().steps
    stream = engine.generate(prompt, config)
    first = first_cpu = None
    tokens: list[int] = []
    while engine.step():
        if first is None and not stream._queue.empty():
            first, first_cpu = time.perf_counter(), time.process_time()
    end, end_cpu = time.perf_counter(), time.process_time()
    for delta in stream:
        tokens += delta.token_ids
    return tokens, end - (first or end), end_cpu - (first_cpu or end_cpu), engine.stats().steps - steps_before


def deploy_workspace(path: Path) -> Path:
    if not (path / "triton_models").is_dir():
        from lmd.deploy.converter import deploy

        deploy("hf", str(SHARED / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"), str(path), dtype="float32",
               progress=False)
    return path


def same_prefix(tokens: list[int], reference: list[int]) -> int:
    """How many leading tokens agree (bf16 outputs may part at a near-tie: a verification's GEMMs have more rows)."""
    pairs = zip(tokens, reference, strict=False)
    return next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(tokens), len(reference)))


def summarise(rows: list[dict], label: str) -> dict:
    plain_s, spec_s = sum(r["plain_s"] for r in rows), sum(r[f"{label}_s"] for r in rows)
    plain_cpu, spec_cpu = sum(r["plain_cpu_s"] for r in rows), sum(r[f"{label}_cpu_s"] for r in rows)
    proposed, accepted = sum(r[f"{label}_proposed"] for r in rows), sum(r[f"{label}_accepted"] for r in rows)
    verifications = sum(r[f"{label}_verifications"] for r in rows)
    return dict(identical=all(r[f"{label}_identical"] for r in rows),
                identical_prompts=sum(r[f"{label}_identical"] for r in rows),
                same_prefix_share=sum(r[f"{label}_same_prefix"] for r in rows) / sum(r["tokens"] for r in rows),
                plain_s=plain_s, spec_s=spec_s,
                speedup=plain_s / spec_s, cpu_speedup=plain_cpu / spec_cpu,
                worst_prompt_cpu_speedup=min(r["plain_cpu_s"] / r[f"{label}_cpu_s"] for r in rows),
                steps_ratio=sum(r["plain_steps"] for r in rows) / sum(r[f"{label}_steps"] for r in rows),
                acceptance=accepted / proposed if proposed else 0.0,
                mean_accepted_length=1 + accepted / verifications if verifications else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workspace", default="/tmp/lmd-smol-fp32-ws")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-wiki", type=int, default=4)
    parser.add_argument("--num-mt", type=int, default=8)
    parser.add_argument("--num-speculative-tokens", default="2,4", help="comma list: one n-gram engine per K")
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--sets", default="wiki-rewrite,wiki-summary,code-edit,mt-bench")
    parser.add_argument("--draft-layers", type=int, default=0,
                        help="also a draft-model engine: the model's first N layers and its head (0: none)")
    parser.add_argument("--draft-tokens", type=int, default=3, help="K of the draft-model engine")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                        help="the engines' compute dtype (the workspace is fp32; bf16 casts it at load)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ws = deploy_workspace(Path(args.workspace))
    options = dict(start=False, cache_max_entry_count=64, cache_block_seq_len=64, session_len=4096, dtype=args.dtype)
    engines = {"plain": Engine(ws, **options)}
    for k in (int(x) for x in args.num_speculative_tokens.split(",")):
        spec = SpeculativeConfig("ngram", k, prompt_lookup_min=args.prompt_lookup_min)
        engines[f"ngram-k{k}"] = Engine(ws, speculative=spec, **options)
    if args.draft_layers:
        draft = Path(f"{args.workspace}-first{args.draft_layers}")
        if not draft.is_dir():
            first_layers_workspace(ws, args.draft_layers, draft)
        spec = SpeculativeConfig("draft", args.draft_tokens, model=str(draft))
        engines[f"draft-l{args.draft_layers}-k{args.draft_tokens}"] = Engine(ws, speculative=spec, **options)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=0)
    sets = prompt_sets(args.num_wiki, args.num_mt)
    results = {}
    for name in args.sets.split(","):
        rows = []
        for i, prompt in enumerate(sets[name]):
            order = list(engines.items())
            order = order if i % 2 == 0 else order[::-1]  # each engine first as often as last
            before = {label: engine.stats() for label, engine in order}
            run = {label: timed(engine, prompt, config) for label, engine in order}
            row: dict = dict(tokens=len(run["plain"][0]), plain_s=run["plain"][1], plain_cpu_s=run["plain"][2],
                             plain_steps=run["plain"][3])
            for label, (tokens, wall, cpu, steps) in run.items():
                if label == "plain":
                    continue
                after, was = engines[label].stats(), before[label]
                row.update({f"{label}_identical": tokens == run["plain"][0],
                            f"{label}_same_prefix": same_prefix(tokens, run["plain"][0]), f"{label}_s": wall,
                            f"{label}_cpu_s": cpu, f"{label}_steps": steps,
                            f"{label}_proposed": after.spec_proposed_tokens - was.spec_proposed_tokens,
                            f"{label}_accepted": after.spec_accepted_tokens - was.spec_accepted_tokens,
                            f"{label}_verifications": after.spec_verifications - was.spec_verifications})
            rows.append(row)
            print(name, i, row, flush=True)
        results[name] = dict(prompts=len(rows), tokens=sum(r["tokens"] for r in rows), rows=rows,
                             **{label: summarise(rows, label) for label in engines if label != "plain"})
    out = Path(os.environ.get("OUT", ".")) / "speculative_cpu.json"
    out.write_text(json.dumps(dict(args=vars(args), results=results), indent=1))
    print(f"\n{'set':<14}{'engine':<10}{'prompts':>8}{'tokens':>7}{'same':>6}{'prefix':>7}{'plain s':>9}{'spec s':>8}"
          f"{'wall x':>8}{'CPU x':>7}{'worst':>7}{'steps x':>8}{'accept':>7}{'mean len':>9}")
    for name, r in results.items():
        for label in engines:
            if label == "plain":
                continue
            m = r[label]
            print(f"{name:<14}{label:<10}{r['prompts']:>8}{r['tokens']:>7}{m['identical_prompts']:>6}"
                  f"{m['same_prefix_share']:>7.0%}"
                  f"{m['plain_s']:>9.2f}{m['spec_s']:>8.2f}{m['speedup']:>7.2f}x{m['cpu_speedup']:>6.2f}x"
                  f"{m['worst_prompt_cpu_speedup']:>6.2f}x{m['steps_ratio']:>7.2f}x{m['acceptance']:>7.2f}"
                  f"{m['mean_accepted_length']:>9.2f}")


if __name__ == "__main__":
    main()
