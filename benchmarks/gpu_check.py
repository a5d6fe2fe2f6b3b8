"""`make gpu-check`: everything a borrowed GPU should tell us, in one prepared run of under 8 minutes.

    python -m benchmarks.gpu_check --device cuda:0 --out DIR [--quick] [--budget-s S] [--sections a,b]

Sections, in the order they run; each is written to DIR/gpu_check.json (and the summary DIR/gpu_check.md) the
moment it ends, so a run killed at its time limit still leaves what it finished; each runs in its own try (a
failing one records its traceback and the next still runs) and under its own time cap within the budget:

    environment    the device, torch / CUDA / transformers versions, the date, the git commit
    forward_cost   one forward of random-weight decoders of real shapes (models/native/shapes.py) at widths 1..32,
                   with a 2048-slot cache holding 512 tokens: the padded forward eager and CUDA-graphed
                   (models/native/padded.py), and the dynamic (unpadded) eager forward; the width `choose_width`
                   picks for each shape
    strategies     ar, sd at acceptance 0.6 / 0.8 / 0.95, amusd and dsi through the real Engine on the one device:
                   simulated models (fixed, known acceptance) whose every forward also pays a real forward of the
                   Qwen2.5-1.5B (target) and 0.5B (draft) shapes; every run's tokens must equal ar's
    planner        sim/planner.py's recommendation and predicted TPOT for 1, 2, 4 and 8 such devices, from the
                   measured graph costs (every forward padded to the chosen width, as the engine runs it)
    profile        where one padded step's time goes, for the first pair's shapes at width PROFILE_WIDTH: torch's
                   profiler over a few eager steps (device time by aten op and input shape -- the lm_head product,
                   attention over the whole cache, norms and the rest -- and by kernel) and over graph replays
                   (kernels per step and their summed time against the replay's wall time: the gaps between
                   kernels are what fusing could remove)
    compiled       the padded step through torch.compile (fused kernels) before its graph is captured: one
                   forward's cost at widths 1 and 8 for the first pair's shapes, compiled and not, and ar / sd
                   through the Engine both ways (interleaved; tokens must equal ar's)
    suite          the lossless suite in a pytest subprocess with PARASPEC_TEST_DEVICE=<device>; its whole output
                   in DIR/suite.log

The suite runs last: the measurements are short and bounded, and the suite gets what is left of the budget (at
most its cap). A section is not started with less than MIN_START_S of the budget left.

On a CPU (or with --quick) every shape is a tiny stand-in and the runs are short: tests/bench/test_gpu_check.py
runs it that way, so the command cannot rot between GPU sessions. It needs only torch, transformers (for the
versions) and pytest (for the suite): nothing of Ray, FastAPI or llama.cpp.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SECTIONS = ("environment", "forward_cost", "strategies", "planner", "profile", "compiled", "suite")
CAP_S = {
    "environment": 30,
    "forward_cost": 120,
    "strategies": 180,
    "planner": 60,
    "profile": 90,
    "compiled": 240,
    "suite": 240,
}
PROFILE_WIDTH = 8
PROFILE_STEPS = 5
COMPILED_WIDTHS = (1, 8)
MIN_START_S = 10  # a section needs at least this much of the budget left to start
SUITE_FILES = (
    "tests/test_sampling.py",
    "tests/test_verify.py",
    "tests/test_devices.py",
    "tests/drafters/test_token_tree.py",
    "tests/models/test_llama.py",
    "tests/models/test_padded.py",
    "tests/strategies/test_lossless.py",
)
SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b", "llama-3.2-1b", "llama-3.1-8b")
QUICK_SHAPES = ("tiny-draft", "tiny-target")
PAIRS = (("qwen2.5-1.5b", "qwen2.5-0.5b"), ("llama-3.1-8b", "llama-3.2-1b"))  # (target, draft)
QUICK_PAIRS = (("tiny-target", "tiny-draft"),)
CONTEXT_SLOTS = 2048  # the padded forward attends over every slot: this fixes its context length
CACHED_TOKENS = 512  # what the dynamic forward attends over
ACCEPTANCE = (0.6, 0.8, 0.95)
SD_LOOKAHEAD = {0.6: 3, 0.8: 4, 0.95: 8}  # near the best sd lookahead for a cheap draft at each rate
PROMPT = list(range(1, 17))
PLANNER_DEVICES = (1, 2, 4, 8)


@dataclass
class Check:
    device: str
    out: Path
    quick: bool
    budget_s: float
    sections: tuple[str, ...]
    started: float = 0.0
    suite_k: str | None = None  # the suite's pytest -k selection (None: every test of SUITE_FILES)
    suite_workers: int = 0  # pytest-xdist processes for the suite (0: one pytest process)
    suite_cap_s: float = CAP_S["suite"]  # the suite's own time cap (within the budget)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def say(self, message: str) -> None:
        print(f"[gpu-check {self.elapsed():6.1f} s] {message}", flush=True)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def engine_device(self) -> str:
        """The device every model of the strategies section runs on: the GPU, or one CPU core (one thread each,
        so the workers sharing it time-share it instead of spinning against each other)."""
        if self.cuda:
            return self.device
        from paraspec.runtime.devices import available_cores

        return f"cpu:{available_cores()[0]}"

    @property
    def shapes(self) -> tuple[str, ...]:
        return QUICK_SHAPES if self.quick else SHAPES

    @property
    def pairs(self) -> tuple[tuple[str, str], ...]:
        return QUICK_PAIRS if self.quick else PAIRS


class Report:
    """The JSON and its markdown summary, rewritten whole (atomically) after every step."""

    def __init__(self, out: Path, settings: dict):
        self.out = out
        self.data = {"settings": settings, "sections": {}}

    def section(self, name: str) -> dict:
        return self.data["sections"].setdefault(name, {})

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        try:
            summary = render_markdown(self.data)
        except Exception:  # a summary bug must not lose the measurements: the JSON has them all
            summary = f"# gpu-check\n\nthe summary failed (see gpu_check.json):\n\n```\n{traceback.format_exc()}```\n"
        for name, text in (("gpu_check.json", json.dumps(self.data, indent=2, default=str)), ("gpu_check.md", summary)):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text)
            os.replace(tmp, self.out / name)


# -- running the sections ----------------------------------------------------------------------------------------


def run_section(check: Check, report: Report, name: str, body) -> None:
    record = report.section(name)
    left = check.left()
    if left < MIN_START_S:
        record.update(status="skipped", reason=f"only {max(left, 0):.0f} s of the {check.budget_s:.0f} s budget left")
        check.say(f"{name}: skipped ({record['reason']})")
        report.save()
        return
    cap = min(check.suite_cap_s if name == "suite" else CAP_S[name], left)
    check.say(f"{name}: start (cap {cap:.0f} s)")
    record.update(status="running", cap_s=round(cap, 1))
    report.save()
    start = time.perf_counter()
    try:
        body(check, record, start + cap, report.save)
        record["status"] = "partial" if record.get("stopped") else "ok"
    except Exception:
        record.update(status="failed", error=traceback.format_exc())
    finally:
        free_device(check.device)
    record["seconds"] = round(time.perf_counter() - start, 2)
    report.save()
    check.say(
        f"{name}: {record['status']} in {record['seconds']:.1f} s"
        + (f" -- {last_line(record['error'])}" if "error" in record else "")
    )


def free_device(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def last_line(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


# -- 1. environment ----------------------------------------------------------------------------------------------


def environment(check: Check, record: dict, deadline: float, save) -> None:
    import torch

    record.update(
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        host=platform.node(),
        cpus=os.cpu_count(),
        git_commit=git("rev-parse", "HEAD"),
        git_changed_files=git_changed_files(),
    )
    try:
        import transformers

        record["transformers"] = transformers.__version__
    except ImportError:
        record["transformers"] = None
    if check.cuda:
        props = torch.cuda.get_device_properties(torch.device(check.device))
        record.update(
            device=props.name,
            device_memory_gib=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
            gpus=torch.cuda.device_count(),
            cudnn=torch.backends.cudnn.version(),
        )
    else:
        record["device"] = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def git_changed_files() -> int | None:
    """Files that differ from the commit (the run may measure uncommitted work)."""
    status = git("status", "--porcelain")
    return None if status == "unknown" else len(status.splitlines())


# -- 2. forward cost by width ------------------------------------------------------------------------------------


def forward_cost(check: Check, record: dict, deadline: float, save) -> None:
    from paraspec.models.native.padded import WIDTHS

    record.update(widths=list(WIDTHS), context_slots=CONTEXT_SLOTS, cached_tokens=CACHED_TOKENS, models={})
    for shape in check.shapes:
        if time.perf_counter() > deadline:
            record["stopped"] = f"time cap reached before {shape}"
            break
        check.say(f"forward_cost: {shape}")
        entry = record["models"][shape] = {}
        try:
            measure_shape(shape, check, entry)
        except Exception:
            entry["error"] = traceback.format_exc()
            check.say(f"forward_cost: {shape} failed -- {last_line(entry['error'])}")
        free_device(check.device)
        save()


def measure_shape(shape: str, check: Check, entry: dict) -> None:
    """Milliseconds of one forward at each width: dynamic (after CACHED_TOKENS cached), padded eager, padded graph
    (CUDA only), then the width choose_width picks from the graph costs (eager on a CPU)."""
    from paraspec.models.native.decoder import NativeModel
    from paraspec.models.native.padded import WIDTHS, choose_width, forward_cost_ms
    from paraspec.models.native.shapes import random_decoder

    repeats = 5 if check.quick else 20
    start = time.perf_counter()
    decoder = random_decoder(shape, check.device)
    model = NativeModel(decoder, CONTEXT_SLOTS, padded_width=None)
    entry.update(
        dtype=str(model.dtype).removeprefix("torch."),
        weights_gb=round(sum(p.numel() * p.element_size() for p in decoder.parameters()) / 1e9, 3),
        build_s=round(time.perf_counter() - start, 2),
    )
    model.prefill([(7 * i) % model.vocab_size for i in range(CACHED_TOKENS)])
    entry["dynamic_ms"] = {w: time_dynamic(model, w, repeats) for w in WIDTHS}
    entry["padded_eager_ms"] = {w: forward_cost_ms(model, w, graph=False, repeats=repeats) for w in WIDTHS}
    if check.cuda:
        entry["padded_graph_ms"] = {w: forward_cost_ms(model, w, graph=True, repeats=repeats) for w in WIDTHS}
    costs = entry.get("padded_graph_ms") or entry["padded_eager_ms"]
    entry["chosen_width"] = choose_width(costs)
    entry["chosen_from"] = "padded_graph_ms" if "padded_graph_ms" in entry else "padded_eager_ms"
    entry["seconds"] = round(time.perf_counter() - start, 2)


def time_dynamic(model, width: int, repeats: int) -> float:
    """Median ms of one unpadded forward of `width` tokens after the cached prefix (rolled back after each)."""
    import torch

    base = model.length
    tokens = [(3 * i + 1) % model.vocab_size for i in range(width)]
    times = []
    for i in range(repeats + 3):
        if model.device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            model.forward(tokens)
            end.record()
            end.synchronize()
            elapsed = begin.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            model.forward(tokens)
            elapsed = (time.perf_counter() - t0) * 1000
        model.rollback(base)
        if i >= 3:
            times.append(elapsed)
    return statistics.median(times)


# -- 3. strategies through the Engine ----------------------------------------------------------------------------


def strategy_runs() -> list[tuple[str, float | None, dict]]:
    """(strategy, the draft's acceptance rate, options) of each run; ar first (the others are compared with it)."""
    runs = [("ar", None, {})]
    # a fixed lookahead (not sd's default, the adaptive rule): what the planner's prediction is compared with
    runs += [("sd", a, {"lookahead": SD_LOOKAHEAD[a], "adaptive": False}) for a in ACCEPTANCE]
    runs += [("amusd", 0.8, {"max_ahead": 16, "verify_chunk": 8}), ("dsi", 0.8, {"lookahead": 4, "max_ahead": 16})]
    return runs


def strategies(check: Check, record: dict, deadline: float, save) -> None:
    from paraspec import Engine, SamplingParams
    from paraspec.models.simulated import SimulatedModel, SimulatedSpec

    target_shape, draft_shape = check.pairs[0]
    tokens = 24 if check.quick else 128
    target = SimulatedSpec(role="target", shape=target_shape, seed=0)
    truth = SimulatedModel(replace(target, shape=None)).predicted[len(PROMPT) : len(PROMPT) + tokens].tolist()
    record.update(
        target=target_shape,
        draft=draft_shape,
        device=check.engine_device,
        new_tokens=tokens,
        prompt_tokens=len(PROMPT),
        max_context=CONTEXT_SLOTS,
        runtime_kind="process",
        runs=[],
    )
    ar_tokens = None
    for strategy, rate, options in strategy_runs():
        if time.perf_counter() > deadline:
            record["stopped"] = f"time cap reached before {strategy}"
            break
        label = strategy if rate is None else f"{strategy} a={rate}"
        check.say(f"strategies: {label}")
        entry = dict(strategy=strategy, acceptance_rate=rate, options=options)
        record["runs"].append(entry)
        try:
            draft = (
                None if rate is None else SimulatedSpec(role="draft", shape=draft_shape, seed=0, acceptance_rate=rate)
            )
            start = time.perf_counter()
            with Engine(
                target,
                draft,
                strategy=strategy,
                target_devices=[check.engine_device],
                draft_devices=[check.engine_device],
                runtime_kind="process",
                max_context=CONTEXT_SLOTS,
                **options,
            ) as engine:
                entry["startup_s"] = round(time.perf_counter() - start, 2)
                real = getattr(engine.target, "real", None)  # in this process (ar, sd), not in workers
                entry["padded_width"] = real.padded_width if real is not None else "auto (in the workers)"
                engine.generate(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=8))  # warm-up
                result = engine.generate(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=tokens))
            s = result.stats
            entry.update(
                tpot_ms=s.tpot_ms,
                ms_per_token=s.ms_per_token,
                ttft_ms=s.ttft_s * 1000,
                measured_acceptance=s.acceptance_rate,
                mean_accepted_length=s.mean_accepted_length,
                new_tokens=s.new_tokens,
                rounds=s.rounds,
                rollbacks=s.rollbacks,
                tokens_match_truth=result.token_ids == truth,
            )
            if strategy == "ar":
                ar_tokens = result.token_ids
            entry["tokens_match_ar"] = None if ar_tokens is None else result.token_ids == ar_tokens
            check.say(f"strategies: {label}: TPOT {s.tpot_ms:.2f} ms, equal to ar: {entry['tokens_match_ar']}")
        except Exception:
            entry["error"] = traceback.format_exc()
            check.say(f"strategies: {label} failed -- {last_line(entry['error'])}")
        free_device(check.device)
        save()


