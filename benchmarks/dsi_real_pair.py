"""The reference pair on this machine's two cores: `dsi` (drafter cpu:0, one target server cpu:1) against `amusd`
on the same placement, with `ar` on cpu:1 as the reference for the tokens. Greedy, bf16 (docs/BENCHMARKS.md), the
first HumanEval problems as raw text; amusd and dsi interleaved per prompt after a warm-up. Needs `make models`.

    .venv/bin/python benchmarks/dsi_real_pair.py [--prompts 3] [--tokens 64] [--lookahead 5]
"""

from __future__ import annotations

import argparse
import statistics

from paraspec import Engine, SamplingParams
from paraspec.bench.datasets import load_humaneval

TARGET, DRAFT = "Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--lookahead", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--one-engine-at-a-time",
        action="store_true",
        help="amusd, then dsi, each alone (halves the memory; no interleaving)",
    )
    args = p.parse_args()
    prompts = [bp.as_input(chat=False) for bp in load_humaneval(args.prompts)]
    params = SamplingParams(max_new_tokens=args.tokens)
    placement = dict(target_devices=["cpu:1"], draft_devices=["cpu:0"])
    # ar first and alone (the tokens to match; all cores), then amusd and dsi alive together, interleaved
    rows = {}
    with Engine(TARGET, strategy="ar", dtype=args.dtype) as ar:
        rows["ar"] = [ar.generate(prompt, params) for prompt in prompts]
    setups = {
        "amusd": dict(strategy="amusd", **placement),
        "dsi": dict(strategy="dsi", lookahead=args.lookahead, max_ahead=2 * args.lookahead, **placement),
    }
    groups = [[name] for name in setups] if args.one_engine_at_a_time else [list(setups)]
    for group in groups:
        engines = {}
        try:
            for name in group:
                engines[name] = Engine(TARGET, DRAFT, dtype=args.dtype, **setups[name])
                rows[name] = []
            for engine in engines.values():  # warm-up
                engine.generate(prompts[0], SamplingParams(max_new_tokens=8))
            for prompt in prompts:
                for name, engine in engines.items():  # interleaved per prompt
                    rows[name].append(engine.generate(prompt, params))
        finally:
            for engine in engines.values():
                engine.close()
    print(
        f"{args.prompts} HumanEval prompts x {args.tokens} tokens, {args.dtype}, greedy; ar on both cores, "
        f"amusd and dsi (1 server, lookahead {args.lookahead}) with the draft on cpu:0 and the target on cpu:1"
    )
    print(f"{'strategy':<8} {'ms/token':>9} {'TTFT s':>7} {'TPOT ms':>8} {'accept':>7} {'same as ar':>11}")
    for name, results in rows.items():
        same = [r.token_ids == a.token_ids for r, a in zip(results, rows["ar"])]
        print(
            f"{name:<8} {statistics.median(r.stats.ms_per_token for r in results):>9.1f} "
            f"{statistics.median(r.stats.ttft_s for r in results):>7.2f} "
            f"{statistics.median(r.stats.tpot_ms for r in results):>8.1f} "
            f"{statistics.median(r.stats.acceptance_rate for r in results):>7.2f} "
            f"{sum(same)}/{len(same):<9}"
        )
    ratio = [a.stats.ms_per_token / d.stats.ms_per_token for a, d in zip(rows["amusd"], rows["dsi"])]
    print(f"amusd / dsi ms per token, per prompt: {', '.join(f'{r:.2f}' for r in ratio)}")


if __name__ == "__main__":
    main()
