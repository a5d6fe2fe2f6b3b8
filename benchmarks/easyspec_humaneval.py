"""ar, sd, tree and easyspec on the reference pair, HumanEval, in the EasySpec paper's Table 2 format:
draft and verify time per 100 tokens, total, speedup over ar, acceptance rate (ar's row counts all of its time
as verify time: it is all target time).

    python benchmarks/easyspec_humaneval.py --num-prompts 3 --max-new-tokens 64 --temperature 0 0.8

Every strategy gets the same hardware budget, both cores: ar, sd and tree run in this process with 2 threads
(cpu:0-1); easyspec drafts with one rank on cpu:0 (this process, 1 thread) and one worker on cpu:1, and
verifies with 2 threads. The models load once: the strategies share one Engine whose strategy is switched
between runs (all four are in-process strategies with the same decode signature). Prompts are interleaved
across strategies after a warm-up.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


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
    p.add_argument("--lp-size", type=int, default=2)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)

    from paraspec import Engine, SamplingParams
    from paraspec.bench.datasets import load_prompts
    from paraspec.models.loader import parse_dtype, resolve_checkpoint
    from paraspec.config import EngineConfig
    from paraspec.runtime.devices import parse_devices
    from paraspec.strategies import get_strategy

    draft_dir = resolve_checkpoint(args.draft, parse_dtype(args.dtype))
    prompts = [bp.as_input(chat=True) for bp in load_prompts("humaneval", args.num_prompts)]
    variants = {
        "ar": ("ar", {}),
        "sd": ("sd", dict(lookahead=args.lookahead)),
        "tree": ("tree", dict(tree_width=args.tree_width, tree_depth=args.tree_depth,
                              tree_budget=args.tree_width * args.tree_depth)),
        "easyspec": ("easyspec", dict(tree_width=args.tree_width, tree_depth=args.tree_depth,
                                      tree_budget=args.tree_width * args.tree_depth, lp_size=args.lp_size,
                                      layer_groups="", calibration=True)),
    }
    engine = Engine(args.target, args.draft, strategy="sd", dtype=args.dtype, target_devices=["cpu:0-1"],
                    draft_devices=["cpu:0-1"])
    models = engine.strategy
    strategies = {}

    def use(name):
        """Every variant shares the engine's loaded pair: a Strategy object per variant over the same models."""
        if name not in strategies:
            strategy, options = variants[name]
            s = get_strategy(strategy)(EngineConfig(args.target, args.draft, strategy, options=options).strategy_options)
            s.target, s.drafts = models.target, models.drafts
            if strategy == "easyspec":      # drafting spread over cpu:0 and cpu:1, one rank each
                s.draft_devices, s.runtime_backend, s.draft_checkpoint = parse_devices(["cpu:0", "cpu:1"]), \
                    "process", draft_dir
            strategies[name] = s
        engine.strategy = strategies[name]

    rows = []
    try:
        for name in variants:                              # warm-up (and start easyspec's draft worker)
            use(name)
            engine.generate(prompts[0], SamplingParams(max_new_tokens=4))
        for temperature in args.temperature:
            results = {name: [] for name in variants}
            for i, prompt in enumerate(prompts):
                for name in variants:
                    use(name)
                    params = SamplingParams(temperature=temperature, max_new_tokens=args.max_new_tokens, seed=i)
                    results[name].append(engine.generate(prompt, params))
                    print(f"T={temperature} prompt {i} {name}: {results[name][-1].stats.summary()}", flush=True,
                          file=sys.stderr)
            ar_ms = _total(results["ar"])["ms_per_token"]
            for name, res in results.items():
                row = dict(temperature=temperature, strategy=name, **_total(res))
                row["speedup"] = ar_ms / row["ms_per_token"]
                if temperature == 0:
                    row["same_tokens_as_ar"] = all(a.token_ids == b.token_ids for a, b in zip(res, results["ar"]))
                if name == "ar":                            # every second of ar is target time
                    row["verify_s_per_100"] = row["total_s_per_100"]
                rows.append(row)
    finally:
        for s in strategies.values():
            if s is not models and hasattr(s, "close_device_group"):
                s.close_device_group()
        engine.strategy = models
        engine.close()
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _total(results) -> dict:
    tokens = sum(r.stats.new_tokens for r in results)
    drafted = sum(r.stats.drafted for r in results)
    return dict(tokens=tokens,
                draft_s_per_100=100 * sum(r.stats.draft_s for r in results) / tokens,
                verify_s_per_100=100 * sum(r.stats.verify_s for r in results) / tokens,
                total_s_per_100=100 * sum(r.stats.total_s for r in results) / tokens,
                ms_per_token=1000 * sum(r.stats.total_s for r in results) / tokens,
                tpot_ms=statistics.median(r.stats.tpot_ms for r in results),
                acceptance_rate=(sum(r.stats.accepted for r in results) / drafted) if drafted else None,
                rounds=sum(r.stats.rounds for r in results))


def table(rows) -> str:
    lines = ["| T | strategy | draft s/100 tok | verify s/100 tok | total s/100 tok | speedup | acceptance | "
             "same as ar |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.1%}"
        same = {True: "yes", False: "NO"}.get(r.get("same_tokens_as_ar"), "-")
        lines.append(f"| {r['temperature']} | {r['strategy']} | {r['draft_s_per_100']:.2f} | "
                     f"{r['verify_s_per_100']:.2f} | {r['total_s_per_100']:.2f} | {r['speedup']:.2f}x | {acc} | "
                     f"{same} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
