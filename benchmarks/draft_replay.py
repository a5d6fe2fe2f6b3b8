"""Offline replay of model-free drafting: how long the drafts would be, and what decoding would cost, on answers
`ar` already gave, with a fixed table of verification costs (no timing noise; not a measurement of speed).

    python benchmarks/draft_replay.py out/model-free-t0/results.json --costs 69,108,141,265,455
    python benchmarks/draft_replay.py RESULTS --variant suffix_min_prob=0.05 --variant lower_z=0.25

For each dataset of a `paraspec bench` results.json, the prompts are rebuilt (dataset loader and the target's
tokenizer, as the bench built them) and `ar`'s recorded tokens are the target's answers. Each round runs the real
drafters and DraftPolicy (paraspec's rule, sd's round: propose with the pending tokens, verify, accept, observe the
committed tokens), a draft token is accepted iff it equals the recorded token at its position (greedy's exact
rule; under sampling the recorded tokens are one sample and the replay is an approximation), and a round costs
c(pending + drafts) from the table (w = 1, 2, 4, 8, 16 in ms, interpolated). One DraftPolicy per variant is kept across
a dataset's prompts, as the bench's engine does. Beside paraspec's drafters it replays llama.cpp's ngram-simple
(`llama-server --spec-type ngram-simple`: the last occurrence of the last n tokens, the m tokens after it, all
verified) under the same costs. Printed per dataset: decode speed-up over ar (ar's cost / the replay's, prompt
round excluded), mean accepted length per drafting round, accepted / drafted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from paraspec import SamplingParams
from paraspec.bench.datasets import encode_prompt, load_prompts
from paraspec.drafters import DraftPolicy, adaptive, model_free
from paraspec.drafters.adaptive import ForwardCost
from paraspec.models.loader import load_tokenizer, read_config, resolve_checkpoint
from paraspec.request_state import common_prefix
from paraspec.strategies.registry import OPTIONS

RULE_CONSTANTS = {"lower_z": "LOWER_Z", "decay": "DECAY", "fade": "FADE"}


def ngram_simple(sequence: list[int], n: int, m: int) -> list[int]:
    """llama.cpp's ngram-simple: the m tokens after the last earlier occurrence of the last n tokens."""
    if len(sequence) <= n:
        return []
    key = sequence[-n:]
    for start in range(len(sequence) - n - 1, -1, -1):
        if sequence[start : start + n] == key:
            return sequence[start + n : start + n + m]
    return []


def replay_answer(prompt: list[int], answer: list[int], cost: ForwardCost, propose, update) -> dict:
    """Rounds over one answer; propose(sequence, k, pending) -> at most k drafts (k: the answer's tokens left after
    the round's own), update(sequence, width, drafts, accepted, committed) after each round. Seconds exclude the
    prompt round (its prefill is the same for everyone)."""
    pos, seconds, rounds, drafted, accepted_total, cached = 0, 0.0, 0, 0, 0, 0
    while pos < len(answer):
        sequence = prompt + answer[:pos]
        pending = len(sequence) - cached
        drafts = propose(sequence, len(answer) - pos - 1, pending)  # each proposer caps its own length
        accepted = common_prefix(drafts, answer[pos:])
        width = pending + len(drafts)
        if pending == 1:
            seconds += cost(width)
            rounds += 1 if drafts else 0
            drafted += len(drafts)
            accepted_total += accepted
        committed = answer[pos : pos + accepted + 1]
        update(sequence, width, drafts, accepted, committed)
        pos += accepted + 1
        cached = len(prompt) + pos - 1
    return {
        "seconds": seconds,
        "ar_seconds": (len(answer) - 1) * cost(1),
        "draft_rounds": rounds,
        "drafted": drafted,
        "accepted": accepted_total,
    }


def replay_paraspec(answers, table: dict, options: dict, drafter: str, lookahead: int, vocab_size: int) -> list[dict]:
    policy = DraftPolicy([model_free(drafter, vocab_size, options)], ForwardCost(dict(table)))
    params, generator = SamplingParams(max_new_tokens=1), torch.Generator().manual_seed(0)
    cost = ForwardCost(dict(table))
    out = []
    for prompt, answer in answers:
        policy.reset()
        spent = [0.0]
        end = len(prompt) + len(answer)

        # replay_answer calls both within this iteration; the defaults only make that binding explicit
        def propose(sequence, k, pending, end=end, spent=spent):
            start = time.perf_counter()
            tokens = (
                policy.propose(
                    sequence,
                    min(k, lookahead),
                    params,
                    generator,
                    pending=pending,
                    remaining=end - len(sequence),
                ).tokens
                if k > 0
                else []
            )
            spent[0] += time.perf_counter() - start
            return tokens

        def update(sequence, width, drafts, accepted, committed):
            if drafts:
                policy.accept(len(sequence), list(range(accepted)))
            policy.observe(width, cost(width), committed)

        out.append(replay_answer(prompt, answer, cost, propose, update) | {"draft_s": spent[0]})
        policy.finish(prompt + answer)
    return out


