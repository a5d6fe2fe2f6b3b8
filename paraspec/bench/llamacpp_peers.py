"""The llama.cpp peers: llama.cpp generating alone (llamacpp-ar), with its own speculative decoding (llamacpp-spec)
and with its own model-free n-gram drafting (llamacpp-ngram), on the same GGUF files, cores, threads, prompt token
ids and stop rules as paraspec's variants.

Both run llama.cpp's `llama-server`, built with llama.cpp's default options from the source that the pinned
llama-cpp-python vendors (`python scripts/build_llamacpp.py peer`): the peer is what a user would run. One server per
variant, started once per benchmark on a port of 127.0.0.1 that it picks, pinned to the variant's cores with its
thread count, and stopped on close, on an exception, on Ctrl-C, and (PR_SET_PDEATHSIG) when this process dies.

A request sends the prompt as token ids with the prompt cache off, n_predict = max_new_tokens, and greedy as
top-k 1 (sampling: temperature, top-k, top-p in paraspec's order). The wall clock around the request gives
ms/token as for every other variant; the server's own timings give TTFT (its prompt time) and the draft counts
(draft_n, draft_n_accepted). The server stops on its end-of-generation tokens (the model's EOS ids and a few
more, such as Qwen's FIM tokens); a difference from paraspec's stop set shows in the report's `= ar` column.

llamacpp-spec's draft settings (draft max, p-min) are fixed when the server starts (this llama.cpp compiles the
per-request ones out), so `tune` starts one server per setting of a small grid, times each on the tuning
prompts, keeps the fastest and records the whole grid. llamacpp-ngram does the same over llama-server's n-gram
drafters (`--spec-type`, docs/speculative.md of the vendored llama.cpp): ngram-simple (the last n tokens
matched in the context, the m tokens after the match proposed: prompt lookup), and ngram-mod (a hash of every
n-gram to its next token, shared across requests; `--spec-default` turns it on with n 24, m 48-64). llama.cpp's
default kernels are not batch-invariant (docs/LLAMACPP.md), so llamacpp-spec may return other tokens than
llamacpp-ar: the report shows it, nothing hides it.
"""

from __future__ import annotations

import ctypes
import http.client
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from paraspec.engine import GenerationResult
from paraspec.request_state import RequestState
from paraspec.sampling import SamplingParams, make_generator
from paraspec.stats import compute_stats
from paraspec.trace import Trace

LLAMACPP_STRATEGIES = {
    "llamacpp-ar": "llama.cpp's llama-server (default build) generating alone on the target GGUF, same cores/threads",
    "llamacpp-spec": "llama-server's own speculative decoding with the draft GGUF (best draft max / p-min of a grid)",
    "llamacpp-ngram": "llama-server's own n-gram speculative decoding, no draft model (best --spec-type/n/m of a grid)",
}
# (draft max, p-min): llama.cpp's drafting stops at draft max tokens or at a draft probability below p-min
DEFAULT_SPEC_GRID = tuple((n, p) for n in (4, 8, 16) for p in (0.0, 0.5, 0.8))
# (spec type, n, m): llama.cpp's own defaults for each type first (ngram-simple 12/48, --spec-default's ngram-mod
# 24/64), then shorter lookups and drafts, which suit CPUs, where verification is compute-bound (a forward of many
# tokens costs several decoding steps: benchmarks/llamacpp_forward_widths.py)
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod")
DEFAULT_NGRAM_GRID = (("ngram-simple", 12, 48), ("ngram-mod", 24, 64), ("ngram-simple", 4, 16), ("ngram-simple", 3, 8))
TUNE_TOKENS = 64  # new tokens per tuning prompt (fewer if --max-new-tokens is lower)
BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_llamacpp.py"


class PeerError(RuntimeError):
    """llama-server failed to start or to answer; the message carries the end of its log."""


