"""`paraspec study easyspec`: the EasySpec similarity table (Table 5) and ablation plots (Fig. 4)."""

from __future__ import annotations

import json
from pathlib import Path


def add_commands(subparsers) -> None:
    study = subparsers.add_parser("study", help="studies that explain a method (EasySpec similarity, ablation)")
    sub = study.add_subparsers(dest="study", required=True)
    p = sub.add_parser(
        "easyspec",
        help="layer-parallel-vs-exact cosine similarity per layer-parallel size; "
        "width x layer-parallel size x calibration ablation with two PNG plots",
    )
    p.add_argument("--draft", required=True, help="draft model: checkpoint folder, .gguf file or hub id")
    p.add_argument("--target", help="target model (needed by the ablation)")
    p.add_argument("--part", choices=["similarity", "ablation", "both"], default="similarity")
    p.add_argument("--dataset", default="humaneval", help="prompts (see `paraspec bench --help`)")
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument(
        "--layer-parallel-sizes",
        type=int,
        nargs="+",
        default=None,
        help="similarity: default 2 3 4; ablation: default 1 2 3 4 5",
    )
    p.add_argument("--tokens-per-prompt", type=int, default=16, help="similarity: tokens measured per prompt")
    p.add_argument("--widths", type=int, nargs="+", default=[1, 4, 8, 12], help="ablation: tree widths")
    p.add_argument("--tree-depth", type=int, default=5)
    p.add_argument("--no-calibration-off", action="store_true", help="ablation: only calibration on")
    p.add_argument("--max-new-tokens", type=int, default=32, help="ablation: tokens per prompt")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--target-devices", nargs="+", default=["cpu"], help="ablation: where the target verifies")
    p.add_argument(
        "--draft-devices",
        nargs="+",
        default=["cpu"],
        help="ablation: several devices (e.g. cpu:0 cpu:1) spread each group's attention layers",
    )
    p.add_argument("--out", default="study-easyspec", help="folder for the table, JSON rows and plots")
    p.set_defaults(func=cmd_easyspec)


def _prompts(args, tokenizer) -> list:
    from paraspec.bench.datasets import load_prompts

    return [bp.as_input(chat=True) for bp in load_prompts(args.dataset, args.num_prompts)]


def cmd_easyspec(args) -> int:
    from paraspec.study import layer_parallel_drafting as study

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part in ("similarity", "both"):
        from paraspec.models.loader import load_model, load_tokenizer

        draft = load_model(args.draft, dtype=args.dtype)
        tokenizer = load_tokenizer(args.draft)
        ids = []
        for messages in _prompts(args, tokenizer):
            encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
                encoded = encoded["input_ids"]
            ids.append(list(encoded))
        rows = study.similarity(draft, ids, tuple(args.layer_parallel_sizes or (2, 3, 4)), args.tokens_per_prompt)
        table = study.similarity_table(rows)
        (out / "similarity.md").write_text(table + "\n")
        (out / "similarity.json").write_text(json.dumps(rows, indent=1))
        print(table)
    if args.part in ("ablation", "both"):
        if not args.target:
            raise ValueError("the ablation needs --target")
        from paraspec import Engine, SamplingParams

        factory = lambda: Engine(
            args.target,
            args.draft,
            strategy="easyspec",
            dtype=args.dtype,
            target_devices=args.target_devices,
            draft_devices=args.draft_devices,
        )
        prompts = _prompts(args, None)
        rows = study.ablation(
            factory,
            prompts,
            SamplingParams(max_new_tokens=args.max_new_tokens),
            widths=tuple(args.widths),
            layer_parallel_sizes=tuple(args.layer_parallel_sizes or (1, 2, 3, 4, 5)),
            calibrations=(True,) if args.no_calibration_off else (True, False),
            tree_depth=args.tree_depth,
            progress=lambda r: print(json.dumps(r), flush=True),
        )
        (out / "ablation.json").write_text(json.dumps(rows, indent=1))
        for path in study.plot_ablation(rows, out):
            print(f"wrote {path}")
    return 0
