"""Where a Scheduler's time goes: every step of an in-process Engine's requests, its asks and its seconds.

    python benchmarks/scheduler_trace.py [--strategy ar|sd|sd-suffix] [--dataset humaneval] [--requests 8]
        [--seqs 8] [--callers 8] [--max-tokens 48] [--serve] [--reader-grace G] [--out out/scheduler_trace.json]

One Engine (`max_num_seqs` = --seqs) on llama.cpp; the requests first one at a time (the warm-up a server's first
callers give it), then from --callers threads at once, each taking the next request. With --serve the callers are
`openai` clients streaming from the real HTTP server (paraspec.server's app under uvicorn, in this process), and the
time each request's reader held a token (the request idle meanwhile: Scheduler.idle) is printed too. Printed: the
wall time and tokens/s of the concurrent part, and its steps grouped by what they carried -- each ask as T (target)
or D (draft model), its width, `p` for a prompt's forward and `a` for an ask run alone (e.g. `D2 D2 T2`: two
requests feeding their draft model two tokens, one verifying a one-token draft) -- with their count and mean ms;
with a draft model, the adaptive rule's report of one seat (its acceptance and cost tables); and the time between
steps, when no forward runs. Quote it from a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import paraspec.scheduler as scheduler_module  # noqa: E402
from benchmarks.serve_concurrency import DRAFT, TARGET, prompts_of, run_level  # noqa: E402 -- after the path
from paraspec import Engine, SamplingParams  # noqa: E402
from paraspec.scheduler import Scheduler  # noqa: E402


class TracedScheduler(Scheduler):
    """A Scheduler that notes each step's asks and seconds."""

    log: list = []
    idles: list = []  # seconds a request's reader held each commit

    def _step(self, asks) -> None:
        start = time.perf_counter()
        kinds = [("T" if a.model is self._target else "D", len(a.tokens), bool(a.prompt), a.alone) for a in asks]
        super()._step(asks)
        TracedScheduler.log.append((start, time.perf_counter() - start, kinds))

    @contextmanager
    def idle(self, member):
        start = time.perf_counter()
        with super().idle(member):
            yield
        TracedScheduler.idles.append(time.perf_counter() - start)


@contextmanager
def served(engine):
    """The OpenAI-compatible API over `engine` on a free local port, in a thread: its /v1 URL."""
    import uvicorn

    from paraspec.server.app import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine, "bench"), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise SystemExit("the server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", choices=["ar", "sd", "sd-suffix"], default="sd")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--callers", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--serve", action="store_true", help="through the HTTP server and openai clients")
    ap.add_argument(
        "--reader-grace",
        type=float,
        default=None,
        help="the Scheduler's READER_GRACE for this run (0: a step never waits for a reader), to measure its effect",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import paraspec.engine as engine_module

    engine_module.Scheduler = TracedScheduler  # the Engine builds its Scheduler by this name
    if args.reader_grace is not None:
        scheduler_module.READER_GRACE = args.reader_grace
    options: dict = dict(backend="llamacpp", max_context=2048, max_num_seqs=args.seqs)
    if args.strategy == "sd":
        options.update(strategy="sd", draft=DRAFT, lookahead=5)
    elif args.strategy == "sd-suffix":
        options.update(strategy="sd", draft="suffix", lookahead=16)
    else:
        options.update(strategy="ar")
    prompts = prompts_of(args.dataset, args.requests, TARGET)
    params = SamplingParams(max_new_tokens=args.max_tokens)
    with Engine(TARGET, **options) as engine:
        for prompt in prompts:
            engine.generate(prompt, params)
        if args.serve:
            with served(engine) as url:
                run_level(url, prompts[:1], 1, args.max_tokens)  # the server's own first request
                TracedScheduler.log.clear()
                TracedScheduler.idles.clear()
                start = time.perf_counter()
                answers, wall = run_level(url, prompts, args.callers, args.max_tokens)
            tokens = [a["tokens"] for a in answers]
        else:
            TracedScheduler.log.clear()
            TracedScheduler.idles.clear()
            queue, lock, tokens = list(range(len(prompts))), threading.Lock(), []

            def caller() -> None:
                while True:
                    with lock:
                        if not queue:
                            return
                        i = queue.pop(0)
                    tokens.append(len(engine.generate(prompts[i], params).token_ids))

            start = time.perf_counter()
            threads = [threading.Thread(target=caller) for _ in range(args.callers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - start
        policies = list(getattr(engine.strategy, "policies", {}).values())
        report = policies[0].report() if policies and policies[0].cost is not None else None
    log = TracedScheduler.log
    print(
        f"{args.strategy}: {sum(tokens)} tokens in {wall:.2f} s = {sum(tokens) / wall:.2f} tokens/s, {len(log)} steps"
    )
    groups: dict[str, list[float]] = defaultdict(list)
    for _, seconds, kinds in log:
        key = " ".join(sorted(f"{m}{n}{'p' if p else ''}{'a' if alone else ''}" for m, n, p, alone in kinds))
        groups[key].append(seconds)
    for key, times in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        print(f"{len(times):5d} x {1e3 * sum(times) / len(times):8.1f} ms = {sum(times):6.2f} s  {key}")
    # between one step's end and the next one's start: the requests' own work (sampling, commit, the next ask) and
    # the hand-overs, while no forward runs
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(log, log[1:])]
    if gaps:
        print(f"between steps: median {1e3 * statistics.median(gaps):.2f} ms, {sum(gaps):.2f} s in all")
    idles = sorted(TracedScheduler.idles)
    if idles:
        at = lambda q: 1e3 * idles[round(q * (len(idles) - 1))]  # noqa: E731
        print(
            f"a reader holding a token: median {at(0.5):.2f} ms, p90 {at(0.9):.2f}, p99 {at(0.99):.2f}, max {at(1):.2f}"
        )
    if report is not None:
        print("adaptive rule:", json.dumps({k: report[k] for k in ("alpha", "verify_cost_ms", "draft_cost_ms")}))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        steps = [{"at_s": t - start, "seconds": s, "asks": k} for t, s, k in log]
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "wall_s": wall, "steps": steps}))


if __name__ == "__main__":
    main()
