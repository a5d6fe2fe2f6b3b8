"""Many callers at once: `paraspec serve` (requests batched, --max-num-seqs) beside llama-server (its default slots
and -np 8), the official `openai` client, 1/2/4/8 concurrent callers, greedy.

    python benchmarks/serve_concurrency.py [--target T] [--draft D] [--datasets humaneval code-edit]
        [--requests 8] [--callers 1 2 4 8] [--max-tokens 128] [--threads 2] [--rounds 1]
        [--out out/serve_concurrency.json]

Every server is started once and stays up (idle servers cost nothing); the runs are interleaved: for each number
of callers, each server in turn answers the same requests (chat-templated token ids, greedy; a pool of that many
client threads, each taking the next request). Per (server, dataset, callers): aggregate tokens/s (all completion
tokens over the wall time), TTFT p50/p95 and per-request TPOT p50/p95 (client side, streamed with usage), and "= alone":
how many answers are the text the same server gave that request with one caller. paraspec's should all be (its
batching keeps every answer bit-identical to the request alone); llama-server's are counted. With --rounds N each
level runs N times, the servers' order rotated each round; the table then gives each figure's median over the
rounds and "× llama-server", the median of each round's ratio to llama-server at its default slots (a VM whose
speed drifts moves a cell's figures by 10-30% between minutes, much less a ratio within one round).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.served import ServeProcess  # noqa: E402 -- after the path

TARGET, DRAFT = "Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"


class ParaspecServer:
    """`paraspec serve` (served.py) seen through its OpenAI-compatible /v1; its log beside the results."""

    def __init__(self, name: str, flags: list[str], threads: int, log: Path):
        self.name, self.extra = name, None
        self.server = ServeProcess(flags, threads, log)
        self.url = self.server.url + "/v1"

    def close(self) -> None:
        self.server.stop()


class PeerServer:
    """llama-server (paraspec.bench.llamacpp_peers.LlamaServer) seen through its OpenAI-compatible /v1."""

    def __init__(self, name: str, binaries, gguf, threads: int, slots: int | None, context: int):
        from paraspec.bench.llamacpp_peers import LlamaServer

        self.name = name
        self.server = LlamaServer(binaries, gguf, threads, context=context, slots=slots)
        self.url = f"http://127.0.0.1:{self.server.port}/v1"
        self.extra = {"cache_prompt": False}  # no KV reuse from an earlier request (paraspec keeps none)

    def close(self) -> None:
        self.server.close()


def one_request(client, prompt_ids: list[int], max_tokens: int, extra: dict | None) -> dict:
    """A streamed greedy completion timed by the client: TTFT to the first text, TPOT after it."""
    start = time.perf_counter()
    first, text, tokens = None, [], None
    for chunk in client.completions.create(
        model="bench",
        prompt=prompt_ids,
        temperature=0,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    ):
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].text)
        if getattr(chunk, "usage", None) is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    first = first or end
    tokens = tokens or 1
    return {
        "text": "".join(text),
        "tokens": tokens,
        "ttft_s": first - start,
        "tpot_ms": (end - first) * 1000 / max(tokens - 1, 1),
    }


def run_level(
    url: str, prompts: list[list[int]], callers: int, max_tokens: int, extra: dict | None = None
) -> tuple[list[dict], float]:
    """Every prompt once, `callers` client threads each taking the next; the answers in prompt order, wall s."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=3600)
    answers, lock, errors = [None] * len(prompts), threading.Lock(), []
    queue = list(range(len(prompts)))

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop(0)
            try:
                answers[i] = one_request(client, prompts[i], max_tokens, extra)
            except Exception as e:  # noqa: BLE001 -- reported after the level
                errors.append(e)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return answers, time.perf_counter() - start


def summarize(answers: list[dict], wall_s: float, alone: list[dict] | None) -> dict:
    q = lambda xs, p: statistics.quantiles(xs, n=20)[int(p * 20) - 1] if len(xs) > 1 else xs[0]  # noqa: E731
    tpot = [a["tpot_ms"] for a in answers]
    return {
        "tokens": sum(a["tokens"] for a in answers),
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(sum(a["tokens"] for a in answers) / wall_s, 2),
        "ttft_p50_s": round(statistics.median(a["ttft_s"] for a in answers), 3),
        "ttft_p95_s": round(q([a["ttft_s"] for a in answers], 0.95), 3),
        "tpot_p50_ms": round(statistics.median(tpot), 2),
        "tpot_p95_ms": round(q(tpot, 0.95), 2),
        "same_as_alone": None if alone is None else sum(a["text"] == b["text"] for a, b in zip(answers, alone)),
        "requests": len(answers),
    }