# -- 4. planner ---------------------------------------------------------------------------------------------------


def padded_forward_ms(model: dict) -> tuple[int, dict[str, float]]:
    """(W, ms of a forward of n tokens for n = 1..4W): the engine pads every forward to W rows, so n tokens take
    ceil(n / W) steps of the W-row cost."""
    width = int(model["chosen_width"])
    costs = {int(w): float(ms) for w, ms in model[model["chosen_from"]].items()}
    return width, {str(n): math.ceil(n / width) * costs[width] for n in range(1, 4 * width + 1)}


def planner(check: Check, record: dict, deadline: float, save, measured: dict | None = None) -> None:
    from paraspec.sim.costs import Profile
    from paraspec.sim.planner import plan

    models = (measured or {}).get("models", {})
    kind = "cuda" if check.cuda else "cpu"
    record.update(
        cost_model="every forward padded to the shape's chosen width W: ceil(n / W) x cost(W) "
        "(graph costs on CUDA, eager on CPU); prefill of the 16-token prompt the same way",
        plans=[],
    )
    for target, draft in check.pairs:
        missing = [s for s in (target, draft) if "chosen_width" not in models.get(s, {})]
        if missing:
            record["plans"].append(
                dict(target=target, draft=draft, error=f"no forward_cost measurement of {', '.join(missing)}")
            )
            continue
        profiles = {}
        for role, shape in (("target", target), ("draft", draft)):
            width, forward = padded_forward_ms(models[shape])
            profiles[role] = dict(
                model=shape,
                tpot_ms=forward["1"],
                forward_ms=forward,
                ttft_ms=math.ceil(len(PROMPT) / width) * forward[str(width)],
            )
        for rate in ACCEPTANCE:
            for n in PLANNER_DEVICES:
                if time.perf_counter() > deadline:
                    record["stopped"] = f"time cap reached before {target}/{draft} a={rate} on {n} devices"
                    return
                devices = [f"{kind}:{i}" for i in range(n)]
                profile = Profile.from_dict(
                    dict(
                        target={**profiles["target"], "device": devices[-1]},
                        draft={**profiles["draft"], "device": devices[0]},
                        acceptance_rate=rate,
                        devices=devices,
                    )
                )
                p = plan(
                    profile,
                    tokens=64 if check.quick else 128,
                    repeats=1 if check.quick else 3,
                    lookaheads=range(1, 9 if check.quick else 11),
                )
                r = p.recommended
                record["plans"].append(
                    dict(
                        target=target,
                        draft=draft,
                        acceptance_rate=rate,
                        devices=n,
                        recommended=r.strategy,
                        settings=r.settings(),
                        placement=r.placement(),
                        tpot_ms=r.tpot_ms,
                        ar_tpot_ms=p.choices["ar"].tpot_ms,
                        best_tpot_ms={k: (c.tpot_ms if c else None) for k, c in p.choices.items()},
                    )
                )
        save()
        check.say(f"planner: {target} / {draft} done")


