"""lm-evaluation-harness against `paraspec serve`: every strategy gets `ar`'s scores (issue 50).

    python benchmarks/lm_eval_check.py [--lm-eval lm_eval] [--target T] [--draft D] [--tokenizer FOLDER]
        [--strategies ar,sd,sd-suffix] [--refusals amusd,dsi] [--threads 2] [--out out/lm-eval]

lm-eval is not a dependency of paraspec (its own are heavy): install it in a virtual environment of its own,
`python -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install 'lm-eval[api]==0.4.13' transformers` (the `api` extra
has tenacity, which its API models need; transformers gives them the tokenizer, no torch needed), and pass
`--lm-eval /tmp/lmeval/bin/lm_eval` (default: `lm_eval` on PATH). Nothing is downloaded: the tasks are local
(benchmarks/lm_eval_task/: paraspec_mc, 20 multiple-choice programming facts scored by log-likelihood, acc and
acc_norm; paraspec_gen, 5 Python expressions answered greedily on one line, exact_match), lm_eval runs with
HF_HUB_OFFLINE=1 and its tokenizer is the target's converted checkpoint folder under ~/.cache/paraspec/models/.

For each strategy (`ar`; `sd` with the draft model; `sd-suffix`: `sd` with `--draft suffix`) the script starts
`paraspec serve --port 0` (OMP_NUM_THREADS=--threads), runs lm_eval twice against it and stops it with SIGTERM:

- `local-completions` on both tasks: log-likelihoods through /v1/completions (lm-eval sends the context and the
  continuation as token ids with `echo: true, logprobs: 1, max_tokens: 1` and sums the continuation's
  `token_logprobs`) and greedy generations (`until: "\\n"`, 32 tokens) from the raw prompt;
- `local-chat-completions --apply_chat_template` on paraspec_gen: greedy generations through the chat template.

Each run's results JSON and samples (`--log_samples`) go to --out/STRATEGY/ENDPOINT/; the script prints a markdown
table, strategy x endpoint x task x metric, with "= ar" per cell: the score equal to ar's, and per sample every
log-likelihood within 1e-4 of ar's with the same is-greedy flag, every generated text ar's. It exits 1 when a cell
differs. --refusals starts each named strategy (amusd, dsi: they report no logprobs by design) and checks that one
lm-eval-shaped log-likelihood request is a 400 naming the parameter.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.served import ServeProcess  # noqa: E402 -- after the path

TASKS = ROOT / "benchmarks" / "lm_eval_task"
MODEL = "paraspec-target"
TOLERANCE = 1e-4
VARIANTS = {
    "ar": ["--strategy", "ar"],
    "sd": ["--strategy", "sd", "--draft", "{draft}"],
    "sd-suffix": ["--strategy", "sd", "--draft", "suffix"],
    "amusd": ["--strategy", "amusd", "--draft", "{draft}", "--target-devices", "cpu:1", "--draft-devices", "cpu:0"],
    "dsi": ["--strategy", "dsi", "--draft", "{draft}", "--target-devices", "cpu", "cpu", "--draft-devices", "cpu"],
}
# endpoint -> (lm-eval model, tasks, extra lm_eval flags)
ENDPOINTS = {
    "completions": ("local-completions", ["paraspec_mc", "paraspec_gen"], []),
    "chat": ("local-chat-completions", ["paraspec_gen"], ["--apply_chat_template"]),
}


def run_lm_eval(
    lm_eval: str, endpoint: str, url: str, tokenizer: str, out: Path, timeout: float, limit: int | None
) -> float:
    """One lm_eval run against the server; its results and samples under `out`. Returns its wall time in s."""
    model, tasks, extra = ENDPOINTS[endpoint]
    if endpoint == "completions":
        model_args = (
            f"model={MODEL},base_url={url}/v1/completions,num_concurrent=1,max_retries=1,"
            f"tokenizer={tokenizer},tokenizer_backend=huggingface"
        )
    else:
        model_args = f"model={MODEL},base_url={url}/v1/chat/completions,num_concurrent=1,max_retries=1"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [
        lm_eval,
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        ",".join(tasks),
        "--include_path",
        str(TASKS.relative_to(ROOT)),
        "--output_path",
        str(out),
        "--log_samples",
        *extra,
        *(["--limit", str(limit)] if limit else []),
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    start = time.perf_counter()
    with open(out / "lm_eval.log", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        # the task YAMLs name their JSONL files relative to the repository root
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"lm_eval failed ({done.returncode}); see {out / 'lm_eval.log'}")
    return time.perf_counter() - start


def lm_eval_version(lm_eval: str) -> str:
    """lm-eval's version, asked of the interpreter on the executable's #! line (lm_eval has no --version)."""
    first = Path(lm_eval).read_text(errors="replace").splitlines()[0]
    python = first[2:].strip() if first.startswith("#!") else sys.executable
    code = "import importlib.metadata as m; print(m.version('lm_eval'))"
    done = subprocess.run([*python.split(), "-c", code], capture_output=True, text=True)
    return done.stdout.strip() or "version unknown"


