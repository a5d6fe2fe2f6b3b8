"""Does `sd` cost anything where the adaptive rule drafts nothing? `ar` and `sd` (its default, the rule) engines on
the reference pair, llama.cpp, alternating which goes first each round, on HumanEval prompts with the chat template;
per request: ms/token, TTFT, TPOT, the drafts (0 where the rule decodes plainly), and the time spent inside
llama.cpp's decode calls against outside them (paraspec's own work).

    .venv/bin/python benchmarks/sd_without_drafts.py --prompts 3 --rounds 4
"""

import argparse
import statistics
import time

from rule_round_cost import round_us  # benchmarks/, the script's folder, is on the path

from paraspec import Engine, SamplingParams
from paraspec.bench.datasets import load_prompts
from paraspec.drafters import DraftPolicy
from paraspec.models.llamacpp import model as llamacpp

TARGET, DRAFT = "Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"


def decision_us(policy: DraftPolicy, rounds: int = 2000) -> float:
    """Microseconds a round of the rule's own work on `policy`'s measured costs (rule_round_cost.py), lookahead 5."""
    return round_us(policy.cost, policy.draft_costs[0], 5, 4, rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()

    decode, inside = llamacpp._llama_decode_many, [0.0]

    def timed(*a, **k):
        start = time.perf_counter()
        try:
            return decode(*a, **k)
        finally:
            inside[0] += time.perf_counter() - start

    llamacpp._llama_decode_many = timed
    prompts = [p.as_input(True) for p in load_prompts("humaneval", args.prompts)]
    params = SamplingParams(max_new_tokens=args.tokens)
    engines = {
        "ar": Engine(TARGET, None, backend="llamacpp", strategy="ar", max_num_seqs=1),
        "sd": Engine(TARGET, DRAFT, backend="llamacpp", strategy="sd", max_num_seqs=1),
    }
    rows = {name: [] for name in engines}
    print(
        f"the rule's decision: {decision_us(engines['sd'].strategy.policy):.0f} us a round (propose + observe, "
        f"lookahead 5, 2,000 rounds, the sd engine's measured costs)"
    )
    try:
        for rnd in range(args.rounds):
            order = list(engines) if rnd % 2 == 0 else list(reversed(engines))
            for prompt in prompts:
                for name in order:
                    inside[0] = 0.0
                    start = time.perf_counter()
                    s = engines[name].generate(prompt, params).stats
                    wall = time.perf_counter() - start
                    rows[name].append(
                        dict(
                            ms_per_token=s.ms_per_token,
                            ttft_ms=s.ttft_s * 1000,
                            tpot_ms=s.tpot_ms,
                            drafted=s.drafted,
                            outside_ms=(wall - inside[0]) * 1000,
                        )
                    )
    finally:
        for engine in engines.values():
            engine.close()
    for name, runs in rows.items():
        print(
            f"{name}: "
            + ", ".join(
                f"{key} {statistics.median(r[key] for r in runs):.1f}"
                for key in ("ms_per_token", "ttft_ms", "tpot_ms", "outside_ms")
            )
            + f", drafted {sum(r['drafted'] for r in runs)} (medians over {len(runs)} requests)"
        )
    ratios = [a["ms_per_token"] / b["ms_per_token"] for a, b in zip(rows["ar"], rows["sd"])]
    print("ar/sd ms/token by pair:", " ".join(f"{r:.2f}" for r in ratios), f"median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