# -- 5. where a step's time goes -----------------------------------------------------------------------------------


def profile(check: Check, record: dict, deadline: float, save) -> None:
    """torch.profiler over PROFILE_STEPS padded steps of the first pair's shapes, eager and (CUDA) graph-replayed.
    Eager: self device time (CPU time on a CPU) by aten op and input shape, and by kernel category. Graph: the
    kernels one replay launches and their summed time, against the replay's wall time (CUDA events)."""
    from paraspec.models.native.decoder import NativeModel
    from paraspec.models.native.padded import PaddedForward, step_cost_ms
    from paraspec.models.native.shapes import random_decoder

    target_shape, draft_shape = check.pairs[0]
    record.update(width=PROFILE_WIDTH, steps=PROFILE_STEPS, context_slots=CONTEXT_SLOTS, models={})
    modes = ("eager", "graph") if check.cuda else ("eager",)
    for shape in (draft_shape, target_shape):
        if time.perf_counter() > deadline:
            record["stopped"] = f"time cap reached before {shape}"
            return
        entry = record["models"][shape] = {}
        try:
            model = NativeModel(random_decoder(shape, check.device), CONTEXT_SLOTS, padded_width=None)
            for mode in modes:
                padded = PaddedForward(model, PROFILE_WIDTH, graph=mode == "graph")
                entry[mode] = profile_step(padded, check.cuda)
                entry[mode]["wall_ms"] = step_cost_ms(padded, repeats=5 if check.quick else 20)
                check.say(
                    f"profile: {shape} {mode}: {entry[mode]['wall_ms']:.2f} ms a step, "
                    f"{entry[mode]['kernels_per_step']:.0f} kernels summing {entry[mode]['kernel_ms']:.2f} ms"
                )
                save()
            del model
        except Exception:
            entry["error"] = traceback.format_exc()
            check.say(f"profile: {shape} failed -- {last_line(entry['error'])}")
        free_device(check.device)
        save()