def load_run(out: Path) -> tuple[dict, dict]:
    """(task -> {metric: value}, task -> {doc_id: sample}) from one run's output folder."""
    results = sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))
    if not results:
        raise RuntimeError(f"no results_*.json under {out}")
    data = json.loads(Path(results[-1]).read_text())
    scores = {
        task: {k: v for k, v in values.items() if "," in k and "_stderr" not in k}
        for task, values in data["results"].items()
    }
    samples: dict[str, dict] = {}
    for task in scores:
        files = sorted(glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True))
        if files:
            lines = Path(files[-1]).read_text().splitlines()
            samples[task] = {s["doc_id"]: s for s in map(json.loads, lines)}
    return scores, samples


def compare_samples(mine: dict, ref: dict) -> tuple[bool, str]:
    """Per-sample comparison with ar's: log-likelihoods within TOLERANCE (and the same is-greedy flag), texts equal."""
    if mine.keys() != ref.keys():
        return False, f"docs {sorted(mine)} != ar's {sorted(ref)}"
    worst, count, texts, same_texts, flags = 0.0, 0, 0, 0, True
    for doc_id, sample in mine.items():
        for got, want in zip(sample["resps"], ref[doc_id]["resps"]):
            got, want = got[0], want[0]
            if isinstance(got, list):  # a log-likelihood: [logprob, is_greedy] (as strings)
                worst = max(worst, abs(float(got[0]) - float(want[0])))
                flags &= got[1] == want[1]
                count += 1
            else:
                texts += 1
                same_texts += got == want
    parts = []
    if count:
        parts.append(f"{count} log-likelihoods, max abs diff {worst:.1e}" + ("" if flags else ", is-greedy differs"))
    if texts:
        parts.append(f"{same_texts}/{texts} texts = ar")
    return worst <= TOLERANCE and flags and same_texts == texts, "; ".join(parts)