# -- the programs and the files -----------------------------------------------------------------------------
def _build_script():
    """scripts/build_llamacpp.py as a module: its build key (version, options, CPU, compiler) names the cached
    build that is this machine's, so the peer is found and built by the same code."""
    if not BUILD_SCRIPT.is_file():
        raise PeerError(
            f"the llama.cpp peers need paraspec's source checkout ({BUILD_SCRIPT} is missing): they "
            f"are built by scripts/build_llamacpp.py"
        )
    spec = importlib.util.spec_from_file_location("paraspec_build_llamacpp", BUILD_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def peer_binaries(build: bool = True) -> Path:
    """The folder holding llama-server (and llama-speculative-simple) for this machine; built first if missing
    and `build` (about 5-10 minutes on 2 cores, once per version, CPU and compiler)."""
    script = _build_script()
    folder = script.peer_dir()
    if all((folder / name).is_file() for name in script.PEER_TARGETS):
        return folder
    if not build:
        raise PeerError(
            f"llama.cpp's peer programs are not built for this machine (no {folder}); run "
            f"`python scripts/build_llamacpp.py peer` (about 5-10 minutes)"
        )
    print(f"llamacpp peers: building llama-server for this CPU into {folder} (once)", file=sys.stderr, flush=True)
    return script.build_peer()


def peer_build_label(binaries: Path) -> str:
    """'llama.cpp default build', plus the crash fixes it was built with (scripts/patches/*-fix-*: they change no
    result), as its build.json records them."""
    try:
        patches = json.loads((Path(binaries).parent / "build.json").read_text()).get("patches") or []
    except (OSError, ValueError):
        patches = []
    fixes = [p.removesuffix(".patch").split("-fix-", 1)[-1] for p in patches]
    return "llama.cpp default build" + (
        f" + crash fix{'es' if len(fixes) > 1 else ''} {', '.join(fixes)}" if fixes else ""
    )


def gguf_file(spec: str | os.PathLike, role: str = "target") -> Path:
    """The GGUF file behind a model argument: a .gguf path, or a checkpoint folder or hub id that paraspec
    converted from a GGUF (its paraspec_source.json records gguf_path; the reference pair's does)."""
    from paraspec.models.cache import read_marker
    from paraspec.models.loader import resolve_checkpoint

    path = Path(str(spec)).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    folder = path if path.is_dir() else resolve_checkpoint(spec)
    recorded = (read_marker(folder) or {}).get("gguf_path")
    if recorded and Path(recorded).is_file():
        return Path(recorded)
    where = (
        f"its folder {folder} records {recorded}, which is gone"
        if recorded
        else f"its folder {folder} was not converted from a GGUF"
    )
    raise ValueError(
        f"the llama.cpp peers need a GGUF file for the {role} {spec} ({where}); pass a .gguf file as "
        f"--{role}, run `make models` for the reference pair, or leave llamacpp-ar/llamacpp-spec out "
        f"of --strategies"
    )


def gguf_summary(path: Path) -> dict:
    """Training context and quantization of a GGUF file: the file type it declares (Q4_K_M), else the commonest
    type of its matrices. Read from the header directly (the gguf package's reader parses the whole 150k-token
    vocabulary into arrays first: a minute on a busy 2-core machine)."""
    import struct
    from collections import Counter

    import gguf

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    with open(path, "rb") as f:

        def read(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

        def string():
            return f.read(read("Q")).decode("utf-8", "replace")

        def value(kind):
            if kind == 8:
                return string()
            if kind == 9:
                item, n = read("I"), read("Q")
                if item in scalar:  # skip the numbers, keep nothing: no key read here is an array
                    f.seek(n * struct.calcsize(scalar[item]), 1)
                else:
                    for _ in range(n):
                        value(item)
                return None
            return read(scalar[kind])

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        read("I")
        n_tensors, n_kv = read("Q"), read("Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(read("I"))
        types: Counter[int] = Counter()  # ggml tensor type -> matrices of it
        for _ in range(n_tensors):
            string()
            dims = read("I")
            f.seek(8 * dims, 1)
            kind = read("I")
            read("Q")
            if dims >= 2:
                types[kind] += 1
    arch = meta.get("general.architecture")
    try:
        # absent: -1, no file type (ValueError), as an unknown one
        quant = gguf.LlamaFileType(meta.get("general.file_type", -1)).name.removeprefix("MOSTLY_")
    except ValueError:
        quant = gguf.GGMLQuantizationType(types.most_common(1)[0][0]).name if types else "gguf"
    return {"context_length": meta.get(f"{arch}.context_length"), "quantization": quant}


# -- one llama-server process -------------------------------------------------------------------------------
def _child_setup(cores):
    """Runs in the child before exec: pin it to `cores`, and have the kernel kill it when the thread that
    started it ends (PR_SET_PDEATHSIG; the runner starts servers from its main thread)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        prctl = None

    def setup():
        if cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)
        if prctl is not None:
            prctl(1, signal.SIGKILL)

    return setup


def ngram_args(setting: tuple[str, int, int]) -> list[str]:
    """llama-server's flags for an n-gram drafter (type, n, m): n tokens looked up, at most m drafted. ngram-mod
    drops a draft shorter than its n-min, here 3/4 of m (llama.cpp's default: 48 of 64)."""
    kind, n, m = setting
    if kind == "ngram-mod":
        return [
            "--spec-type",
            kind,
            "--spec-ngram-mod-n-match",
            str(n),
            "--spec-ngram-mod-n-max",
            str(m),
            "--spec-ngram-mod-n-min",
            str(max(1, 3 * m // 4)),
        ]
    flag = kind.removeprefix("ngram-")
    return ["--spec-type", kind, f"--spec-ngram-{flag}-size-n", str(n), f"--spec-ngram-{flag}-size-m", str(m)]


class LlamaServer:
    """llama-server on 127.0.0.1, one slot (`slots`: that many; None: llama-server's default), pinned to `cores`
    with `threads` threads; a context manager.

    `draft` adds llama.cpp's speculative decoding (draft-simple) with at most `draft_max` tokens per round,
    drafting stopping early below draft probability `p_min`; `ngram` (type, n, m) adds its n-gram drafting.
    """

    def __init__(
        self,
        binaries: Path,
        model: Path,
        threads: int,
        cores=None,
        context: int = 4096,
        draft: Path | None = None,
        draft_max: int | None = None,
        p_min: float | None = None,
        ngram: tuple[str, int, int] | None = None,
        start_timeout_s: float = 600,
        slots: int | None = 1,
    ):
        self.threads, self.cores = threads, tuple(sorted(cores)) if cores else None
        args = [
            str(Path(binaries) / "llama-server"),
            "-m",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "--no-webui",
        ]
        # the context is shared by the slots (its default: 4, one unified KV cache): room for `context` tokens each
        args += ["-c", str(context * (slots or 4))] + ([] if slots is None else ["-np", str(slots)])
        if draft is not None:
            args += ["-md", str(draft), "--spec-type", "draft-simple", "-td", str(threads), "-tbd", str(threads)]
            if draft_max is not None:
                args += ["--spec-draft-n-max", str(draft_max)]
            if p_min is not None:
                args += ["--spec-draft-p-min", str(p_min)]
        if ngram is not None:
            args += ngram_args(ngram)
        self.args = args
        self._log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=_child_setup(self.cores),
        )
        self.port: int | None = None
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = Path(self._log.name).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PeerError(
                    f"llama-server exited with status {self.proc.returncode} while starting "
                    f"({' '.join(self.args)}); its log ends with:\n{self.log_tail()}"
                )
            if self.port is None:
                found = re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.log_tail(10_000))
                self.port = int(found.group(1)) if found else None
            if self.port is not None:
                try:
                    status, _ = self._request("GET", "/health", None, timeout_s=5)
                    if status == 200:
                        return
                except OSError:
                    pass
            time.sleep(0.1)
        raise PeerError(
            f"llama-server did not get ready within {timeout_s:.0f} s; its log ends with:\n{self.log_tail()}"
        )

    def _request(self, method: str, path: str, body: dict | None, timeout_s: float) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        try:
            conn.request(
                method,
                path,
                body=None if body is None else json.dumps(body),
                headers={"Content-Type": "application/json"},
            )
            response = conn.getresponse()
            raw = response.read()
        finally:
            conn.close()
        try:
            return response.status, json.loads(raw or b"{}")
        except ValueError:
            return response.status, {"raw": raw[:500].decode(errors="replace")}

    def complete(self, prompt_ids: list[int], params: SamplingParams) -> tuple[dict, float]:
        """One /completion request; returns llama-server's answer and the wall time around it (seconds)."""
        if self.proc.poll() is not None:
            raise PeerError(
                f"llama-server has exited (status {self.proc.returncode}); its log ends with:\n{self.log_tail()}"
            )
        body = {
            "prompt": list(prompt_ids),
            "n_predict": params.max_new_tokens,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
            "n_probs": 0,
            "id_slot": 0,
        }
        if params.greedy:
            body.update(samplers=["top_k"], top_k=1)
        else:
            # paraspec's order: temperature, then top-k, then top-p (sampling.logits_to_probs)
            body.update(
                samplers=["temperature", "top_k", "top_p"],
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
            )
            if params.seed is not None:
                body["seed"] = params.seed
        start = time.perf_counter()
        try:
            status, answer = self._request("POST", "/completion", body, timeout_s=120 + 10 * params.max_new_tokens)
        except (OSError, http.client.HTTPException) as e:
            raise PeerError(f"llama-server did not answer ({e}); its log ends with:\n{self.log_tail()}") from None
        seconds = time.perf_counter() - start
        if status != 200:
            raise PeerError(f"llama-server answered {status}: {answer}")
        return answer, seconds

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and remove its log; safe to call twice."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        try:
            os.unlink(self._log.name)
        except OSError:
            pass


# -- the bench variants ------------------------------------------------------------------------------------
def result_from_answer(
    name: str, prompt_ids: list[int], params: SamplingParams, answer: dict, total_s: float, max_context: int
) -> GenerationResult:
    """A GenerationResult from llama-server's /completion answer, with the Engine's stats arithmetic.

    TTFT is the server's prompt time (prefill and the first token); the trace holds one prefill event of that
    length and one decode event of the server's generation time. For llamacpp-spec, every target forward after
    the prefill is a verification round yielding its accepted drafts plus one token, so
    rounds = new tokens - 1 - accepted.
    """
    tokens = list(answer.get("tokens") or [])[: params.max_new_tokens]
    timings = answer.get("timings") or {}
    prompt_s = timings.get("prompt_ms", 0.0) / 1000
    predicted_s = timings.get("predicted_ms", 0.0) / 1000
    trace = Trace()
    trace.add("target", "prefill", 0.0, prompt_s, len(prompt_ids))
    trace.add("target", "decode", prompt_s, prompt_s + predicted_s, max(len(tokens) - 1, 0))
    if tokens:
        trace.commit(1, prompt_s)
        trace.commit(len(tokens), total_s)
    run = RequestState(
        prompt_ids=list(prompt_ids),
        params=params,
        stop_ids=frozenset(),
        generator=make_generator(0),
        max_context=max_context,
        trace=trace,
    )
    run.tokens = tokens
    run.first_token_s = prompt_s if tokens else None
    run.finish_reason = {"eos": "stop", "word": "stop"}.get(answer.get("stop_type") or "", "length")
    if "draft_n" in timings or name in ("llamacpp-spec", "llamacpp-ngram"):
        run.drafted, run.accepted = int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))
        run.rounds = max(len(tokens) - 1 - run.accepted, 0)
        run.verified_tokens = max(len(tokens) - 1, 0)
    return GenerationResult(
        text=answer.get("content", ""),
        token_ids=tokens,
        stats=compute_stats(run, name, total_s),
        trace=trace,
        finish_reason=run.finish_reason,
        prompt_ids=list(prompt_ids),
    )


class LlamaCppPeer:
    """One of LLAMACPP_STRATEGIES at a thread count; `generate` mirrors Engine.generate, `close` stops its server.

    llamacpp-ar starts its server here; llamacpp-spec and llamacpp-ngram start one in `tune` (their grid's
    fastest setting) or, if never tuned, at their first request with the grid's first setting.
    """

    def __init__(
        self,
        name: str,
        target,
        draft=None,
        threads: int = 1,
        cores=None,
        max_context: int = 4096,
        spec_grid=DEFAULT_SPEC_GRID,
        binaries: Path | None = None,
        ngram_grid=DEFAULT_NGRAM_GRID,
    ):
        if name not in LLAMACPP_STRATEGIES:
            raise ValueError(f"unknown llama.cpp peer {name!r}; choose one of {', '.join(LLAMACPP_STRATEGIES)}")
        if name == "llamacpp-spec" and draft is None:
            raise ValueError("llamacpp-spec needs a draft model (--draft)")
        if name == "llamacpp-spec" and not spec_grid:
            raise ValueError("llamacpp-spec needs at least one draft-max:p-min setting")
        if name == "llamacpp-ngram" and not ngram_grid:
            raise ValueError("llamacpp-ngram needs at least one TYPE:N:M setting")
        self.name, self.threads, self.cores = name, threads, tuple(sorted(cores)) if cores else None
        self.target_gguf = gguf_file(target, "target")
        self.draft_gguf = gguf_file(draft, "draft") if name == "llamacpp-spec" else None
        summary = gguf_summary(self.target_gguf)
        self.max_context = min(max_context, summary["context_length"] or max_context)
        self.binaries = binaries or peer_binaries(build=True)
        # the settings `tune` chooses from: (draft max, p-min) for llamacpp-spec, (type, n, m) for llamacpp-ngram
        self.grid = (
            [(int(n), float(p)) for n, p in spec_grid]
            if name == "llamacpp-spec"
            else [(str(t), int(n), int(m)) for t, n, m in ngram_grid]
            if name == "llamacpp-ngram"
            else []
        )
        self.setting: tuple | None = self.grid[0] if self.grid else None
        self.settings = {
            "dtype": summary["quantization"],
            "program": f"llama-server ({peer_build_label(self.binaries)})",
            "target_gguf": str(self.target_gguf),
            "threads": threads,
            "cores": list(self.cores) if self.cores else "all",
        }
        if self.draft_gguf:
            self.settings["draft_gguf"] = str(self.draft_gguf)
        if self.setting is not None:
            self.settings.update(self._describe(self.setting))
        self.server: LlamaServer | None = None
        if self.setting is None:
            self.server = self._start(None)

    @property
    def devices(self) -> str:
        cores = "cpu" if not self.cores else "cpu:" + ",".join(map(str, self.cores))
        return f"{cores} (llama-server, {self.threads} thread{'s' if self.threads > 1 else ''})"

    def _describe(self, setting) -> dict:
        """A setting as the fields results.json and the report show."""
        if self.name == "llamacpp-spec":
            return {"draft_max": setting[0], "p_min": setting[1]}
        return {"spec_type": setting[0], "size_n": setting[1], "size_m": setting[2]}

    def _start(self, setting) -> LlamaServer:
        draft_max, p_min = setting if self.name == "llamacpp-spec" else (None, None)
        return LlamaServer(
            self.binaries,
            self.target_gguf,
            self.threads,
            self.cores,
            self.max_context,
            draft=self.draft_gguf,
            draft_max=draft_max,
            p_min=p_min,
            ngram=setting if self.name == "llamacpp-ngram" else None,
        )

    def generate(self, prompt_ids: list[int], params: SamplingParams, record_margins: bool = False) -> GenerationResult:
        """Generate with llama-server. `record_margins` is accepted for the runner; llama.cpp reports no logits,
        so the result has no margins."""
        if self.server is None:
            self.server = self._start(self.setting)
        answer, seconds = self.server.complete(prompt_ids, params)
        return result_from_answer(self.name, prompt_ids, params, answer, seconds, self.max_context)

    def tune(self, prompts: list[list[int]], params: SamplingParams, progress=None) -> None:
        """llamacpp-spec and llamacpp-ngram: time every setting of the grid on `prompts`, keep the fastest
        setting's server and record the grid (median ms/token, pooled acceptance) in `settings`. Nothing for
        llamacpp-ar."""
        if not self.grid or not prompts:
            return
        tune_params = SamplingParams(
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=params.seed,
            max_new_tokens=min(params.max_new_tokens, TUNE_TOKENS),
        )
        if self.server is not None:
            self.server.close()
            self.server = None
        grid: list[dict] = []
        best: tuple[tuple, LlamaServer] | None = None
        best_ms: float | None = None
        try:
            for setting in self.grid:
                server = self._start(setting)
                keep = False
                try:
                    results = []
                    for ids in prompts:
                        answer, seconds = server.complete(ids, tune_params)
                        results.append(
                            result_from_answer(self.name, ids, tune_params, answer, seconds, self.max_context)
                        )
                    ms = statistics.median(r.stats.ms_per_token for r in results)
                    drafted = sum(r.stats.drafted for r in results)
                    accepted = sum(r.stats.accepted for r in results)
                    grid.append(
                        {
                            **self._describe(setting),
                            "ms_per_token": ms,
                            "acceptance": accepted / drafted if drafted else None,
                            "new_tokens": sum(r.stats.new_tokens for r in results),
                        }
                    )
                    if progress is not None:
                        acc = "—" if not drafted else f"{accepted / drafted:.0%}"
                        progress(
                            f"{self.name}@{self.threads}t {setting_label(self._describe(setting))}: "
                            f"{ms:.1f} ms/token, acceptance {acc}"
                        )
                    if best_ms is None or ms < best_ms:
                        if best is not None:
                            best[1].close()
                        best, best_ms, keep = (setting, server), ms, True
                finally:
                    if not keep:
                        server.close()
        except BaseException:
            if best is not None:
                best[1].close()
            raise
        assert best is not None  # the grid has a setting (checked above), and each one was timed
        self.setting, self.server = best
        self.settings.update(
            **self._describe(self.setting),
            spec_grid=grid,
            tuned_on={"prompts": len(prompts), "max_new_tokens": tune_params.max_new_tokens},
        )

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


# the report's names of a setting's fields
SETTING_FIELDS = {"draft_max": "draft max", "p_min": "p-min", "spec_type": "type", "size_n": "n", "size_m": "m"}


def setting_label(fields: dict) -> str:
    """`draft max 8, p-min 0.5` / `type ngram-simple, n 4, m 16`."""
    return ", ".join(
        f"{SETTING_FIELDS[k]} {v:g}" if isinstance(v, float) else f"{SETTING_FIELDS[k]} {v}" for k, v in fields.items()
    )


def parse_ngram_grid(text: str) -> list[tuple[str, int, int]]:
    """`ngram-simple:4:16,ngram-mod:24:64` -> [("ngram-simple", 4, 16), ("ngram-mod", 24, 64)]: llamacpp-ngram's
    (spec type, lookup length n, draft length m) settings to try."""
    grid = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        kind, *numbers = item.split(":")
        try:
            n, m = (int(x) for x in numbers)
        except ValueError:
            raise ValueError(f"bad llamacpp-ngram setting {item!r}; write TYPE:N:M, e.g. ngram-simple:4:16") from None
        if kind not in NGRAM_TYPES or n < 1 or m < 1:
            raise ValueError(
                f"bad llamacpp-ngram setting {item!r}: the type is one of {', '.join(NGRAM_TYPES)}, "
                f"and n (tokens looked up) and m (most tokens drafted) are >= 1"
            )
        grid.append((kind, n, m))
    if not grid:
        raise ValueError("--llamacpp-ngram-grid is empty; pass e.g. ngram-simple:4:16")
    return grid


def parse_spec_grid(text: str) -> list[tuple[int, float]]:
    """`4:0,8:0.5` -> [(4, 0.0), (8, 0.5)]: llamacpp-spec's (draft max, p-min) settings to try."""
    grid = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        n, sep, p = item.partition(":")
        try:
            setting = (int(n), float(p) if sep else 0.0)
        except ValueError:
            raise ValueError(f"bad llamacpp-spec setting {item!r}; write DRAFT_MAX:P_MIN, e.g. 8:0.5") from None
        if setting[0] < 1 or not 0 <= setting[1] <= 1:
            raise ValueError(f"bad llamacpp-spec setting {item!r}: draft max must be >= 1 and p-min in [0, 1]")
        grid.append(setting)
    if not grid:
        raise ValueError("--llamacpp-spec-grid is empty; pass e.g. 4:0,8:0.5")
    return grid
