"""ar, sd, tree and easyspec on the reference pair, HumanEval, in the EasySpec paper's Table 2 format:
draft and verify time per 100 tokens, total, speedup over ar, acceptance rate (ar's row counts all of its time
as verify time: it is all target time).

    python benchmarks/easyspec_humaneval.py --num-prompts 3 --max-new-tokens 64 --temperature 0 0.8

Every strategy gets the same hardware budget, both cores: ar, sd and tree run in this process with 2 threads
(cpu:0-1); easyspec drafts with one rank on cpu:0 (this process, 1 thread) and one worker on cpu:1, and
verifies with 2 threads. Each variant has its own Engine (the pair loads once per variant); prompts are
interleaved across variants after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="Qwen/Qwen2.5-Coder-1.5B-Instruct")
    p.add_argument("--draft", default="Qwen/Qwen2.5-Coder-0.5B-Instruct")
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.8])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--lookahead", type=int, default=5)
    p.add_argument("--tree-width", type=int, default=4)
    p.add_argument("--tree-depth", type=int, default=5)
    p.add_argument("--layer-parallel-size", type=int, default=2)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)

    from paraspec import Engine, SamplingParams
    from paraspec.bench.datasets import load_prompts

    prompts = [bp.as_input(chat=True) for bp in load_prompts("humaneval", args.num_prompts)]
    tree = dict(tree_width=args.tree_width, tree_depth=args.tree_depth, tree_budget=args.tree_width * args.tree_depth)
    variants = {
        "ar": dict(strategy="ar"),
        "sd": dict(strategy="sd", lookahead=args.lookahead, adaptive=False),  # the paper's baseline: fixed k
        "tree": dict(strategy="tree", **tree),
        # drafting spread over cpu:0 (this process) and cpu:1 (a worker), one rank each
        "easyspec": dict(
            strategy="easyspec",
            draft_devices=["cpu:0", "cpu:1"],
            layer_parallel_size=args.layer_parallel_size,
            layer_groups="",
            calibration=True,
            **tree,
        ),
    }
    engines = {}
    rows = []
    try:
        for name, kwargs in variants.items():  # load, then warm up (easyspec starts its draft worker)
            kwargs = {"draft_devices": ["cpu:0-1"]} | kwargs
            engines[name] = Engine(
                args.target,
                None if name == "ar" else args.draft,
                dtype=args.dtype,
                target_devices=["cpu:0-1"],
                **kwargs,
            )
            engines[name].generate(prompts[0], SamplingParams(max_new_tokens=4))
        for temperature in args.temperature:
            rows += _measure(engines, prompts, temperature, args.max_new_tokens)
    finally:
        for engine in engines.values():
            engine.close()
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _measure(engines: dict, prompts: list, temperature: float, max_new_tokens: int) -> list[dict]:
    """One interleaved pass: each prompt through every variant in turn."""
    from paraspec import SamplingParams

    results = {name: [] for name in engines}
    for i, prompt in enumerate(prompts):
        for name, engine in engines.items():
            params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=i)
            results[name].append(engine.generate(prompt, params))
            print(
                f"T={temperature} prompt {i} {name}: {results[name][-1].stats.summary()}", flush=True, file=sys.stderr
            )
    ar_ms = _total(results["ar"])["ms_per_token"]
    rows = []
    for name, res in results.items():
        row = dict(temperature=temperature, strategy=name, **_total(res))
        row["speedup"] = ar_ms / row["ms_per_token"]
        if temperature == 0:
            row["same_tokens_as_ar"] = all(a.token_ids == b.token_ids for a, b in zip(res, results["ar"]))
        if name == "ar":  # every second of ar is target time
            row["verify_s_per_100"] = row["total_s_per_100"]
        rows.append(row)
    return rows


def _total(results) -> dict:
    tokens = sum(r.stats.new_tokens for r in results)
    drafted = sum(r.stats.drafted for r in results)
    return dict(
        tokens=tokens,
        draft_s_per_100=100 * sum(r.stats.draft_s for r in results) / tokens,
        verify_s_per_100=100 * sum(r.stats.verify_s for r in results) / tokens,
        total_s_per_100=100 * sum(r.stats.total_s for r in results) / tokens,
        ms_per_token=1000 * sum(r.stats.total_s for r in results) / tokens,
        tpot_ms=statistics.median(r.stats.tpot_ms for r in results),
        acceptance_rate=(sum(r.stats.accepted for r in results) / drafted) if drafted else None,
        rounds=sum(r.stats.rounds for r in results),
    )


def table(rows) -> str:
    lines = [
        "| T | strategy | draft s/100 tok | verify s/100 tok | total s/100 tok | speedup | acceptance | same as ar |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.1%}"
        same = {True: "yes", False: "NO"}.get(r.get("same_tokens_as_ar"), "-")
        lines.append(
            f"| {r['temperature']} | {r['strategy']} | {r['draft_s_per_100']:.2f} | "
            f"{r['verify_s_per_100']:.2f} | {r['total_s_per_100']:.2f} | {r['speedup']:.2f}x | {acc} | "
            f"{same} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