KERNEL_KINDS = (
    ("attention", ("attention", "fmha", "flash", "softmax")),  # first: fmha kernels are cutlass's
    ("matmul", ("gemm", "gemv", "cutlass", "xmma", "cublas", "matmul", "splitk", "nvjet")),
    ("reduction", ("reduce",)),
    ("copy/index", ("copy", "index", "gather", "scatter", "cat", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
)
OP_KINDS = (
    ("matmul", ("mm", "addmm", "bmm", "matmul", "linear")),
    ("attention", ("scaled_dot_product", "attention", "softmax")),
    (
        "copy/index",
        ("copy_", "index", "embedding", "gather", "scatter", "cat", "fill_", "masked_fill", "zeros", "to", "_to_copy"),
    ),
)


def kind_of(name: str, kinds) -> str:
    low = name.lower()
    for kind, marks in kinds:
        if any(mark in low for mark in marks):
            return kind
    return "other"


def op_kind(name: str) -> str:
    bare = name.split("::", 1)[-1]
    for kind, marks in OP_KINDS:
        if any(bare == m or bare.startswith(m + "_") or (len(m) > 4 and m in bare) for m in marks):
            return kind
    return "elementwise/norm"


def profile_step(padded, cuda: bool) -> dict:
    """One profile of PROFILE_STEPS runs of `padded` (after 3 warm-ups); times per step, ms.

    `profiled_ms` is the wall time of a step under the profiler, measured around the same steps the ops were
    recorded in, so the ops' self times can be compared with it whatever else the machine is doing."""
    import time

    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.inference_mode():
        for _ in range(3):
            padded.run()
        if cuda:
            torch.cuda.synchronize()
        with torch_profile(activities=activities, record_shapes=True) as prof:
            start = time.perf_counter()
            for _ in range(PROFILE_STEPS):
                padded.run()
            if cuda:
                torch.cuda.synchronize()
            profiled_ms = 1000.0 * (time.perf_counter() - start) / PROFILE_STEPS
    padded.model.cache.length = 0
    per_step = 1000.0 * PROFILE_STEPS  # profiler times are microseconds
    kernels = [e for e in prof.events() if cuda and e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list] = {}  # kernel name -> [launches, ms a step]
    for e in kernels:
        tally = by_name.setdefault(e.name, [0, 0.0])
        tally[0] += 1
        tally[1] += e.time_range.elapsed_us() / per_step
    kernel_kinds: dict[str, float] = {}
    for name, (_, ms) in by_name.items():
        kind = kind_of(name, KERNEL_KINDS)
        kernel_kinds[kind] = kernel_kinds.get(kind, 0.0) + ms
    top_kernels = [
        dict(name=name[:160], kind=kind_of(name, KERNEL_KINDS), calls=n / PROFILE_STEPS, ms=round(ms, 4))
        for name, (n, ms) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]
    ]
    time_of = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    ops = []
    for e in prof.key_averages(group_by_input_shape=True):
        if "::" not in e.key or not time_of(e):  # torch's ops (aten::, mkl::, mkldnn::), not ranges
            continue
        ops.append(
            dict(
                op=e.key,
                shapes=str(e.input_shapes)[:160],
                calls=e.count / PROFILE_STEPS,
                ms=time_of(e) / per_step,
                kind=op_kind(e.key),
            )
        )
    ops.sort(key=lambda o: -o["ms"])
    op_kinds: dict[str, float] = {}
    for o in ops:
        op_kinds[o["kind"]] = op_kinds.get(o["kind"], 0.0) + o["ms"]
    return dict(
        kernels_per_step=len(kernels) / PROFILE_STEPS,
        kernel_ms=sum(kernel_kinds.values()),
        kernel_kinds={k: round(v, 4) for k, v in sorted(kernel_kinds.items(), key=lambda kv: -kv[1])},
        op_kinds={k: round(v, 4) for k, v in sorted(op_kinds.items(), key=lambda kv: -kv[1])},
        top_ops=[{**o, "ms": round(o["ms"], 4)} for o in ops[:12]],
        top_kernels=top_kernels,
        op_ms=round(sum(o["ms"] for o in ops), 4),
        profiled_ms=profiled_ms,
    )


# -- 6. the step through torch.compile ---------------------------------------------------------------------------


def compiled(check: Check, record: dict, deadline: float, save) -> None:
    """Does fusing the step's small kernels pay? The graph forwards are far from the memory bound (docs/GPU.md):
    ~40 kernels a layer. Costs by width, then ar and sd through the Engine, compiled and not, one after the other."""
    from paraspec.models.native.decoder import NativeModel
    from paraspec.models.native.padded import forward_cost_ms
    from paraspec.models.native.shapes import random_decoder

    repeats = 5 if check.quick else 20
    target_shape, draft_shape = check.pairs[0]
    widths = COMPILED_WIDTHS[-1:] if check.quick else COMPILED_WIDTHS
    record.update(widths=list(widths), context_slots=CONTEXT_SLOTS, models={}, runs=[])
    # the Engine runs first: they are the answer (does sd beat ar once the step is fused?); their compiles also
    # fill inductor's cache for the forward costs of the same width below
    engine_runs(check, record, deadline, save, target_shape, draft_shape)
    for shape in (draft_shape, target_shape):
        if time.perf_counter() > deadline:
            record["stopped"] = f"time cap reached before {shape}"
            return
        entry = record["models"][shape] = {"graph_ms": {}, "compiled_graph_ms": {}, "compile_s": {}}
        model = NativeModel(random_decoder(shape, check.device), CONTEXT_SLOTS, padded_width=None)
        graph = True if check.cuda else False
        for width in widths:
            if time.perf_counter() > deadline:
                record["stopped"] = f"time cap reached before {shape} W={width}"
                return
            entry["graph_ms"][width] = forward_cost_ms(model, width, graph=graph, repeats=repeats)
            start = time.perf_counter()
            entry["compiled_graph_ms"][width] = forward_cost_ms(
                model, width, graph=graph, repeats=repeats, compiled=True
            )
            entry["compile_s"][width] = round(time.perf_counter() - start, 1)
            check.say(
                f"compiled: {shape} W={width}: {entry['graph_ms'][width]:.2f} -> "
                f"{entry['compiled_graph_ms'][width]:.2f} ms (compile {entry['compile_s'][width]} s)"
            )
            save()
        del model
        free_device(check.device)


def engine_runs(check: Check, record: dict, deadline: float, save, target_shape: str, draft_shape: str) -> None:
    """ar, sd a=0.8 and sd a=0.95 through the Engine (in this process) with the step compiled and not."""
    from paraspec import Engine, SamplingParams
    from paraspec.models.simulated import SimulatedSpec

    tokens = 24 if check.quick else 128
    width = 8
    ar_tokens = {}
    runs = (("ar", None), ("sd", 0.95)) if check.quick else (("ar", None), ("sd", 0.8), ("sd", 0.95))
    for strategy, rate in runs:
        for compile_step in (False, True):
            if time.perf_counter() > deadline:
                record["stopped"] = f"time cap reached before {strategy} a={rate} compiled={compile_step}"
                return
            entry = dict(strategy=strategy, acceptance_rate=rate, compiled=compile_step, padded_width=width)
            record["runs"].append(entry)
            try:
                target = SimulatedSpec(role="target", shape=target_shape, seed=0, compile_step=compile_step)
                draft = (
                    None
                    if rate is None
                    else SimulatedSpec(
                        role="draft", shape=draft_shape, seed=0, acceptance_rate=rate, compile_step=compile_step
                    )
                )
                options = {} if rate is None else {"lookahead": SD_LOOKAHEAD[rate], "adaptive": False}
                start = time.perf_counter()
                with Engine(
                    target,
                    draft,
                    strategy=strategy,
                    target_devices=[check.engine_device],
                    draft_devices=[check.engine_device],
                    max_context=CONTEXT_SLOTS,
                    padded_width=width,
                    **options,
                ) as engine:
                    engine.generate(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=8))  # warm-up
                    entry["startup_s"] = round(time.perf_counter() - start, 2)
                    result = engine.generate(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=tokens))
                s = result.stats
                entry.update(tpot_ms=s.tpot_ms, ms_per_token=s.ms_per_token, measured_acceptance=s.acceptance_rate)
                if strategy == "ar":
                    ar_tokens[compile_step] = result.token_ids
                entry["tokens_match_ar"] = result.token_ids == ar_tokens.get(False)
                check.say(
                    f"compiled: {strategy} a={rate} compiled={compile_step}: TPOT {s.tpot_ms:.2f} ms, "
                    f"= ar: {entry['tokens_match_ar']}"
                )
            except Exception:
                entry["error"] = traceback.format_exc()
                check.say(
                    f"compiled: {strategy} a={rate} compiled={compile_step} failed -- {last_line(entry['error'])}"
                )
            free_device(check.device)
            save()