def check_refusal(strategy: str, flags: list[str], threads: int, tokenizer: str, log: Path) -> str:
    """One lm-eval-shaped log-likelihood request (token ids, echo, logprobs 1, max_tokens 1) to `strategy`."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tokenizer)("Question: What is 2 + 2?\nAnswer: 4")["input_ids"]
    server = ServeProcess(flags, threads, log, MODEL)
    try:
        body = {"model": MODEL, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": True}
        request = urllib.request.Request(
            server.url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=300) as r:
                return f"{r.status} (not refused)"
        except urllib.error.HTTPError as e:
            error = json.loads(e.read()).get("error", {})
            return f"{e.code}, param {error.get('param')!r}: {error.get('message')}"
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-eval", default="lm_eval", help="the lm_eval executable (default: lm_eval on PATH)")
    ap.add_argument("--target", default="Qwen/Qwen2.5-Coder-1.5B-Instruct")
    ap.add_argument("--draft", default="Qwen/Qwen2.5-Coder-0.5B-Instruct")
    ap.add_argument(
        "--tokenizer",
        help="the tokenizer folder lm-eval loads for log-likelihoods (default: the target's converted folder in "
        "paraspec's model cache)",
    )
    ap.add_argument("--strategies", default="ar,sd,sd-suffix", help=f"of {', '.join(VARIANTS)}; ar comes first")
    ap.add_argument("--refusals", default="", help="strategies whose log-likelihood refusal (a 400) is checked")
    ap.add_argument("--endpoints", default="completions,chat")
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the server")
    ap.add_argument("--serve-arg", action="append", default=[], help="one more argument to paraspec serve")
    ap.add_argument("--limit", type=int, help="the first N documents of each task only (a quick try)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one lm_eval run may take")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "lm-eval")
    args = ap.parse_args()

    lm_eval = shutil.which(args.lm_eval) or args.lm_eval
    if not Path(lm_eval).exists():
        ap.error(
            f"{args.lm_eval} not found: python -m venv /tmp/lmeval && "
            "/tmp/lmeval/bin/pip install 'lm-eval[api]' transformers"
        )
    tokenizer = args.tokenizer
    if tokenizer is None:
        cache = Path(os.environ.get("PARASPEC_CACHE", Path.home() / ".cache" / "paraspec"))
        tokenizer = str(cache / "models" / args.target.replace("/", "--"))
    strategies = [s for s in args.strategies.split(",") if s]
    if "ar" in strategies:
        strategies.remove("ar")
    strategies.insert(0, "ar")
    endpoints = [e for e in args.endpoints.split(",") if e]
    print(f"lm_eval: {lm_eval} ({lm_eval_version(lm_eval)})", flush=True)

    runs: dict[tuple[str, str], tuple[dict, dict, float]] = {}
    for strategy in strategies:
        flags = ["--target", args.target] + [f.format(draft=args.draft) for f in VARIANTS[strategy]] + args.serve_arg
        start = time.perf_counter()
        server = ServeProcess(flags, args.threads, args.out / strategy / "serve.log", MODEL)
        print(f"{strategy}: {' '.join(server.command[1:])} at {server.url} ({time.perf_counter() - start:.0f} s)")
        try:
            for endpoint in endpoints:
                out = args.out / strategy / endpoint
                wall = run_lm_eval(lm_eval, endpoint, server.url, tokenizer, out, args.timeout, args.limit)
                scores, samples = load_run(out)
                runs[strategy, endpoint] = (scores, samples, wall)
                print(f"  {endpoint}: {wall:.0f} s {json.dumps(scores)}", flush=True)
        finally:
            code = server.stop()
            print(f"  stopped: exit {code}", flush=True)

    rows = ["| strategy | endpoint | task | metric | score | = ar | per sample |", "|---|---|---|---|---|---|---|"]
    all_equal = True
    for strategy in strategies:
        for endpoint in endpoints:
            scores, samples, _ = runs[strategy, endpoint]
            ref_scores, ref_samples, _ = runs["ar", endpoint]
            for task, metrics in scores.items():
                if strategy == "ar":
                    same_samples, detail = True, "(reference)"
                else:
                    same_samples, detail = compare_samples(samples.get(task, {}), ref_samples.get(task, {}))
                for metric, value in metrics.items():
                    equal = value == ref_scores.get(task, {}).get(metric) and same_samples
                    all_equal &= equal
                    mark = "yes" if equal else "**no**"
                    rows.append(f"| {strategy} | {endpoint} | {task} | {metric} | {value:.4f} | {mark} | {detail} |")
    print()
    print("\n".join(rows))
    walls = ", ".join(f"{s}/{e} {runs[s, e][2]:.0f} s" for s in strategies for e in endpoints)
    print(f"\nlm_eval wall times: {walls}")

    for strategy in [s for s in args.refusals.split(",") if s]:
        flags = ["--target", args.target] + [f.format(draft=args.draft) for f in VARIANTS[strategy]] + args.serve_arg
        answer = check_refusal(strategy, flags, args.threads, tokenizer, args.out / strategy / "serve.log")
        print(f"{strategy}, echo + logprobs: {answer}")
    print("\nevery score = ar" if all_equal else "\nSOME SCORES DIFFER FROM ar")
    return 0 if all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