def prompts_of(dataset: str, n: int, target: str) -> list[list[int]]:
    from paraspec.bench.datasets import encode_prompt, load_prompts
    from paraspec.models.loader import load_tokenizer, resolve_checkpoint

    tokenizer = load_tokenizer(resolve_checkpoint(target, backend="llamacpp"))
    return [encode_prompt(tokenizer, p.as_input(True)) for p in load_prompts(dataset, n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--draft", default=DRAFT)
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "code-edit"])
    ap.add_argument("--requests", type=int, default=8, help="requests per (server, dataset, callers)")
    ap.add_argument("--callers", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=8, help="paraspec serve's --max-num-seqs")
    ap.add_argument("--context", type=int, default=2048, help="tokens per request (each server, each slot)")
    ap.add_argument(
        "--servers", nargs="+", default=["ar-1seq", "ar", "sd-suffix", "sd", "llama-server", "llama-server-np8"]
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="each level this many times, the servers' order rotated each round: the medians, and each paraspec "
        "server's ratio to llama-server (default slots) within a round, are reported (this VM's speed drifts)",
    )
    ap.add_argument("--out", default="out/serve_concurrency.json")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    if 1 not in args.callers:
        raise SystemExit("--callers must include 1: it is the 'alone' every other count is compared with")

    from paraspec.bench.llamacpp_peers import gguf_file, peer_binaries, peer_build_label
    from paraspec.bench.report import _cpu_model

    common = [
        "--target",
        args.target,
        "--backend",
        "llamacpp",
        "--max-context",
        str(args.context),
        "--max-num-seqs",
        str(args.max_num_seqs),
    ]
    paraspec_flags = {
        "ar": common + ["--strategy", "ar"],
        "sd-suffix": common + ["--strategy", "sd", "--draft", "suffix", "--lookahead", "16"],
        "sd": common + ["--strategy", "sd", "--draft", args.draft, "--lookahead", "5"],
    }
    # ar on one sequence: what `paraspec serve` ran before it batched requests (the 1-caller baseline)
    paraspec_flags["ar-1seq"] = paraspec_flags["ar"][:-4] + ["--max-num-seqs", "1", "--strategy", "ar"]
    prompts = {d: prompts_of(d, args.requests, args.target) for d in args.datasets}
    servers = []
    try:
        for name in args.servers:
            print(f"starting {name}", file=sys.stderr, flush=True)
            if name in paraspec_flags:
                log = Path(args.out).with_name(f"serve_concurrency-{name}.log")
                servers.append(ParaspecServer(f"paraspec {name}", paraspec_flags[name], args.threads, log))
            else:
                binaries = peer_binaries()
                slots = 8 if name.endswith("np8") else None
                servers.append(
                    PeerServer(
                        f"{name} ({peer_build_label(binaries)})",
                        binaries,
                        gguf_file(args.target),
                        args.threads,
                        slots,
                        args.context,
                    )
                )
        for s in servers:  # warm-up: one short request each
            run_level(s.url, [prompts[args.datasets[0]][0]], 1, 8, s.extra)
        results, alone = [], {}
        for callers in sorted(args.callers):  # interleaved: every server at each level
            for round_ in range(args.rounds):
                order = servers[round_ % len(servers) :] + servers[: round_ % len(servers)]
                for dataset in args.datasets:
                    for s in order:
                        if s.name.endswith("ar-1seq") and callers > 1:
                            continue  # one sequence: the callers would only queue
                        answers, wall = run_level(s.url, prompts[dataset], callers, args.max_tokens, s.extra)
                        if callers == 1 and (s.name, dataset) not in alone:
                            alone[(s.name, dataset)] = answers
                        row = {
                            "server": s.name,
                            "dataset": dataset,
                            "callers": callers,
                            "round": round_,
                            **summarize(answers, wall, alone.get((s.name, dataset))),
                        }
                        results.append(row)
                        print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        for s in servers:
            s.close()
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    record = {
        "cpu": _cpu_model(),
        "amx": " amx_tile" in flags,
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "requests": args.requests,
        "max_num_seqs": args.max_num_seqs,
        "command": " ".join(sys.argv),
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    record["medians"] = medians(results)
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(table(record["medians"]))
    return 0


def medians(results: list[dict]) -> list[dict]:
    """One row per (server, dataset, callers) over its rounds: the median of each figure, the answers = alone
    summed, and `x_peer`: the median over rounds of its tokens/s over llama-server's (default slots) in that round."""
    cells: dict[tuple, list[dict]] = {}
    for r in results:
        cells.setdefault((r["server"], r["dataset"], r["callers"]), []).append(r)
    peer = {
        (r["dataset"], r["callers"], r["round"]): r["tokens_per_s"]
        for r in results
        if r["server"].startswith("llama-server (")
    }
    rows = []
    for (server, dataset, callers), runs in cells.items():
        row = {"server": server, "dataset": dataset, "callers": callers, "rounds": len(runs)}
        for key in ("tokens_per_s", "ttft_p50_s", "ttft_p95_s", "tpot_p50_ms", "tpot_p95_ms"):
            row[key] = round(statistics.median(r[key] for r in runs), 3)
        row["tokens_per_s_range"] = [min(r["tokens_per_s"] for r in runs), max(r["tokens_per_s"] for r in runs)]
        same = [r["same_as_alone"] for r in runs]
        row["same_as_alone"] = None if None in same else sum(same)
        row["requests"] = sum(r["requests"] for r in runs)
        ratios = [
            r["tokens_per_s"] / peer[(dataset, callers, r["round"])]
            for r in runs
            if peer.get((dataset, callers, r["round"]))
        ]
        row["x_peer"] = round(statistics.median(ratios), 3) if ratios else None
        rows.append(row)
    return rows


def table(results: list[dict]) -> str:
    lines = [
        "| server | dataset | callers | tokens/s | × llama-server | TTFT p50 / p95 s | TPOT p50 / p95 ms | = alone |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = f"{r['x_peer']:.2f}" if r.get("x_peer") is not None else ""
        lines.append(
            f"| {r['server']} | {r['dataset']} | {r['callers']} | {r['tokens_per_s']:.1f} | {ratio} | "
            f"{r['ttft_p50_s']:.2f} / {r.get('ttft_p95_s', float('nan')):.2f} | {r['tpot_p50_ms']:.1f} / "
            f"{r['tpot_p95_ms']:.1f} | "
            f"{r['same_as_alone']}/{r['requests']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