# -- 7. the lossless suite on the device ------------------------------------------------------------------------

SUMMARY_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)\b")


def parse_pytest_summary(output: str) -> dict | None:
    """Counts from pytest's last summary line ("3 failed, 40 passed, 2 skipped in 12.3s"), or None if there is
    none (pytest killed before it printed one)."""
    for line in reversed(output.strip().splitlines()):
        duration = re.search(r" in ([\d.]+)s\b", line)
        counts = SUMMARY_COUNT.findall(line)
        if duration and (counts or "no tests ran" in line):
            out = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
            for number, what in counts:
                key = {"errors": "error", "warnings": "warning"}.get(what, what)
                out[key] = out.get(key, 0) + int(number)
            out["seconds"] = float(duration.group(1))
            return out
    return None


def failed_tests(output: str) -> list[str]:
    """The node ids of the tests that failed or errored, from pytest -v's per-test lines ("tests/x.py::t FAILED",
    "[gw3] ... FAILED tests/x.py::t" under xdist) and the -rfE summary; in order, each once."""
    found = []
    for line in output.splitlines():
        for match in re.finditer(r"(tests/\S+::\S+)\s+(?:FAILED|ERROR)\b|(?:FAILED|ERROR)\s+(tests/\S+::\S+)", line):
            node = match.group(1) or match.group(2)
            if node not in found:
                found.append(node)
    return found


