"""Command line of the benchmarks: `paraspec bench` and `paraspec profile` (registered by paraspec/cli/main.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from paraspec.bench.datasets import DATASETS
from paraspec.bench.hf_baselines import HF_STRATEGIES, PROMPT_LOOKUP_TOKENS
from paraspec.bench.llamacpp_peers import LLAMACPP_STRATEGIES
from paraspec.strategies import STRATEGIES


def add_commands(subparsers) -> None:
    add_bench_command(subparsers)
    add_profile_command(subparsers)


def add_bench_command(subparsers) -> None:
    from paraspec.cli.main import add_model_args, add_sampling_args

    bench = subparsers.add_parser(
        "bench",
        help="benchmark strategies side by side (and against transformers) on a dataset",
        description="Runs every strategy on the same prompts, interleaved, after a warm-up; prints a markdown "
        "table and writes report.md, results.json and plots to --out.",
    )
    add_model_args(bench)
    add_sampling_args(bench)
    bench.add_argument(
        "--strategies",
        default="ar,sd,hf-ar,hf-assisted",
        help=f"comma-separated: {', '.join(list(STRATEGIES) + list(HF_STRATEGIES))}, "
        f"{', '.join(LLAMACPP_STRATEGIES)} (llama.cpp's llama-server on the GGUF files, built "
        f"once by scripts/build_llamacpp.py peer), or all (every paraspec strategy); NAME@Nt "
        f"fixes a thread count; NAME[D,...] gives a strategy its drafters in order, each ngram, "
        f"suffix or model (the --draft checkpoint), e.g. sd[ngram,model] (hybrid), "
        f"dsi[ngram,model] (two drafters); without brackets it takes --draft; "
        f"NAME{{OPTION,OPTION=VALUE}} its own strategy options over the bench's, e.g. "
        f"sd{{adaptive,lookahead=16}} beside sd in one run",
    )
    bench.add_argument(
        "--threads",
        type=_int_list,
        metavar="N[,N]",
        help="run each in-process strategy at each of these torch thread counts, on every core "
        "this process may use, e.g. 1,2 (variants ar@1t, ar@2t, ...); default: the cores and "
        "threads the engine's devices give. Strategies in worker processes (amusd, dsi) run "
        "once, on their devices",
    )
    bench.add_argument(
        "--dataset",
        nargs="+",
        default=["humaneval"],
        metavar="NAME",
        help=f"{', '.join(DATASETS)} (code-edit and summarize are copy-heavy: the answer repeats "
        f"much of the prompt), or FILE.jsonl (a 'prompt' or 'messages' field per line); "
        f"several give one table each",
    )
    bench.add_argument("--num-prompts", type=int, default=5, help="prompts per dataset (MT-Bench: questions)")
    bench.add_argument(
        "--turns",
        type=int,
        choices=[1, 2],
        default=1,
        help="MT-Bench: 2 also runs the second turn, with ar's first answer in the history",
    )
    bench.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the chat template (default: when the target's tokenizer has one)",
    )
    bench.add_argument("--warmup-tokens", type=int, default=8, help="tokens of each variant's warm-up run")
    add_peer_args(bench)
    bench.add_argument("--plot-prompt", type=int, default=0, help="index of the prompt drawn in the plots")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("--out", required=True, help="folder for report.md, results.json and the PNGs")
    bench.set_defaults(func=cmd_bench)


def add_peer_args(bench) -> None:
    """The peers' own settings: transformers' assisted generation and prompt lookup, llama-server's modes."""
    bench.add_argument(
        "--hf-assistant-tokens",
        type=int,
        help="hf-assisted: drafted tokens per round (default: transformers' own, 20, cut short "
        "by its confidence threshold)",
    )
    bench.add_argument(
        "--hf-confidence-threshold",
        type=float,
        help="hf-assisted: stop drafting below this draft probability (default: transformers' 0.4; 0 disables it)",
    )
    bench.add_argument(
        "--hf-prompt-lookup-tokens",
        type=int,
        default=PROMPT_LOOKUP_TOKENS,
        metavar="N",
        help="hf-prompt-lookup: candidate tokens copied per round (transformers' "
        "prompt_lookup_num_tokens; default %(default)s)",
    )
    bench.add_argument(
        "--hf-prompt-lookup-ngram",
        type=int,
        metavar="N",
        help="hf-prompt-lookup: the longest n-gram matched (transformers' max_matching_ngram_size; "
        "default: transformers' own, 2)",
    )
    bench.add_argument(
        "--llamacpp-spec-grid",
        type=_spec_grid,
        metavar="N:P[,N:P]",
        help="llamacpp-spec: the (draft max, p-min) settings tried on the first prompt of each "
        "dataset, the fastest kept (default: draft max 4,8,16 x p-min 0,0.5,0.8)",
    )
    bench.add_argument(
        "--llamacpp-ngram-grid",
        type=_ngram_grid,
        metavar="TYPE:N:M[,...]",
        help="llamacpp-ngram: llama-server's n-gram drafters tried on the first prompt of each "
        "dataset, the fastest kept: TYPE ngram-simple, ngram-map-k, ngram-map-k4v or ngram-mod, "
        "N tokens looked up, at most M drafted (default: ngram-simple:12:48, ngram-mod:24:64 "
        "(llama.cpp's defaults), ngram-simple:4:16, ngram-simple:3:8)",
    )