def replay_llamacpp(answers, table: dict, n: int, m: int) -> list[dict]:
    cost = ForwardCost(dict(table))
    return [
        replay_answer(prompt, answer, cost, lambda s, k, p: ngram_simple(s, n, m)[:k], lambda *a: None)
        for prompt, answer in answers
    ]


def summary(rows: list[dict]) -> str:
    speed = sum(r["ar_seconds"] for r in rows) / max(sum(r["seconds"] for r in rows), 1e-9)
    rounds = sum(r["draft_rounds"] for r in rows)
    accepted, drafted = sum(r["accepted"] for r in rows), sum(r["drafted"] for r in rows)
    drafting = (
        f", proposing {1e3 * statistics.mean(r['draft_s'] for r in rows):.1f} ms per answer (this machine)"
        if "draft_s" in rows[0]
        else ""
    )
    return (
        f"{speed:.3f}x (min {min(r['ar_seconds'] / max(r['seconds'], 1e-9) for r in rows):.2f}), "
        f"accepted {accepted / rounds if rounds else 0:.2f} per drafting round, {accepted}/{drafted}{drafting}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="a paraspec bench results.json with an ar variant")
    ap.add_argument(
        "--costs",
        default="69,108,141,265,455",
        help="ms of one target forward of 1,2,4,8,16 tokens (default: Zen 3, repacked, P = 400), or "
        "WIDTH:MS pairs for any widths (a cost by width that is not smooth, e.g. AVX-512's)",
    )
    ap.add_argument("--drafter", default="suffix", choices=["suffix", "ngram"])
    ap.add_argument("--lookahead", type=int, default=16)
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="OPTION=VALUE[,OPTION=VALUE] (sd's options, or the rule's lower_z / decay / fade)",
    )
    ap.add_argument("--ngram-simple", default="4:16", help="llama.cpp's n:m to replay beside (empty: none)")
    args = ap.parse_args()
    items = args.costs.split(",")
    pairs = [item.split(":") for item in items] if ":" in args.costs else zip((1, 2, 4, 8, 16), items)
    table = {int(w): float(ms) / 1000 for w, ms in pairs}
    results = json.loads(args.results.read_text())
    tokenizer = load_tokenizer(results["meta"]["target"])
    vocab_size = read_config(resolve_checkpoint(results["meta"]["target"]))["vocab_size"]
    base = {k: o.default for k, o in OPTIONS.items()}
    base.update({k: v for k, v in results["meta"]["options"].items() if k in base})
    for name, data in results["datasets"].items():
        ar = next(v for v in data["variants"] if v.split("@")[0] == "ar")
        records = sorted((r for r in data["records"] if r["variant"] == ar), key=lambda r: r["prompt_index"])
        prompts = load_prompts(name, len(records))
        answers = [
            (encode_prompt(tokenizer, p.as_input(chat=data["chat"])), r["token_ids"]) for p, r in zip(prompts, records)
        ]
        for (prompt, _), r in zip(answers, records):
            if len(prompt) != r["prompt_tokens"]:
                raise SystemExit(
                    f"{name} prompt {r['prompt_index']}: rebuilt {len(prompt)} tokens, the run had {r['prompt_tokens']}"
                )
        print(f"{name} ({len(answers)} answers of ar):")
        for spec in [""] + args.variant:
            options, saved = dict(base), {}
            for item in filter(None, spec.split(",")):
                key, value = item.split("=")
                if key in RULE_CONSTANTS:
                    saved[key] = getattr(adaptive, RULE_CONSTANTS[key])
                    setattr(adaptive, RULE_CONSTANTS[key], float(value))
                else:
                    options[key] = type(base[key])(value) if not isinstance(base[key], bool) else value == "true"
            try:
                rows = replay_paraspec(answers, table, options, args.drafter, args.lookahead, vocab_size)
            finally:
                for key, value in saved.items():
                    setattr(adaptive, RULE_CONSTANTS[key], value)
            print(f"  sd[{args.drafter}] {spec or 'as run'}: {summary(rows)}")
        if args.ngram_simple:
            n, m = map(int, args.ngram_simple.split(":"))
            print(f"  llama.cpp ngram-simple n {n} m {m}: {summary(replay_llamacpp(answers, table, n, m))}")


if __name__ == "__main__":
    main()
