"""Cost of one llama.cpp forward of w tokens (logits for every token) after a P-token context, per kernel
configuration, and whether each configuration is batch-invariant there.

Configurations (each runs in its own process: the library build and GGML_CPU_TILED_MM are per process):
- `repacked`: paraspec's exact configuration with the patched build: weight repacking on, flash attention off,
  the tiled K-quant matmul as the backend decides (on for a patched AVX512-VNNI build, else GGML_CPU_TILED_MM=0);
- `repacked-untiled`: the same with GGML_CPU_TILED_MM=0 (paraspec's configuration before the tiled patch);
- `plain`: paraspec's exact configuration before the repack patch (and its fallback): repacking off, the rest
  the same;
- `repacked+flash`: `repacked` with flash attention on (not what paraspec runs: see its --check column);
- `repacked+tiled`, `repacked+tiled-all`: the tiled matmul on from 8 rows (ggml's default) or for every width
  (GGML_CPU_TILED_MM_FORCE=1);
- `default`: llama.cpp's defaults: repacking on, flash attention auto, the tiled K-quant matmul on (env unset);
  with `--default-lib DIR`, from another llama-cpp-python installation (e.g. an unpatched build installed with
  `pip install --no-deps --target DIR WHEEL`).
Rounds run the configurations in turn (the order rotates), so that a shared machine's drift hits all alike; the
table gives the median over rounds of each round's median. On a shared machine other processes slow llama.cpp's
threads many-fold: each run records the CPU share that other processes took while it ran (from /proc/stat minus
the run's own CPU time), waits before it starts until the machine is quiet (--wait-quiet seconds at most), and
the table keeps only the runs that others left alone (share < --max-others) when each configuration has some.

    python benchmarks/llamacpp_forward_widths.py --threads 2 --rounds 5
    python benchmarks/llamacpp_forward_widths.py --default-lib /tmp/unpatched-site --check
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

PARASPEC = "paraspec"  # GGML_CPU_TILED_MM as paraspec's backend sets it for this build and CPU
CONFIGS = {  # name: (use_extra_bufts, flash_attn_type, GGML_CPU_TILED_MM or None = unset)
    "repacked": (True, 0, PARASPEC),
    "repacked-untiled": (True, 0, "0"),
    "plain": (False, 0, PARASPEC),
    "default": (True, -1, None),
    "repacked+flash": (True, 1, "0"),  # not used by paraspec: is flash attention exact too? (--check)
    "repacked+tiled": (True, 0, None),  # not used by paraspec: the tiled K-quant matmul on (--check)
    # the tiled K-quant matmul for every width (GGML_CPU_TILED_MM_FORCE=1: also below its 8 rows)
    "repacked+tiled-all": (True, 0, None),
}
TARGET = "Qwen/Qwen2.5-Coder-1.5B-Instruct"


def paraspec_tiled() -> str:
    """GGML_CPU_TILED_MM as paraspec's llamacpp backend sets it (this process runs no product: importing is safe)."""
    import llama_cpp

    from paraspec.models.llamacpp.model import tiled_matmul_patched

    return "1" if tiled_matmul_patched(llama_cpp, llama_cpp.llama_print_system_info().decode(errors="replace")) else "0"


def worker(args) -> None:
    """One configuration in this process: timings per width, and (--check) the widths not bitwise exact."""
    if args.lib:
        sys.path.insert(0, args.lib)
    import ctypes

    import llama_cpp as lib
    import numpy as np

    repack, flash, _ = CONFIGS[args.worker]
    lib.llama_backend_init()
    quiet = lib.llama_log_callback(lambda *a: None)  # referenced until the end: C holds the pointer
    lib.llama_log_set(quiet, ctypes.c_void_p(0))
    mparams = lib.llama_model_default_params()
    mparams.use_extra_bufts = repack
    mparams.n_gpu_layers = 0
    model = lib.llama_model_load_from_file(args.model.encode(), mparams)
    cparams = lib.llama_context_default_params()
    widest = max(args.widths + [16])
    cparams.n_ctx = args.context + widest + 64
    cparams.n_batch = cparams.n_ubatch = 512
    cparams.n_seq_max = 1
    cparams.n_threads = cparams.n_threads_batch = args.threads
    cparams.flash_attn_type = flash
    cparams.no_perf = True
    ctx = lib.llama_init_from_model(model, cparams)
    mem = lib.llama_get_memory(ctx)
    n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    batch = lib.llama_batch_init(512, 0, 1)

    def decode(tokens, pos, outputs):
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i >= len(tokens) - outputs
        batch.n_tokens = len(tokens)
        if lib.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return np.ctypeslib.as_array(lib.llama_get_logits(ctx), shape=(outputs, n_vocab)).copy()

    ids = np.random.default_rng(0).integers(0, n_vocab, size=args.context + widest).tolist()
    for start in range(0, args.context, 512):
        decode(ids[start : min(start + 512, args.context)], start, 1)
    out = {"ms": {}, "inexact_widths": None, "system": lib.llama_print_system_info().decode()}
    p, cont = args.context, ids[args.context :]
    for w in args.widths:
        times = []
        for _ in range(args.repeats + 1):  # the first is a warm-up
            start = time.perf_counter()
            decode(cont[:w], p, w)
            times.append(time.perf_counter() - start)
            lib.llama_memory_seq_rm(mem, 0, p, -1)
        out["ms"][str(w)] = statistics.median(times[1:]) * 1000
    if args.check:
        reference = np.concatenate([decode([t], p + i, 1) for i, t in enumerate(cont)])
        out["inexact_widths"] = []
        for w in range(2, widest + 1):
            lib.llama_memory_seq_rm(mem, 0, p, -1)
            if not np.array_equal(decode(cont[:w], p, w), reference[:w]):
                out["inexact_widths"].append(w)
    print(json.dumps(out))


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def others_share(run) -> float:
    """The share of the machine's CPU time that other processes took while `run()` ran."""
    hz = os.sysconf("SC_CLK_TCK")
    busy0, total0 = cpu_jiffies()
    own0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    run()
    busy1, total1 = cpu_jiffies()
    own1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (own1.ru_utime + own1.ru_stime - own0.ru_utime - own0.ru_stime) * hz
    return max(0.0, (busy1 - busy0 - own) / max(1, total1 - total0))