def suite(check: Check, record: dict, deadline: float, save) -> None:
    files = [f for f in SUITE_FILES if (ROOT / f).exists()]
    cap = max(deadline - time.perf_counter(), 1.0)
    # no -x: a borrowed GPU's minutes are few, so one run reports every failure
    # -v: each test's outcome is written as it ends (with xdist too), so a suite cut at its cap still names
    # every test that failed before then
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "--durations=10", "-p", "no:cacheprovider", *files]
    if check.suite_k:
        cmd += ["-k", check.suite_k]
    if check.suite_workers:
        cmd += ["-n", str(check.suite_workers)]
    record.update(
        files=files,
        missing=[f for f in SUITE_FILES if f not in files],
        command=" ".join(cmd[2:]),
        test_device=check.device,
        workers=check.suite_workers,
    )
    env = dict(
        os.environ,
        PARASPEC_TEST_DEVICE=check.device,
        PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
    )
    log = check.out / "suite.log"
    with open(log, "w") as sink:
        # its own session: on a timeout the whole group goes (pytest and the workers its tests spawned)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            record["returncode"] = proc.wait(timeout=cap)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            timed_out = True
    output = log.read_text(errors="replace")
    record["counts"] = parse_pytest_summary(output)
    record["failed_tests"] = failed_tests(output)
    record["tail"] = "\n".join(output.rstrip().splitlines()[-40:])
    if timed_out:
        record["outcome"] = f"timeout after {cap:.0f} s"
    elif record["returncode"] == 0:
        record["outcome"] = "passed"
    elif record["returncode"] == 5:
        record["outcome"] = "no tests ran"
    else:
        record["outcome"] = "failed"
    check.say(f"suite: {record['outcome']} {record['counts'] or ''}")


# -- the summary --------------------------------------------------------------------------------------------------