def add_profile_command(subparsers) -> None:
    prof = subparsers.add_parser(
        "profile",
        help="measure TTFT/TPOT, forward widths and acceptance of a pair (the planner's JSON)",
        description="The DSI paper's measurements: TTFT and TPOT of target and draft over N prompts x "
        "--tokens tokens, forward cost per width, and acceptance = 1 - 1/(1 + mean greedy match).",
    )
    prof.add_argument("--target", required=True, help="target model: checkpoint folder, .gguf file or hub id")
    prof.add_argument("--draft", required=True, help="draft model")
    prof.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"])
    prof.add_argument(
        "--target-devices", nargs="+", default=["cpu"], metavar="D", help="the target's device (the first is measured)"
    )
    prof.add_argument("--draft-devices", nargs="+", default=["cpu"], metavar="D", help="the draft's device")
    prof.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "native", "hf", "llamacpp"],
        help="as for generate (llamacpp: threads = the cores of --target-devices and --draft-devices together)",
    )
    prof.add_argument("--max-context", type=int, default=4096)
    prof.add_argument("--dataset", default="humaneval", metavar="NAME", help="as for bench")
    prof.add_argument("--num-prompts", type=int, default=5)
    prof.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None)
    prof.add_argument("--tokens", type=int, default=20, help="tokens per prompt for TTFT/TPOT")
    prof.add_argument(
        "--match-tokens", type=int, default=256, help="target tokens per prompt over which draft matches are counted"
    )
    prof.add_argument(
        "--widths", type=_int_list, default=[1, 2, 4, 8, 16], metavar="N[,N]", help="forward widths to time"
    )
    prof.add_argument("--allow-vocab-mismatch", action="store_true")
    prof.add_argument("--out", required=True, help="the JSON file to write (read by `paraspec plan --profile`)")
    prof.set_defaults(func=cmd_profile)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _spec_grid(text: str) -> list[tuple[int, float]]:
    from paraspec.bench.llamacpp_peers import parse_spec_grid

    try:
        return parse_spec_grid(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _ngram_grid(text: str) -> list[tuple[str, int, int]]:
    from paraspec.bench.llamacpp_peers import parse_ngram_grid

    try:
        return parse_ngram_grid(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_bench(args) -> int:
    from paraspec.bench.datasets import load_prompts
    from paraspec.bench.report import write_report
    from paraspec.bench.runner import BenchConfig, parse_variants, run_benchmark
    from paraspec.cli.main import engine_config, given_options, sampling_params
    from paraspec.models.loader import load_tokenizer

    variants = parse_variants(args.strategies, args.threads)
    if args.warmup_tokens < 1:
        raise ValueError(f"--warmup-tokens must be >= 1, got {args.warmup_tokens}")
    given = given_options(args)
    takers = {option for v in variants if v.strategy in STRATEGIES for option in STRATEGIES[v.strategy].option_names}
    unused = [name for name in given if name not in takers]
    if unused:
        raise ValueError(
            f"{', '.join('--' + n.replace('_', '-') for n in unused)}: no strategy benchmarked here "
            f"takes it ({args.strategies}); drop it or add a strategy that does"
        )
    config = BenchConfig(
        engine=engine_config(args, strategy="sd" if args.draft else "ar", options={}),  # each variant sets its own
        options=given,  # each strategy's own defaults for the rest
        variants=variants,
        params=sampling_params(args),
        chat=args.chat,
        warmup_tokens=args.warmup_tokens,
        hf_assistant_tokens=args.hf_assistant_tokens,
        hf_confidence_threshold=args.hf_confidence_threshold,
        hf_prompt_lookup_tokens=args.hf_prompt_lookup_tokens,
        hf_prompt_lookup_ngram=args.hf_prompt_lookup_ngram,
        progress=not args.no_progress,
        **({"llamacpp_spec_grid": tuple(args.llamacpp_spec_grid)} if args.llamacpp_spec_grid else {}),
        **({"llamacpp_ngram_grid": tuple(args.llamacpp_ngram_grid)} if args.llamacpp_ngram_grid else {}),
    )
    prompt_sets = {
        name: load_prompts(name, args.num_prompts, args.turns if name == "mt-bench" else 1) for name in args.dataset
    }
    tokenizer = load_tokenizer(args.target, args.dtype)
    results = run_benchmark(config, prompt_sets, tokenizer)
    text = write_report(results, args.out, args.plot_prompt)
    print(text)
    print(f"wrote {Path(args.out) / 'report.md'}, results.json and plots to {args.out}", file=sys.stderr)
    return 0


def cmd_profile(args) -> int:
    from paraspec.bench.datasets import encode_prompt, load_prompts, resolve_chat
    from paraspec.bench.pair_profile import profile_pair
    from paraspec.engine import Engine

    prompts = load_prompts(args.dataset, args.num_prompts)
    from paraspec.cli.main import engine_config

    # the engine only loads the pair: fixed lengths, so no start-up timing of the adaptive rule
    with Engine.from_config(engine_config(args, strategy="sd", options={"adaptive": False})) as engine:
        if engine.tokenizer is None:
            raise ValueError("profile needs the target's tokenizer to build prompts; the checkpoint has none")
        chat = resolve_chat(args.chat, engine.tokenizer)
        ids = [encode_prompt(engine.tokenizer, p.as_input(chat)) for p in prompts if p.answer_of is None]
        done = [0]

        def progress(what: str) -> None:
            done[0] += 1
            print(f"profile: {what} ({done[0]})", file=sys.stderr, flush=True)

        profile = profile_pair(
            engine.target,
            engine.draft,
            engine.target_devices[0],
            engine.draft_devices[0],
            ids,
            args.target,
            args.draft,
            tokens=args.tokens,
            match_tokens=args.match_tokens,
            widths=tuple(args.widths),
            progress=progress,
        )
        for role, model in (("target", engine.target), ("draft", engine.draft)):
            if getattr(model, "kernels", None):  # llamacpp: which kernels ran, and the exact width
                profile[role]["llamacpp"] = {
                    "kernels": model.kernels,
                    "exact": model.exact,
                    "exact_width": model.exact_width,
                    "tiled_matmul": model.tiled_matmul,
                    "tinyblas": model.tinyblas,
                    "flash_attention": model.flash_attention,
                }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(profile, indent=1) + "\n")
    print(json.dumps(profile, indent=1))
    return 0