def wait_quiet(limit_s: float, share: float) -> None:
    """Wait (at most limit_s) until other processes use less than `share` of the CPUs over 3 s."""
    deadline = time.time() + limit_s
    while time.time() < deadline and others_share(lambda: time.sleep(3)) >= share:
        time.sleep(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=TARGET, help="a .gguf file, or a hub id whose GGUF paraspec fetched")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=400)
    p.add_argument("--widths", default="1,2,4,8,16")
    p.add_argument("--configs", default="repacked,repacked-untiled,plain,default")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="timed forwards per width and round (median)")
    p.add_argument("--default-lib", help="a folder holding another llama_cpp package, for the default config")
    p.add_argument(
        "--check", action="store_true", help="also check widths 2..max(16, widest) bitwise against 1-token forwards"
    )
    p.add_argument("--wait-quiet", type=float, default=600, help="seconds to wait for a quiet machine before a run")
    p.add_argument("--max-others", type=float, default=0.1, help="other processes' CPU share that spoils a run")
    p.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    p.add_argument("--lib", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.widths = [int(w) for w in args.widths.split(",")]
    if not args.model.endswith(".gguf"):
        from paraspec.models.loader import gguf_source, resolve_checkpoint

        args.model = str(gguf_source(resolve_checkpoint(args.model, backend="llamacpp")))
    if args.worker:
        return worker(args)
    configs = args.configs.split(",")
    runs = {c: [] for c in configs}
    for r in range(args.rounds):
        for c in configs[r % len(configs) :] + configs[: r % len(configs)]:
            env = dict(os.environ)
            env.pop("GGML_CPU_TILED_MM", None)
            if CONFIGS[c][2] is not None:
                env["GGML_CPU_TILED_MM"] = paraspec_tiled() if CONFIGS[c][2] == PARASPEC else CONFIGS[c][2]
            env.pop("GGML_CPU_TILED_MM_FORCE", None)
            if c.endswith("tiled-all"):
                env["GGML_CPU_TILED_MM_FORCE"] = "1"
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                c,
                "--model",
                args.model,
                "--threads",
                str(args.threads),
                "--context",
                str(args.context),
                "--widths",
                ",".join(map(str, args.widths)),
                "--repeats",
                str(args.repeats),
            ] + (["--check"] if args.check and r == 0 else [])
            if c == "default" and args.default_lib:
                cmd += ["--lib", args.default_lib]
            wait_quiet(args.wait_quiet, args.max_others)
            done = []
            others = others_share(
                lambda done=done, cmd=cmd, env=env: done.append(
                    subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                )
            )
            runs[c].append(dict(json.loads(done[0].stdout.strip().splitlines()[-1]), others=others))
            print(
                f"round {r + 1}/{args.rounds} {c}: "
                + " ".join(f"w{w}={ms:.0f}" for w, ms in runs[c][-1]["ms"].items())
                + f" (others took {others:.0%} of the CPUs)",
                file=sys.stderr,
            )
    checked = {
        c: next((run["inexact_widths"] for run in runs[c] if run["inexact_widths"] is not None), None) for c in configs
    }
    quiet = {c: [run for run in runs[c] if run["others"] < args.max_others] for c in configs}
    if all(quiet.values()):
        runs = quiet
    print(
        f"{os.path.basename(args.model)}, {args.threads} thread(s), P = {args.context}, one llama_decode of w tokens "
        f"with logits for each, ms (median over rounds of the median of {args.repeats}; rounds kept: "
        + ", ".join(f"{c} {len(runs[c])}" for c in configs)
        + ("" if all(quiet.values()) else " — all, some configuration had no quiet run: machine shared")
        + ")"
    )
    print(
        "| configuration | "
        + " | ".join(f"w={w}" for w in args.widths)
        + f" | widths 2..{max(args.widths + [16])} not bitwise |"
    )
    print("|---|" + "---|" * (len(args.widths) + 1))
    for c in configs:
        med = [statistics.median(run["ms"][str(w)] for run in runs[c]) for w in args.widths]
        inexact = checked[c]
        check = "not checked" if inexact is None else (", ".join(map(str, inexact)) or "none")
        lib = f" ({args.default_lib})" if c == "default" and args.default_lib else ""
        print(f"| {c}{lib} | " + " | ".join(f"{m:.0f}" for m in med) + f" | {check} |")


if __name__ == "__main__":
    main()
