"""Cost of one forward of n tokens on a warm cache: paraspec's native decoder vs transformers, same weights.

Why it matters: speculative decoding pays one target forward of k+1 tokens per round, so its speed depends on
how that cost grows with the width. Both models share the very same weight tensors (paraspec.bench builds the
transformers module on paraspec's tensors), so the difference is the forward code alone. Widths alternate
between the two implementations, so machine drift hits both alike.

    python benchmarks/bench_forward_widths.py --model Qwen/Qwen2.5-Coder-1.5B-Instruct --threads 1
    python benchmarks/bench_forward_widths.py --model ... --profile 6     # torch.profiler op table, width 6
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from paraspec.bench.datasets import encode_prompt, load_prompts
from paraspec.bench.hf_baselines import hf_causal_lm
from paraspec.models.loader import load_model, load_tokenizer, parse_dtype, resolve_checkpoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--widths", default="1,2,4,6,8,16,21")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", type=int, help="print a torch.profiler op table for this width (both models)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.dtype)
    native = load_model(args.model, args.dtype)
    hf = hf_causal_lm(native, resolve_checkpoint(args.model, dtype))
    tok = load_tokenizer(args.model, args.dtype)
    prompt = encode_prompt(tok, load_prompts("humaneval", 1)[0].as_input(chat=True))
    widths = [int(w) for w in args.widths.split(",")]
    print(f"{args.model}: {dtype}, {args.threads} thread(s), prompt {len(prompt)} tokens, median of {args.repeats}")

    with torch.inference_mode():
        native.prefill(prompt)
        base = native.length
        from transformers import DynamicCache

        cache = DynamicCache(config=hf.config)
        hf(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True, logits_to_keep=1)

        def run_native(chunk):
            native.forward(chunk)
            native.rollback(base)

        def run_hf(chunk):
            hf(
                input_ids=torch.tensor([chunk]),
                past_key_values=cache,
                use_cache=True,
                cache_position=torch.arange(base, base + len(chunk)),
                logits_to_keep=0,
            )
            cache.crop(-len(chunk))  # a negative count removes that many (transformers 5)

        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            chunk = prompt[: args.profile]
            for name, fn in (("native", run_native), ("transformers", run_hf)):
                fn(chunk)
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    fn(chunk)
                print(f"\n== {name}, width {args.profile}")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
            return

        print(f"{'width':>5} {'native ms':>10} {'transformers ms':>16} {'native/1-token':>15}")
        one = None
        for n in widths:
            chunk = (prompt * n)[:n]
            times = {"native": [], "hf": []}
            for _ in range(args.repeats):
                for name, fn in (("native", run_native), ("hf", run_hf)):
                    start = time.perf_counter()
                    fn(chunk)
                    times[name].append(time.perf_counter() - start)
            nat, hft = (statistics.median(times[k]) * 1000 for k in ("native", "hf"))
            one = one or nat
            print(f"{n:>5} {nat:>10.1f} {hft:>16.1f} {nat / one:>15.2f}")


if __name__ == "__main__":
    main()
