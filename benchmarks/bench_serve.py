"""`paraspec serve` under load, with the official `openai` client, against `Engine.generate` called directly.

    python benchmarks/bench_serve.py --target T [--draft D] --strategies ar sd amusd dsi \
        [--requests 8] [--max-tokens 128] [--dataset humaneval] [--serve-args "--target-devices cpu:1 ..."]

Per strategy, one after the other (never two loads at once on the machine):
 1. the Engine in this process: each prompt once with generate() (greedy), after one warm-up request;
 2. `paraspec serve` in a subprocess (same flags): the same prompts as N sequential streamed chat requests
    (client-side TTFT, TPOT, ms/token), then N concurrent ones (requests/s; they queue: one generation at a time);
 3. the server's overhead: sequential ms/token and TTFT over HTTP against the Engine's own.
Greedy throughout, so both paths decode the same tokens (checked: the token counts must match).
Writes a table to stdout and every figure to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_server(args, strategy: str) -> tuple[subprocess.Popen, str]:
    drafts = [] if strategy == "ar" else [a for d in args.draft for a in ("--draft", d)]
    command = [
        sys.executable,
        "-m",
        "paraspec",
        "serve",
        "--target",
        args.target,
        "--strategy",
        strategy,
        "--port",
        "0",
        "--served-model-name",
        "bench",
        *drafts,
        *shlex.split(args.serve_args),
    ]
    server = subprocess.Popen(
        command,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        text=True,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    line = server.stdout.readline()
    match = re.search(r"at (http://\S+/v1)", line)
    if not match:
        server.kill()
        raise SystemExit(f"paraspec serve did not start ({strategy}): {line!r}")
    return server, match.group(1)


def stop_server(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def one_request(client, messages, max_tokens: int) -> dict:
    """A streamed greedy chat request timed by the client: TTFT to the first content, then per token."""
    start = time.perf_counter()
    first = None
    usage = stats = None
    for chunk in client.chat.completions.create(
        model="bench",
        messages=messages,
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
        if chunk.usage is not None:
            usage, stats = chunk.usage, chunk.model_extra.get("paraspec")
    end = time.perf_counter()
    n = usage.completion_tokens
    first = first or end
    return {
        "tokens": n,
        "ttft_s": first - start,
        "tpot_ms": (end - first) * 1000 / max(n - 1, 1),
        "ms_per_token": (end - start) * 1000 / n,
        "total_s": end - start,
        "server": stats,
    }


def bench_server(args, strategy: str, prompts: list) -> dict:
    import openai

    server, url = start_server(args, strategy)
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600)
        one_request(client, prompts[0], 8)  # warm-up
        sequential = [one_request(client, p, args.max_tokens) for p in prompts]
        results = [None] * len(prompts)

        def ask(i):
            results[i] = one_request(client, prompts[i], args.max_tokens)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
    finally:
        stop_server(server)
    return {
        "sequential": sequential,
        "concurrent": results,
        "concurrent_wall_s": wall,
        "requests_per_s": len(prompts) / wall,
    }


def bench_engine(args, strategy: str, prompts: list) -> list[dict]:
    from paraspec import Engine, SamplingParams
    from paraspec.cli.main import add_model_args, engine_config

    parser = argparse.ArgumentParser()
    add_model_args(parser, several_drafts=True)
    drafts = [] if strategy == "ar" else [a for d in args.draft for a in ("--draft", d)]
    engine_args = parser.parse_args(["--target", args.target, *drafts, *shlex.split(args.serve_args)])
    with Engine.from_config(engine_config(engine_args, strategy)) as engine:
        engine.generate(prompts[0], SamplingParams(max_new_tokens=8))  # warm-up
        out = []
        for p in prompts:
            stats = engine.generate(p, SamplingParams(max_new_tokens=args.max_tokens)).stats
            out.append(
                {
                    "tokens": stats.new_tokens,
                    "ttft_s": stats.ttft_s,
                    "tpot_ms": stats.tpot_ms,
                    "ms_per_token": stats.ms_per_token,
                    "total_s": stats.total_s,
                }
            )
    return out


def mean(rows: list[dict], key: str) -> float:
    return statistics.mean(r[key] for r in rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", action="append", default=[])
    parser.add_argument("--strategies", nargs="+", default=["ar", "sd", "amusd", "dsi"])
    parser.add_argument("--requests", type=int, default=8, help="N: sequential, then N concurrent")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument(
        "--serve-args",
        default="",
        help="flags for both `paraspec serve` and the Engine "
        "(every add_model_args flag: devices, dtype, backend, strategy options)",
    )
    parser.add_argument("--out", default="out/bench_serve.json")
    args = parser.parse_args(argv)
    from paraspec.bench.datasets import load_prompts

    prompts = [list(p.messages) for p in load_prompts(args.dataset, args.requests)]
    report = {"args": vars(args), "strategies": {}}
    print(f"{'strategy':<8} {'path':<12} {'TTFT ms':>8} {'TPOT ms':>8} {'ms/token':>9} {'req/s':>7}")
    for strategy in args.strategies:
        engine = bench_engine(args, strategy, prompts)
        served = bench_server(args, strategy, prompts)
        sequential = served["sequential"]
        if [r["tokens"] for r in engine] != [r["tokens"] for r in sequential]:
            print(f"warning: {strategy}: token counts differ between the Engine and the server", file=sys.stderr)
        overhead = {
            "ms_per_token_pct": 100 * (mean(sequential, "ms_per_token") / mean(engine, "ms_per_token") - 1),
            "ttft_ms": 1000 * (mean(sequential, "ttft_s") - mean(engine, "ttft_s")),
        }
        report["strategies"][strategy] = {"engine": engine, **served, "overhead": overhead}
        for name, rows, rps in (
            ("engine", engine, None),
            ("http seq", sequential, None),
            ("http conc", served["concurrent"], served["requests_per_s"]),
        ):
            print(
                f"{strategy:<8} {name:<12} {mean(rows, 'ttft_s') * 1000:8.1f} {mean(rows, 'tpot_ms'):8.2f} "
                f"{mean(rows, 'ms_per_token'):9.2f} {'' if rps is None else f'{rps:7.2f}'}"
            )
        print(
            f"{strategy:<8} overhead     ms/token {overhead['ms_per_token_pct']:+.1f}%, "
            f"TTFT {overhead['ttft_ms']:+.1f} ms"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
