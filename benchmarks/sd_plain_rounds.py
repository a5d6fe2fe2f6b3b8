"""What a plain round of `sd` costs against an `ar` step: the target's one-token forward, in an engine that also
holds a draft model which never drafts.

    python benchmarks/sd_plain_rounds.py [--rounds 5] [--tokens 48] [--prompt-tokens 120]

The adaptive rule decodes plainly where drafting does not pay (MT-Bench on a CPU): then `sd[model]` should cost what
`ar` does. Two engines on the llamacpp backend, the same cores (2 threads), the same prompt ids: `ar`, and `sd`
with `adaptive=True` whose rule is patched to choose k* = 0 every round (the draft model is loaded, reset at each
request, never run). They alternate, the order rotating; printed: each one's TPOT per round, the medians and the
per-pair ratios. Quote them only from a quiet machine (the load average is printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
from unittest import mock

from paraspec import Engine, SamplingParams
from paraspec.drafters.policy import DraftPolicy

TARGET, DRAFT = "Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=120)
    args = parser.parse_args()
    prompt = list(range(1000, 1000 + args.prompt_tokens))
    params = SamplingParams(max_new_tokens=args.tokens)
    common = dict(backend="llamacpp", target_devices=["cpu:0-1"], max_num_seqs=1)
    print(f"load average {os.getloadavg()[0]:.2f}")
    with (
        Engine(TARGET, strategy="ar", **common) as ar,
        Engine(TARGET, DRAFT, strategy="sd", adaptive=True, draft_devices=["cpu:0-1"], **common) as sd,
        mock.patch.object(DraftPolicy, "_choose", return_value=0),
    ):
        engines = {"ar": ar, "sd, plain rounds": sd}
        tpot = {name: [] for name in engines}
        for engine in engines.values():
            engine.generate(prompt, SamplingParams(max_new_tokens=8))  # warm-up
        for r in range(args.rounds):
            for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
                result = engines[name].generate(prompt, params)
                assert result.stats.drafted == 0
                tpot[name].append(result.stats.tpot_ms)
    for name, values in tpot.items():
        print(f"{name:>18}: TPOT ms {[round(v, 1) for v in values]}, median {statistics.median(values):.1f}")
    ratios = [s / a for s, a in zip(tpot["sd, plain rounds"], tpot["ar"])]
    print(f"sd / ar by pair: {[round(x, 3) for x in ratios]}, median {statistics.median(ratios):.3f}")
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
