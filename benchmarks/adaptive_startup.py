"""What the adaptive rule adds to an sd Engine's start-up: its forward-cost timing (drafters/adaptive.py,
ForwardCost.measure), on the reference pair.

Builds `Engine(target, draft, strategy="sd")` in turn (interleaved, `--rounds` times) with:
- `fixed`: adaptive=False (no timing);
- `rule`: the default (auto: the rule times the target's verification widths and the draft's widths);
- `rule-before`: the same with the target's widths as timed before 2026-12-04 (every width up to 20, then every
  4th), by patching calibration_widths.
and prints each build's seconds and the timing's share (each ForwardCost.measure call: its widths, its seconds, and
the time it measured at each width, ms).

    .venv/bin/python benchmarks/adaptive_startup.py --backend llamacpp --rounds 2
"""

import argparse
import statistics
import time

from paraspec import Engine
from paraspec.drafters import adaptive

TARGET, DRAFT = "Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"


def widths_before(max_k: int, pending: int = 1) -> list[int]:
    """calibration_widths before 2026-12-04: every width up to 20, then every 4th, and the widest."""
    top = pending + max_k
    return sorted(set(range(1, min(top, 20) + 1)) | set(range(24, top + 1, 4)) | {top})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="llamacpp", choices=["llamacpp", "native"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lookahead", type=int, default=5)
    ap.add_argument("--max-num-seqs", type=int, default=1)
    args = ap.parse_args()

    measure, log = adaptive.ForwardCost.measure.__func__, []

    def timed(cls, model, widths, *a, **k):
        start = time.perf_counter()
        cost = measure(cls, model, widths, *a, **k)
        log.append((list(widths), time.perf_counter() - start, dict(cost.seconds)))
        return cost

    adaptive.ForwardCost.measure = classmethod(timed)
    now = adaptive.calibration_widths
    variants = {"fixed": (dict(adaptive=False), now), "rule": ({}, now), "rule-before": ({}, widths_before)}
    builds = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (options, widths) in variants.items():
            adaptive.calibration_widths = widths  # strategies/base.py imports it where it times
            log.clear()
            start = time.perf_counter()
            with Engine(
                TARGET,
                DRAFT,
                backend=args.backend,
                strategy="sd",
                lookahead=args.lookahead,
                max_num_seqs=args.max_num_seqs,
                **options,
            ):
                seconds = time.perf_counter() - start
            builds[name].append(seconds)
            parts = ", ".join(f"widths {w[0]}..{w[-1]} ({len(w)}): {s:.2f} s" for w, s, _ in log)
            print(
                f"{name:12s} build {seconds:6.2f} s   timing {sum(s for _, s, _ in log):5.2f} s   {parts}", flush=True
            )
            for _, _, measured in log:
                print(" " * 14 + "ms by width: " + " ".join(f"{w}:{ms * 1e3:.1f}" for w, ms in measured.items()))
    print(f"\nmedian build ({args.backend}, lookahead {args.lookahead}, {args.rounds} rounds, interleaved):")
    for name, seconds in builds.items():
        print(f"  {name:12s} {statistics.median(seconds):6.2f} s")


if __name__ == "__main__":
    main()