def _ms(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def render_markdown(data: dict) -> str:
    settings, sections = data["settings"], data["sections"]
    lines = [
        f"# gpu-check on {settings['device']}",
        "",
        f"quick: {settings['quick']}, budget {settings['budget_s']:.0f} s, "
        f"elapsed {settings.get('elapsed_s', 0):.0f} s",
        "",
        "| section | status | seconds | note |",
        "|---|---|---|---|",
    ]
    for name in SECTIONS:
        s = sections.get(name)
        if s is None:
            continue
        note = s.get("reason") or s.get("stopped") or (last_line(s["error"]) if "error" in s else "")
        lines.append(f"| {name} | {s.get('status')} | {s.get('seconds', '')} | {note.replace('|', '/')} |")
    env = sections.get("environment", {})
    if env.get("status") in ("ok", "failed") and "torch" in env:
        lines += ["", "## Environment", ""]
        lines += [
            f"- {k}: {env.get(k)}"
            for k in (
                "device",
                "device_memory_gib",
                "capability",
                "torch",
                "cuda",
                "transformers",
                "python",
                "date",
                "git_commit",
                "git_changed_files",
            )
            if k in env
        ]
    lines += _forward_cost_md(sections.get("forward_cost", {}))
    lines += _strategies_md(sections.get("strategies", {}))
    lines += _planner_md(sections.get("planner", {}), sections.get("strategies", {}))
    lines += _profile_md(sections.get("profile", {}))
    lines += _compiled_md(sections.get("compiled", {}))
    suite_record = sections.get("suite", {})
    if "outcome" in suite_record:
        counts = suite_record.get("counts") or {}
        lines += [
            "",
            "## Lossless suite on the device",
            "",
            f"**{suite_record['outcome']}** -- " + ", ".join(f"{v} {k}" for k, v in counts.items()),
            "",
            f"`{suite_record['command']}` with PARASPEC_TEST_DEVICE={suite_record['test_device']}",
        ]
        if suite_record.get("failed_tests"):
            lines += ["", "Failed:", ""] + [f"- `{node}`" for node in suite_record["failed_tests"]]
        if suite_record.get("missing"):
            lines.append(f"(not present: {', '.join(suite_record['missing'])})")
        lines += ["", "```", suite_record.get("tail", ""), "```"]
    return "\n".join(lines) + "\n"


def _forward_cost_md(record: dict) -> list[str]:
    models = record.get("models") or {}
    if not models:
        return []
    widths = record["widths"]
    lines = [
        "",
        "## Forward cost by width (ms per forward)",
        "",
        f"Random weights; a {record['context_slots']}-slot cache (the padded forward attends over every slot; "
        f"the dynamic one over {record['cached_tokens']} cached tokens). W: the width choose_width picks.",
        "",
    ]
    for shape, m in models.items():
        if "error" in m:
            lines += [f"**{shape}**: failed -- {last_line(m['error'])}", ""]
            continue
        if "chosen_width" not in m:
            continue
        head = f"**{shape}** ({m['weights_gb']} GB {m['dtype']}, W = {m['chosen_width']})"
        graph = m.get("padded_graph_ms")
        if graph:  # a 1-row forward reads every weight once: how close to the memory bandwidth it runs
            head += f"; 1-row graph forward reads the weights at {m['weights_gb'] / graph[1] * 1000:.0f} GB/s"
        lines += [head, "", "| forward | " + " | ".join(f"{w}" for w in widths) + " |", "|---|" + "---|" * len(widths)]
        for key, label in (
            ("dynamic_ms", "dynamic eager"),
            ("padded_eager_ms", "padded eager"),
            ("padded_graph_ms", "padded graph"),
        ):
            if key in m:
                lines.append(
                    f"| {label} | " + " | ".join(_ms(m[key].get(w, m[key].get(str(w)))) for w in widths) + " |"
                )
        lines.append("")
    return lines


def _strategies_md(record: dict) -> list[str]:
    runs = record.get("runs") or []
    if not runs:
        return []
    lines = [
        "",
        "## Strategies through the Engine (oracle acceptance, real forwards)",
        "",
        f"target {record['target']}, draft {record['draft']}, both on {record['device']}; "
        f"{record['new_tokens']} new tokens, greedy; amusd and dsi workers are processes sharing it.",
        "",
        "| strategy | acceptance | options | TPOT ms | ms/token | measured acceptance | mean accepted | "
        "= ar | startup s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        options = ", ".join(f"{k} {v}" for k, v in r["options"].items()) or "-"
        if "error" in r:
            lines.append(
                f"| {r['strategy']} | {r['acceptance_rate'] or '-'} | {options} | failed: "
                f"{last_line(r['error']).replace('|', '/')} | | | | | |"
            )
            continue
        if "tpot_ms" not in r:
            continue
        measured = "-" if r["measured_acceptance"] is None else f"{r['measured_acceptance']:.2f}"
        mal = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        lines.append(
            f"| {r['strategy']} | {r['acceptance_rate'] or '-'} | {options} | {_ms(r['tpot_ms'])} | "
            f"{_ms(r['ms_per_token'])} | {measured} | {mal} | {r['tokens_match_ar']} | {r['startup_s']} |"
        )
    return lines


def _planner_md(record: dict, strategies_record: dict) -> list[str]:
    plans = record.get("plans") or []
    if not plans:
        return []
    lines = [
        "",
        "## Planner predictions from the measured costs",
        "",
        f"Cost model: {record['cost_model']}.",
        "",
        "| target / draft | acceptance | devices | recommended | settings | TPOT ms | ar TPOT ms | vs ar | "
        "best sd | best amusd | best dsi |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in plans:
        if "error" in p:
            lines.append(f"| {p['target']} / {p['draft']} | | | {p['error']} | | | | | | | |")
            continue
        best = p["best_tpot_ms"]
        lines.append(
            f"| {p['target']} / {p['draft']} | {p['acceptance_rate']} | {p['devices']} | {p['recommended']} "
            f"| {p['settings']} | {_ms(p['tpot_ms'])} | {_ms(p['ar_tpot_ms'])} | "
            f"{p['ar_tpot_ms'] / p['tpot_ms']:.2f}x | {_ms(best.get('sd'))} | {_ms(best.get('amusd'))} | "
            f"{_ms(best.get('dsi'))} |"
        )
    # one device: the planner's ar / sd against what the Engine measured (same pair, same rates)
    runs = [r for r in strategies_record.get("runs") or [] if "tpot_ms" in r and r["strategy"] in ("ar", "sd")]
    one = {
        p["acceptance_rate"]: p
        for p in plans
        if p.get("devices") == 1 and p["target"] == strategies_record.get("target")
    }
    if runs and one:
        lines += [
            "",
            "One device, predicted vs measured TPOT (ms):",
            "",
            "| run | predicted | measured |",
            "|---|---|---|",
        ]
        for r in runs:
            rate = r["acceptance_rate"]
            plan_row = one.get(rate) or next(iter(one.values()))
            if r["strategy"] == "ar":
                label, predicted = "ar", _ms(plan_row["ar_tpot_ms"])
            else:
                label = f"sd a={rate} (lookahead {r['options'].get('lookahead')})"
                predicted = f"{_ms(plan_row['best_tpot_ms'].get('sd'))} (its best lookahead)"
            lines.append(f"| {label} | {predicted} | {_ms(r['tpot_ms'])} |")
    return lines


def _profile_md(record: dict) -> list[str]:
    models = record.get("models") or {}
    if not models:
        return []
    lines = [
        "",
        f"## Where a step's time goes (width {record['width']}, {record['context_slots']} slots, "
        f"{record['steps']} profiled steps)",
        "",
        "| model | forward | wall ms | kernels | kernel ms | by kind (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for shape, m in models.items():
        if "error" in m:
            lines.append(f"| {shape} | failed: {last_line(m['error']).replace('|', '/')} | | | | |")
            continue
        for mode in ("eager", "graph"):
            if mode in m:
                r = m[mode]
                kinds = r["kernel_kinds"] or r["op_kinds"]
                lines.append(
                    f"| {shape} | {mode} | {_ms(r['wall_ms'])} | {r['kernels_per_step']:.0f} | "
                    f"{_ms(r['kernel_ms'])} | " + ", ".join(f"{k} {v:.2f}" for k, v in kinds.items()) + " |"
                )
    for shape, m in models.items():
        if "eager" in m:
            lines += [
                "",
                f"{shape}, eager: the costliest ops (ms a step)",
                "",
                "| op | input shapes | calls | ms |",
                "|---|---|---|---|",
            ]
            lines += [
                f"| {o['op']} | `{o['shapes']}` | {o['calls']:.0f} | {o['ms']:.3f} |" for o in m["eager"]["top_ops"][:8]
            ]
    return lines


def _compiled_md(record: dict) -> list[str]:
    models, runs = record.get("models") or {}, record.get("runs") or []
    if not models and not runs:
        return []
    lines = [
        "",
        "## The step through torch.compile",
        "",
        "| model | width | graph ms | compiled graph ms | compile s |",
        "|---|---|---|---|---|",
    ]
    for shape, m in models.items():
        for w in m.get("compiled_graph_ms", {}):
            lines.append(
                f"| {shape} | {w} | {_ms(m['graph_ms'].get(w))} | {_ms(m['compiled_graph_ms'][w])} | "
                f"{m['compile_s'].get(w)} |"
            )
    if runs:
        lines += [
            "",
            "| strategy | acceptance | compiled | TPOT ms | ms/token | = ar | startup s |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in runs:
            if "error" in r:
                lines.append(
                    f"| {r['strategy']} | {r['acceptance_rate'] or '-'} | {r['compiled']} | failed: "
                    f"{last_line(r['error']).replace('|', '/')} | | | |"
                )
            elif "tpot_ms" in r:
                lines.append(
                    f"| {r['strategy']} | {r['acceptance_rate'] or '-'} | {r['compiled']} | "
                    f"{_ms(r['tpot_ms'])} | {_ms(r['ms_per_token'])} | {r['tokens_match_ar']} | "
                    f"{r['startup_s']} |"
                )
    return lines


# -- the command ---------------------------------------------------------------------------------------------------


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda:0", help="cuda:N, or cpu (implies --quick)")
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or "out/gpu-check",
        help="output folder (default: $OUT, else out/gpu-check)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes and short runs (always on a CPU)")
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="no section starts after this many seconds (default 420)"
    )
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)"
    )
    parser.add_argument(
        "--suite-k",
        default=None,
        metavar="EXPR",
        help="the suite section runs only the tests pytest -k EXPR selects (default: all of them)",
    )
    parser.add_argument(
        "--suite-cap-s",
        type=float,
        default=CAP_S["suite"],
        help=f"the suite's time cap within the budget (default {CAP_S['suite']})",
    )
    parser.add_argument(
        "--suite-workers",
        default="auto",
        metavar="N",
        help="pytest-xdist processes sharing the device for the suite: an integer (0: one pytest "
        "process) or 'auto' (default: half the CPUs, at most 8, on CUDA where pytest-xdist "
        "is installed; else 0)",
    )
    args = parser.parse_args(argv)
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    args.sections = sections
    args.suite_workers = suite_workers(parser, args.suite_workers, args.device)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error(
                f"--device {args.device}: torch sees no CUDA device here; pass --device cpu for the tiny CPU run"
            )
    elif args.device != "cpu":
        parser.error(f"--device {args.device!r}: use cuda:N or cpu")
    return args


def suite_workers(parser, value: str, device: str) -> int:
    """--suite-workers as a count. The suite's tests are independent (their own temporary folders, shared-memory
    names and ports), so on a GPU machine's many cores several pytest processes can share the one device: the
    suite then fits a borrowed GPU's minutes."""
    import importlib.util

    has_xdist = importlib.util.find_spec("xdist") is not None
    if value == "auto":
        return min(8, (os.cpu_count() or 2) // 2) if device.startswith("cuda") and has_xdist else 0
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        parser.error(f"--suite-workers {value!r}: an integer >= 0 or 'auto'")
    if count and not has_xdist:
        parser.error(f"--suite-workers {count} needs pytest-xdist (pip install pytest-xdist), or pass 0")
    return count


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    check = Check(
        device=args.device,
        out=Path(args.out),
        quick=args.quick or not args.device.startswith("cuda"),
        budget_s=args.budget_s,
        sections=args.sections,
        started=time.perf_counter(),
        suite_k=args.suite_k,
        suite_workers=args.suite_workers,
        suite_cap_s=args.suite_cap_s,
    )
    report = Report(
        check.out, dict(device=check.device, quick=check.quick, budget_s=check.budget_s, sections=list(check.sections))
    )
    check.say(f"device {check.device}, quick {check.quick}, budget {check.budget_s:.0f} s, out {check.out}")
    bodies = dict(
        environment=environment,
        forward_cost=forward_cost,
        strategies=strategies,
        planner=lambda c, r, d, s: planner(c, r, d, s, report.data["sections"].get("forward_cost")),
        profile=profile,
        compiled=compiled,
        suite=suite,
    )
    import torch

    threads = torch.get_num_threads()
    if not check.cuda:
        torch.set_num_threads(1)  # a CPU run is a smoke test: one thread times steadily on a shared machine
    try:
        for name in SECTIONS:
            if name in check.sections:
                run_section(check, report, name, bodies[name])
            report.data["settings"]["elapsed_s"] = round(check.elapsed(), 1)
    finally:
        torch.set_num_threads(threads)
    report.save()
    check.say(f"done: {check.out / 'gpu_check.json'}, {check.out / 'gpu_check.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
