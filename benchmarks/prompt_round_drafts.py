"""What `sd`'s prompt-round drafts cost on llama.cpp: drafted in the prompt round (verified right after the prompt's
forwards, before the first token) against drafted one round later (the first token streams after the prompt alone,
as `ar`'s does; the rule of strategies/sd.py on a target that splits prompts).

    .venv/bin/python benchmarks/prompt_round_drafts.py [--drafter suffix] [--datasets code-edit humaneval]
        [--prompts 3] [--tokens 128] [--rounds 2] [--fixed K]

One `ar` Engine and one `sd` Engine (the drafter given, its default options: the adaptive rule) on the reference
target, llama.cpp, one request at a time, chat-templated prompts (`--fixed K`: `sd` drafts K tokens every round,
adaptive=False, as a seeded sampled request does). Per prompt and round the three runs go in a
rotating order: `ar`, `sd` drafting in its prompt round (the target's `splits_prompts` cleared on the Engine's
model: its forward still splits, only the strategy's choice changes) and `sd` as it is. Printed per dataset: the
medians of TTFT, TPOT and ms/token, the prompt round's drafts, and the median per-prompt ratio of ms/token to
`ar`'s; every answer is checked against `ar`'s.
"""

from __future__ import annotations

import argparse
import statistics

from paraspec import Engine, SamplingParams
from paraspec.bench.datasets import load_prompts

TARGET = "Qwen/Qwen2.5-Coder-1.5B-Instruct"
VARIANTS = ("ar", "sd, prompt-round drafts", "sd")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="suffix", help="sd's draft: suffix, ngram or a draft model")
    ap.add_argument("--datasets", nargs="+", default=["code-edit", "humaneval"])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fixed", type=int, default=None, metavar="K", help="K drafts every round (adaptive=False)")
    args = ap.parse_args()
    fixed = {} if args.fixed is None else dict(adaptive=False, lookahead=args.fixed)
    params = SamplingParams(max_new_tokens=args.tokens)
    ar = Engine(TARGET, None, backend="llamacpp", strategy="ar", max_num_seqs=1)
    sd = Engine(TARGET, args.drafter, backend="llamacpp", strategy="sd", max_num_seqs=1, **fixed)
    if not sd.target.splits_prompts:
        raise SystemExit("this llama.cpp target does not split prompts: nothing to compare")
    try:
        for dataset in args.datasets:
            prompts = [p.as_input(True) for p in load_prompts(dataset, args.prompts)]
            rows: dict[str, list[dict]] = {v: [] for v in VARIANTS}
            for rnd in range(args.rounds):
                for i, prompt in enumerate(prompts):
                    order = VARIANTS[(rnd + i) % 3 :] + VARIANTS[: (rnd + i) % 3]
                    for variant in order:
                        engine = ar if variant == "ar" else sd
                        sd.target.splits_prompts = variant == "sd"
                        result = engine.generate(prompt, params)
                        prefill = next(e for e in result.trace.events if e.kind == "prefill")
                        rows[variant].append(
                            dict(
                                prompt=i,
                                tokens=result.token_ids,
                                ms_per_token=result.stats.ms_per_token,
                                ttft_ms=result.stats.ttft_s * 1000,
                                tpot_ms=result.stats.tpot_ms,
                                prompt_round_drafts=prefill.tokens - len(result.prompt_ids),
                                drafted=result.stats.drafted,
                            )
                        )
            report(dataset, rows)
    finally:
        sd.target.splits_prompts = True
        ar.close()
        sd.close()


def report(dataset: str, rows: dict[str, list[dict]]) -> None:
    print(f"\n{dataset} ({len(rows['ar'])} requests per variant)")
    print("| variant | TTFT ms | TPOT ms | ms/token | × ar (median of pairs) | prompt-round drafts | drafted | = ar |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for variant, runs in rows.items():
        pairs = [a["ms_per_token"] / r["ms_per_token"] for a, r in zip(rows["ar"], runs)]
        same = sum(a["tokens"] == r["tokens"] for a, r in zip(rows["ar"], runs))
        med = {k: statistics.median(r[k] for r in runs) for k in ("ttft_ms", "tpot_ms", "ms_per_token")}
        print(
            f"| {variant} | {med['ttft_ms']:.0f} | {med['tpot_ms']:.1f} | {med['ms_per_token']:.1f} | "
            f"{statistics.median(pairs):.2f} | {sum(r['prompt_round_drafts'] for r in runs)} | "
            f"{sum(r['drafted'] for r in runs)} | {same}/{len(runs)} |"
        )


if __name__ == "__main__":
    main()
