"""llama.cpp backend: a GGUF model on llama.cpp's quantized CPU kernels, behind the Model protocol.

Exactness is the point of this module. llama.cpp picks different kernels for different batch widths (weight
repacking's gemm vs gemv, llamafile's tinyBLAS for f16 attention products, the tiled K-quant matmul, flash
attention's KV split), so by default the logits of a token computed in a forward of w tokens differ from the
same token's logits computed one token at a time, by up to ~0.5 — enough to flip a greedy choice. A speculative
strategy on such a backend would not return `ar`'s tokens. So this backend:

1. runs a configuration made batch-invariant (docs/LLAMACPP.md, "The exact configuration"): llamafile's tinyBLAS off
   (paraspec's build compiles it in behind a per-context switch that only drafts turn on; a build that runs it in
   every context is refused) and paraspec's patches (`scripts/build_llamacpp.py wheel`) to the
   repacked Q4_K one-row kernel and, on AVX512-VNNI builds, to the one-row Q6_K and Q4_K kernels (so that they
   round like the tiled K-quant matmul llama.cpp uses from 8 rows on: `GGML_CPU_TILED_MM` is left on there, and set
   to 0 on other builds and CPUs, before the first matrix product), flash attention on where the build carries the
   patch that stops it splitting a one-token row's KV across threads (`flash_attention`; off in other builds:
   llama-server's default; shorter prefills: benchmarks/llamacpp_prefill.py, docs/LLAMACPP.md), and weight repacking
   (`use_extra_bufts`, llama.cpp's default and its fast kernels) **on where it is measured exact**, else off
   (`kernels`: "repacked" or "plain");
2. **measures** at load which forward widths are bitwise equal to one-token forwards on this CPU, build, kernels
   and thread count (`probe_exact_width`, in a child process where a native crash cannot take the caller down,
   cached per model file, build, kernels, CPU and threads) at a short and a long context: the repacked kernels
   are kept only if every width is exact, else the model is opened again with repacking off and measured again
   (an unpatched build, or a CPU whose repacked kernels the patch does not cover, is never run near-exact), and
3. splits every forward after the prompt into sub-forwards no wider than that width. Verification is
   compute-bound on CPUs, so a split costs little; with width 1 it would cost the speculation, and the probe's
   result is reported (`exact_width`) so that a user sees it.

The prompt's prefill is the same forwards in every strategy and whatever runs beside it -- chunks of PROMPT_CHUNK
tokens (`prompt_steps`: a Scheduler runs one chunk per step, between the other requests' steps), so its KV cache is
the same (with flash attention on, a last chunk of 64+ tokens leaves its last token to a forward of its own).
On the repacked kernels it runs on the model's own context. On the plain ones it does not have to be
batch-invariant, only the same everywhere, so all but its last token run on a second copy of the weights with
repacking on (`fast_prefill`, default; `PARASPEC_LLAMACPP_FAST_PREFILL=0` turns it off): llama.cpp's own
default for prompts, and faster than the plain kernels (TTFT in docs/LLAMACPP.md, "Fast prefill"). That KV cache
is copied into the exact context (`llama_state_seq_get/set_data`), which decodes the prompt's last
token and everything after it: no strategy rolls back into the prompt further than its last token, which it may
re-feed (dsi's servers do), so every position a strategy recomputes is computed with the exact kernels.
A draft model (`exact=False`) needs none of this: acceptance judges its tokens against the target's own logits,
so its numbers never reach the output. It runs llama.cpp's fastest configuration instead -- repacked weights,
tinyBLAS for the products of several rows (its Q5_0/Q8_0 matrices have no other fast prompt kernel on x86),
flash attention, no probe, forwards unsplit. Those kernels are not batch-invariant, so a seeded sampled request's
draft forwards run alone when requests are batched (its answer must repeat); others share them.
Tree attention is refused. llama.cpp takes a token tree through sequence ids, and it is exact for the one branch
whose KV cells are contiguous, but a branch laid out with other nodes between its cells gets other logits, and
so do the tokens decoded after it: the attention reductions run over cell indices
(`benchmarks/llamacpp_tree_exactness.py`; docs/LLAMACPP.md). Only one root-to-leaf path of a tree can be contiguous.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paraspec.models.base import SequenceChecks, check_batch, check_rollback, measure_batch_exact
from paraspec.models.cpu_features import cpu_flags
from paraspec.models.threads import lent_threads, own_threads

PROBE_WIDTH = 32  # widths 1..PROBE_WIDTH are checked; wider forwards are split
PROBE_CONTEXTS = (32, 600)  # short and long context (flash-attention-like splits appear past 512)
BATCH_PROBE_WIDTH = 4  # several sequences' verify-like steps in the batch probe: 1..4 tokens each
BATCH_PROBE_PROMPTS = (37, 5, 150, 90, 12, 64, 21, 120)  # the batch probe's context lengths, one per sequence
TILED_MIN_ROWS = 8  # llama.cpp's tiled K-quant matmul takes products of this many activation rows and more
FLASH_TILE_ROWS = 64  # llama.cpp's flash attention takes forwards of this many rows through its tiled pass
# a prompt's forwards (prompt_steps): on the prompt kernels, as fast alone as whole n_batch chunks where measured
# (docs/results/2026-11-29-zen4-prompt-chunks.md), and short enough that a Scheduler can put the other requests'
# steps between them instead of stalling them for a whole prompt
PROMPT_CHUNK = 64
# weight repacking on (llama.cpp's default kernels; exact with the patched build) or off (exact with any build
# without llamafile): LlamaCppModel's `kernels`, chosen by measurement unless asked for (PARASPEC_LLAMACPP_KERNELS)
KERNELS = ("repacked", "plain")
_lib: Any = None  # the llama_cpp module (its ctypes bindings), imported by _llama_cpp()


class LlamaCppUnavailable(ImportError):
    pass


def _llama_cpp():
    """Import llama_cpp once, with the batch-invariance switches that must be set before ggml initialises."""
    global _lib
    if _lib is None:
        try:
            import llama_cpp
        except ImportError as e:
            raise LlamaCppUnavailable(
                f"the llamacpp backend needs llama-cpp-python built for paraspec ({e}); run `make setup` or "
                f"`python scripts/build_llamacpp.py wheel --python {sys.executable}`, or use backend='native'"
            ) from None
        info = llama_cpp.llama_print_system_info().decode(errors="replace")
        # ggml reads GGML_CPU_TILED_MM at its first matrix product, once per process: decided here, before one
        tiled_exact = tiled_matmul_patched(llama_cpp, info)
        asked = os.environ.setdefault("GGML_CPU_TILED_MM", "1" if tiled_exact else "0")
        if asked != "0" and not tiled_exact:
            raise ValueError(
                f"GGML_CPU_TILED_MM={asked}: llama.cpp's tiled K-quant matmul (8 rows and more) is batch-invariant "
                f"only in paraspec's patched build on an AVX512-VNNI CPU, and this build or CPU is not one, so the "
                f"llamacpp backend would not be exact: unset it (paraspec then turns it off)"
            )
        if "LLAMAFILE = 1" in info and _llamafile_switch(llama_cpp) is None:
            raise LlamaCppUnavailable(
                "this llama-cpp-python was built with llamafile's tinyBLAS in every context, whose multi-token "
                "products differ from its one-token ones (not exact); rebuild it with `python "
                f"scripts/build_llamacpp.py wheel --force --python {sys.executable}` (paraspec's build runs tinyBLAS "
                "only in draft models' contexts)"
            )
        llama_cpp.llama_backend_init()
        global _log_callback
        _log_callback = llama_cpp.llama_log_callback(_log)  # kept referenced: C holds the pointer
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
        _lib = llama_cpp
    return _lib


_log_callback = None


def _llamafile_switch(llama_cpp):
    """paraspec's per-context switch for llamafile's tinyBLAS (scripts/patches/*gated-llamafile*), or None in a build
    without it."""
    fn = getattr(llama_cpp.llama_cpp._lib, "llama_paraspec_set_llamafile", None)
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_bool], ctypes.c_bool
    return fn


def tinyblas_available() -> bool:
    """Whether this build can run llamafile's tinyBLAS in a draft's context (compiled in, behind paraspec's switch)."""
    lib = _llama_cpp()
    return (
        "LLAMAFILE = 1" in lib.llama_print_system_info().decode(errors="replace") and _llamafile_switch(lib) is not None
    )


def _log(level, text, user_data):
    """llama.cpp's log is silent unless PARASPEC_LLAMACPP_LOG is set (1: errors, all: everything)."""
    wanted = os.environ.get("PARASPEC_LLAMACPP_LOG")
    if wanted == "all" or (wanted and level == 4):  # 4 = GGML_LOG_LEVEL_ERROR
        sys.stderr.write(text.decode(errors="replace"))


def tiled_matmul_patched(llama_cpp, system_info: str) -> bool:
    """Whether llama.cpp's tiled K-quant matmul rounds like its one-row kernels in this build on this CPU:
    paraspec's patch (scripts/patches/*tiled-kquants*, which marks the package) covers the tiled kernel of AVX512-VNNI
    builds. Elsewhere the tiled matmul is turned off (GGML_CPU_TILED_MM=0); either way the load-time probe judges."""
    return bool(getattr(llama_cpp, "__paraspec_tiled_kquants__", False)) and "AVX512_VNNI = 1" in system_info


def tiled_matmul() -> bool:
    """Whether the tiled K-quant matmul is on in this process (see _llama_cpp)."""
    _llama_cpp()
    return os.environ.get("GGML_CPU_TILED_MM", "0") != "0"


def flash_attention() -> bool:
    """Whether paraspec's llama.cpp contexts run flash attention: in a build patched so that a token's attention does
    not depend on the thread count or on the width of its forward (scripts/patches/*flash-attn*, which marks the
    package), unless PARASPEC_LLAMACPP_FLASH_ATTN=0. Unpatched, a one-token row over 512+ KV cells is split across
    threads: off. Either way the load-time probe judges the result."""
    lib = _llama_cpp()
    patched = bool(getattr(lib, "__paraspec_flash_attn__", False))
    asked = os.environ.get("PARASPEC_LLAMACPP_FLASH_ATTN", "auto")
    if asked not in ("auto", "0", "1"):
        raise ValueError(f"PARASPEC_LLAMACPP_FLASH_ATTN={asked!r}: use auto, 0 or 1")
    if asked == "1" and not patched:
        raise ValueError(
            "PARASPEC_LLAMACPP_FLASH_ATTN=1: this llama-cpp-python lacks paraspec's flash-attention patch "
            "(its one-token rows depend on the thread count: not exact); rebuild it with `python "
            f"scripts/build_llamacpp.py wheel --python {sys.executable}`, or unset the variable"
        )
    return patched if asked == "auto" else asked == "1"


def build_fingerprint(kernels: str, flash: bool, kv_f32: bool) -> str:
    """What the numerics depend on besides the model: library build, its switches, the CPU."""
    return "\n".join(
        [
            _library_fingerprint(),
            f"repack={int(kernels == 'repacked')} flash={int(flash)} tiled={int(tiled_matmul())}"
            + (" kv=f32" if kv_f32 else ""),
        ]
    )


@functools.lru_cache(maxsize=1)
def _library_fingerprint() -> str:
    lib = _llama_cpp()
    cpu = " ".join(sorted(cpu_flags()))
    lib_dir = Path(lib.__file__).parent / "lib"
    # by content, not mtime: a fresh venv with the same cached build reuses the measurement
    libs = sorted(f"{p.name}:{hashlib.sha256(p.read_bytes()).hexdigest()}" for p in lib_dir.glob("*.so*"))
    return "\n".join([lib.__version__, lib.llama_print_system_info().decode(errors="replace"), cpu, *libs])


def _kernels_asked(kernels: str | None) -> str:
    asked = kernels or os.environ.get("PARASPEC_LLAMACPP_KERNELS") or "auto"
    if asked not in ("auto", *KERNELS):
        raise ValueError(f"llama.cpp kernels {asked!r}: use one of auto, {', '.join(KERNELS)}")
    return asked


class LlamaCppModel(SequenceChecks):
    """One llama.cpp context over one GGUF model, KV cache = llama.cpp's memory; the Model protocol runs on
    sequence 0. With n_seqs > 1 the context holds that many sequences, each with a KV cache of its own (not
    llama.cpp's unified cache: attention over another sequence's cells would change a row's summation), each
    max_context long: `sequence(i)` is the Model protocol on sequence i, and `forward_batch` decodes tokens of
    several sequences in one llama_decode (requests batched by scheduler.py)."""

    splits_prompts = True  # a forward into an empty cache: its prompt's forwards, then the rest (forward())

    def __init__(
        self,
        path: Path,
        max_context: int,
        eos_token_ids: tuple[int, ...],
        n_threads: int | None = None,
        probe: bool = True,
        kv_f32: bool = False,
        fast_prefill: bool | None = None,
        kernels: str | None = None,
        n_seqs: int = 1,
        exact: bool = True,
    ):
        """n_threads None: follow torch's thread count (set by the Engine or worker to the device group's cores,
        and by the benchmark per variant), checked at every prefill; an int fixes it. kv_f32: keep K/V in f32
        instead of llama.cpp's f16 (twice the cache memory; the tests use it to compare with fp32 references;
        flash attention is off then: it would cast them to f16).
        fast_prefill: prompts on repacked weights when the model's own kernels are the plain ones (None: on unless
        PARASPEC_LLAMACPP_FAST_PREFILL=0). kernels: "repacked" or "plain" (weight repacking on or off), or None:
        PARASPEC_LLAMACPP_KERNELS, else "auto" = repacked if the probe finds every width exact, else plain
        (plain without a probe). n_seqs: the sequences the context holds (the probe then also checks that a row's
        logits are the same alone and beside other sequences' rows: `batch_exact`).
        exact=False: a draft model's configuration (its numbers never reach the output: acceptance judges its tokens
        against the target's): llama.cpp's fastest kernels for every shape -- weight repacking, llamafile's tinyBLAS
        where the build gates it per context (`tinyblas`), flash attention -- with no probe, forwards never split and
        prompts in whole chunks; `batch_exact` stays False (a row depends on the rows beside it), so the Scheduler
        shares its forwards only between requests that do not promise to repeat (scheduler.Member.repeatable). The
        target keeps the exact configuration."""
        if not isinstance(n_seqs, int) or n_seqs < 1:
            raise ValueError(f"n_seqs must be a positive integer, got {n_seqs!r}")
        _llama_cpp()
        self.exact = exact
        self.tiled_matmul = tiled_matmul()  # llama.cpp's tiled K-quant matmul on (patched VNNI builds)
        # llama.cpp's flash attention on (patched builds; llama.cpp's own default for a draft), but not for f32 K/V:
        # flash attention casts them to f16
        self.flash_attention = (flash_attention() or not exact) and not kv_f32
        self.tinyblas = False  # llamafile's tinyBLAS runs this context's products (exact=False)
        self._follow_torch = n_threads is None
        self.n_threads = n_threads or torch.get_num_threads()
        self.path = Path(path)
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self._asked: dict[str, Any] = {
            "max_context": max_context,
            "kv_f32": kv_f32,
            "kernels": _kernels_asked(kernels) if exact else "repacked",
            "fast_prefill": exact
            and (
                os.environ.get("PARASPEC_LLAMACPP_FAST_PREFILL", "1") != "0" if fast_prefill is None else fast_prefill
            ),
        }
        self._model: Any = None  # llama.cpp's model and context pointers (ctypes)
        self._ctx: Any = None
        self._fast: _FastPrefill | None = None
        self.fast_prefills = 0  # prompts decoded on the repacked copy (tests, reports)
        self.n_seqs = n_seqs
        self._lengths = [0] * n_seqs
        self.exact_width = PROBE_WIDTH
        self.batch_exact = n_seqs == 1  # several sequences in one forward: as alone (the probe's verdict)
        self.min_shared_width = 1  # the narrowest ask that shares a forward (the Scheduler reads it)
        self.forward_widths: dict[int, int] = {}  # sub-forward width -> count (what the split really ran)
        self._probe = probe and exact
        try:
            asked = self._asked["kernels"]
            self._open("plain" if asked == "plain" or (asked == "auto" and not self._probe) else "repacked")
            if self._probe:
                self._measure()
            elif not exact:
                self.exact_width = self.n_batch  # no width is exact, none needs to be: forwards whole
        except BaseException:
            self.close()
            raise

    def _open(self, kernels: str) -> None:
        """Load the model with repacking on or off, and its context (and the fast-prefill copy for plain)."""
        lib = _lib
        mparams = lib.llama_model_default_params()
        mparams.use_extra_bufts = kernels == "repacked"  # gemm for 4-row groups, (patched) gemv for the rest
        mparams.n_gpu_layers = 0
        model = lib.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not model:
            raise ValueError(
                f"llama.cpp could not load {self.path} (architecture {_architecture(self.path)!r}): "
                f"the file is corrupt or truncated, or its architecture is not one this llama.cpp "
                f"knows (PARASPEC_LLAMACPP_LOG=1 shows llama.cpp's reason); re-download the file, or "
                f"convert the model for backend='native'"
            )
        self._model = model
        self.kernels = kernels
        train_ctx = lib.llama_model_n_ctx_train(model)
        max_context = self._asked["max_context"]
        self.max_context = min(max_context, train_ctx) if train_ctx > 0 else max_context
        self.n_batch = min(512, self.max_context)
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = self.max_context * self.n_seqs  # split evenly between the sequences' own caches
        cparams.n_batch = cparams.n_ubatch = self.n_batch
        cparams.n_seq_max = self.n_seqs
        cparams.kv_unified = self.n_seqs == 1
        cparams.n_threads = cparams.n_threads_batch = self.n_threads
        # on in a patched build (no KV split across threads, see flash_attention); 1/0 = enabled/disabled
        cparams.flash_attn_type = 1 if self.flash_attention else 0
        cparams.no_perf = True
        if self._asked["kv_f32"]:
            cparams.type_k = cparams.type_v = 0  # GGML_TYPE_F32
        ctx = lib.llama_init_from_model(model, cparams)
        if not ctx:
            raise ValueError(
                f"llama.cpp could not create a context of {self.max_context} tokens for {self.path}; lower max_context"
            )
        self._ctx = ctx
        if not self.exact and tinyblas_available():
            self.tinyblas = bool(_llamafile_switch(lib)(ctx, True))
        self._mem = lib.llama_get_memory(ctx)
        self._batch = lib.llama_batch_init(self.n_batch, 0, 1)
        self.vocab_size = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        # the repacked kernels already are llama.cpp's prompt kernels: no second copy then
        self._fast = _FastPrefill(self.path, cparams) if self._asked["fast_prefill"] and kernels == "plain" else None
        self._lengths = [0] * self.n_seqs

    def _measure(self) -> None:
        """Probe the kernels in use; in auto, repacked kernels found inexact give way to plain ones."""
        prompts = self.fast_prefills  # the probe's prompts are not the user's
        # with the tiled matmul on, a model holding K-quants the patch does not cover is inexact from 8 rows on
        # whatever the repacking (every K-quant that is not repacked goes tiled): plain kernels could do no better
        floor = TILED_MIN_ROWS - 1 if self.tiled_matmul else PROBE_WIDTH
        width, self.batch_exact = probe_exact_width(self)
        if width < floor and self.kernels == "repacked" and self._asked["kernels"] == "auto":
            print(
                f"paraspec: llama.cpp's repacked kernels are not batch-invariant for {self.path.name} here (forwards "
                f"wider than {width} token(s) differ: an unpatched build, or a CPU the patch does not cover); "
                f"using weight repacking off",
                file=sys.stderr,
                flush=True,
            )
            self.close()
            self._open("plain")
            width, self.batch_exact = probe_exact_width(self)
        if width < PROBE_WIDTH:
            print(
                f"paraspec: llama.cpp forwards wider than {width} token(s) are not bitwise equal to one-token "
                f"forwards for {self.path.name} here ({self.kernels} kernels, tiled matmul "
                f"{'on' if self.tiled_matmul else 'off'}); verification is split into sub-forwards of <= {width}"
                + ("; GGML_CPU_TILED_MM=0 may make every width exact" if self.tiled_matmul else ""),
                file=sys.stderr,
                flush=True,
            )
        if self.n_seqs > 1 and not self.batch_exact:
            print(
                f"paraspec: llama.cpp's rows of several sequences in one forward differ from the same rows alone for "
                f"{self.path.name} here ({self.kernels} kernels); requests are decoded one sequence per forward",
                file=sys.stderr,
                flush=True,
            )
        self.exact_width = width
        self.fast_prefills = prompts

    def _set_threads(self, n: int) -> None:
        """A new thread count between requests; batch invariance is measured (or read) again for it."""
        if n != self.n_threads:
            self._thread_count(n)
            self.n_threads = n
            if self._probe:
                self._measure()

    # -- the Model protocol --------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self._lengths[0]

    def sequence(self, sequence_id: int) -> LlamaCppSequence:
        """The Model protocol on sequence `sequence_id` (0 <= sequence_id < n_seqs) of this context."""
        if not 0 <= sequence_id < self.n_seqs:
            raise ValueError(f"sequence {sequence_id} is outside this context's {self.n_seqs} sequence(s)")
        return LlamaCppSequence(self, sequence_id)

    def rollback(self, length: int, sequence_id: int = 0) -> None:
        check_rollback(length, self._lengths[sequence_id])
        if length < self._lengths[sequence_id]:
            if not _lib.llama_memory_seq_rm(self._mem, sequence_id, length, -1):
                raise RuntimeError("llama.cpp refused to remove the tail of the KV cache")
            self._lengths[sequence_id] = length

    def prefill(self, token_ids: list[int], sequence_id: int = 0) -> torch.Tensor:
        """The prompt into the emptied cache, exactly as every strategy runs it: its prompt_steps, one after another."""
        steps = self.prompt_steps(token_ids, sequence_id)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value[-1]

    def prompt_steps(self, token_ids: list[int], sequence_id: int = 0) -> Generator[None, None, torch.Tensor]:
        """The prompt's forwards into the emptied cache, one per next() (a Scheduler runs one per step); returns the
        logits [1, vocab] of its last token. The same forwards alone and batched, so the same KV cache.

        Strategies re-feed a prompt's last token (dsi's servers roll back to it to get the first chunk's row), so
        its KV and logits must be what a one-token forward gives. Where the prompt's kernels differ from one-token
        ones -- the repacked copy of the fast prefill, or flash attention's tiled pass for a last chunk of 64+
        tokens -- all but the last token go first and the last one alone, here."""
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        if self._follow_torch:
            self._set_threads(own_threads())  # a loan of cores (lend_cores) is for the prompt's forwards only
        self._clear(sequence_id)
        self._check_room(len(token_ids), sequence_id)
        steps = self._prompt_forwards(token_ids, sequence_id)
        return (yield from (self._on_lent_threads(steps) if self._follow_torch else steps))

    def _on_lent_threads(self, steps: Generator[None, None, torch.Tensor]) -> Generator[None, None, torch.Tensor]:
        """Each of a prompt's forwards on the threads lent to the thread that runs it (models/threads.py), if any;
        every other forward on the model's own count (a Scheduler's between two prompt steps), which its exactness
        probe measured. A prompt's forwards need not be batch-invariant, only the same everywhere, and their numbers
        do not depend on the thread count (each output row, and with paraspec's flash-attention patch each row's
        attention, is reduced by one thread: tests/models/test_llamacpp.py compares them)."""
        while True:
            lent = lent_threads() or self.n_threads
            switch = lent != self.n_threads
            if switch:
                self._thread_count(lent)
            try:
                next(steps)
            except StopIteration as done:
                return done.value
            finally:
                if switch:
                    self._thread_count(self.n_threads)
            yield

    def _thread_count(self, n: int) -> None:
        _lib.llama_set_n_threads(self._ctx, n, n)
        if self._fast is not None:
            _lib.llama_set_n_threads(self._fast.ctx, n, n)

    def _clear(self, sequence_id: int) -> None:
        if self.n_seqs == 1:
            _lib.llama_memory_clear(self._mem, True)
        elif not _lib.llama_memory_seq_rm(self._mem, sequence_id, -1, -1):
            raise RuntimeError(f"llama.cpp refused to clear sequence {sequence_id} of the KV cache")
        self._lengths[sequence_id] = 0

    def _prompt_forwards(self, token_ids: list[int], sequence_id: int) -> Generator[None, None, torch.Tensor]:
        head, chunk = token_ids[:-1], (len(token_ids) - 1) % PROMPT_CHUNK + 1
        if not self.exact:  # a draft: whole n_batch chunks (64-token ones cost it 8-18% more: measured)
            return (yield from self._chunks(token_ids, sequence_id, outputs=1, width=self.n_batch))
        if head and self._fast is not None:  # one step: the head on the repacked copy, copied in
            self._fast.prefill(head, PROMPT_CHUNK, into=self, sequence_id=sequence_id)
            self._lengths[sequence_id] = len(head)
            self.fast_prefills += 1
        elif head and self.flash_attention and chunk >= FLASH_TILE_ROWS:
            yield from self._chunks(head, sequence_id, outputs=0)
        else:
            return (yield from self._chunks(token_ids, sequence_id, outputs=1))
        yield
        return self._decode(token_ids[-1:], outputs=1, sequence_id=sequence_id)

    def _chunks(
        self, token_ids: list[int], sequence_id: int, outputs: int, width: int = PROMPT_CHUNK
    ) -> Generator[None, None, torch.Tensor]:
        """token_ids in forwards of `width` tokens, a yield between two; the last one's logits for its last `outputs`
        tokens."""
        for start in range(0, len(token_ids), width):
            if start:
                yield
            chunk = token_ids[start : start + width]
            out = self._decode(
                chunk, outputs=outputs if start + len(chunk) == len(token_ids) else 0, sequence_id=sequence_id
            )
        return out

    def forward_batch(self, items: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
        """One llama_decode of several sequences' next tokens: items are (sequence_id, token_ids, outputs), each
        sequence at most once, its tokens at most exact_width, all of them at most n_batch; returns each item's logits
        [outputs, vocab] for its last `outputs` tokens. Each row is what the sequence alone would get only where
        `batch_exact` (the probe's verdict); the caller (strategies/batched.py) decodes alone otherwise."""
        check_batch(self, items)
        # in increasing sequence order: llama.cpp puts sequences in one micro-batch only while their ids follow
        # each other (s, s + 1, ...; its per-sequence caches are viewed as one range), else one micro-batch each
        order = sorted(range(len(items)), key=lambda i: items[i][0])
        _llama_decode_many(
            self._ctx, self._batch, [(items[i][0], items[i][1], self._lengths[items[i][0]], items[i][2]) for i in order]
        )
        rows = np.ctypeslib.as_array(
            _lib.llama_get_logits(self._ctx), shape=(sum(o for _, _, o in items), self.vocab_size)
        )
        out, at = {}, 0
        for i in order:
            sequence_id, tokens, outputs = items[i]
            self._lengths[sequence_id] += len(tokens)
            out[i] = torch.from_numpy(rows[at : at + outputs].copy())
            at += outputs
        return [out[i] for i in range(len(items))]

    def step_forwards(self, widths: list[int]) -> list[int]:
        """The micro-batches (their rows) llama.cpp runs one forward_batch of these per-sequence widths as: with a
        cache per sequence it takes the same number of tokens from each sequence into a micro-batch (at most n_batch
        in all), so sequences of unequal widths cost several forwards ([1, 1, 1, 6] runs as 4 rows, then 5). Assumes
        consecutive sequence ids (the Scheduler keeps them so)."""
        out, left = [], sorted(w for w in widths if w > 0)
        while left:
            take = min(left[0], max(1, self.n_batch // len(left)))
            out.append(take * len(left))
            left = [w - take for w in left if w > take]
        return out

    def move_sequence(self, src: int, dst: int) -> None:
        """Sequence `src`'s cache becomes sequence `dst`'s (whose own is dropped) and `src` is empty: a byte copy of
        its cache, cells in the same places, so its next rows are bitwise what they would have been. The Scheduler
        keeps the running sequences 0, 1, 2, ... (one micro-batch) with it when a request leaves a gap."""
        if not (0 <= src < self.n_seqs and 0 <= dst < self.n_seqs) or src == dst:
            raise ValueError(f"move_sequence({src}, {dst}): two different sequences of {self.n_seqs}")
        self._clear(dst)
        _lib.llama_memory_seq_cp(self._mem, src, dst, -1, -1)  # copied at the next llama_decode, before it runs
        if not _lib.llama_memory_seq_rm(self._mem, src, -1, -1):
            raise RuntimeError(f"llama.cpp refused to clear sequence {src} after copying it")
        self._lengths[dst], self._lengths[src] = self._lengths[src], 0

    def forward(
        self,
        token_ids: list[int],
        positions: list[int] | None = None,
        tree_mask: torch.Tensor | None = None,
        last_n: int | None = None,
        sequence_id: int = 0,
    ) -> torch.Tensor:
        if tree_mask is not None:
            raise ValueError(
                "token trees are not exact on the llamacpp backend (a verified branch would sit in "
                "non-contiguous KV cells); use strategy sd/amusd/dsi, or backend='native' for tree "
                "and easyspec"
            )
        n = len(token_ids)
        if n == 0:
            raise ValueError("forward needs at least one token")
        length = self._lengths[sequence_id]
        if positions is not None and list(positions) != list(range(length, length + n)):
            raise ValueError("the llamacpp backend takes consecutive positions only; use backend='native'")
        self._check_room(n, sequence_id)
        self._check_vocabulary(token_ids)
        want = n if last_n is None else min(last_n, n)
        pieces, first = [], 0
        if length == 0 and n - want + 1 > 1:
            # into an empty cache: the tokens up to the first wanted row are a prompt, decoded in PROMPT_CHUNK chunks
            # exactly as prefill() decodes one (same chunks, same output row), so every strategy's prompt KV and
            # first logits are ar's, without paying exact-width pieces for hundreds of prompt tokens
            pieces.append(self.prefill(token_ids[: n - want + 1], sequence_id)[None])
            first = n - want + 1
        for start in range(first, n, self.exact_width):
            chunk = token_ids[start : start + self.exact_width]
            self.forward_widths[len(chunk)] = self.forward_widths.get(len(chunk), 0) + 1
            keep = max(0, len(chunk) - max(0, (n - want) - start))
            pieces.append(self._decode(chunk, outputs=keep, sequence_id=sequence_id))
        pieces = [p for p in pieces if len(p)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # one piece (every decode step): no copy

    def keep_path(self, prefix_len: int, slots: list[int], sequence_id: int = 0) -> None:
        raise ValueError("token trees are not supported by the llamacpp backend; use backend='native'")

    # -- internals -----------------------------------------------------------------------------------------
    def _decode(self, token_ids: list[int], outputs: int, sequence_id: int = 0) -> torch.Tensor:
        """One llama_decode of consecutive tokens; logits [outputs, vocab] for the last `outputs` of them."""
        _llama_decode_many(self._ctx, self._batch, [(sequence_id, token_ids, self._lengths[sequence_id], outputs)])
        self._lengths[sequence_id] += len(token_ids)
        if outputs == 0:
            return torch.empty(0, self.vocab_size)
        ptr = _lib.llama_get_logits(self._ctx)
        rows = np.ctypeslib.as_array(ptr, shape=(outputs, self.vocab_size))
        return torch.from_numpy(rows.copy())

    def close(self) -> None:
        fast = getattr(self, "_fast", None)  # close() also runs for an __init__ that raised early
        if fast is not None:
            fast.close()
            self._fast = None
        if getattr(self, "_ctx", None):
            _lib.llama_batch_free(self._batch)
            _lib.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            _lib.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _llama_decode_many(ctx, batch, items: list[tuple[int, list[int], int, int]]) -> None:
    """One llama_decode of (sequence_id, consecutive tokens, first position, outputs) items: each sequence's tokens from
    its position, with logits for its last `outputs` tokens (in item order)."""
    n = 0
    for sequence_id, token_ids, position, outputs in items:
        for i, tok in enumerate(token_ids):
            batch.token[n] = tok
            batch.pos[n] = position + i
            batch.n_seq_id[n] = 1
            batch.seq_id[n][0] = sequence_id
            batch.logits[n] = i >= len(token_ids) - outputs
            n += 1
    batch.n_tokens = n
    code = _lib.llama_decode(ctx, batch)
    if code != 0:
        where = ", ".join(f"sequence {sequence_id} at {position}" for sequence_id, _, position, _ in items)
        raise RuntimeError(f"llama_decode failed (code {code}) with {n} tokens ({where})")


class LlamaCppSequence:
    """The Model protocol on one sequence of a LlamaCppModel with several (LlamaCppModel.sequence)."""

    def __init__(self, model: LlamaCppModel, sequence_id: int):
        self.model, self.sequence_id = model, sequence_id
        self.vocab_size, self.max_context, self.eos_token_ids = model.vocab_size, model.max_context, model.eos_token_ids
        self.splits_prompts = model.splits_prompts

    @property
    def length(self) -> int:
        return self.model.length_of(self.sequence_id)

    def rollback(self, length: int) -> None:
        self.model.rollback(length, self.sequence_id)

    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        return self.model.prefill(token_ids, self.sequence_id)

    def forward(self, token_ids: list[int], positions=None, tree_mask=None, last_n: int | None = None) -> torch.Tensor:
        return self.model.forward(token_ids, positions, tree_mask, last_n, sequence_id=self.sequence_id)

    def keep_path(self, prefix_len: int, slots: list[int]) -> None:
        self.model.keep_path(prefix_len, slots)


class _FastPrefill:
    """A second model and context on the same GGUF file with weight repacking on (llama.cpp's default kernels for
    prompts), used only to decode prompts into an empty cache; its KV cache is then copied into the exact context.
    Same context parameters, so the same KV types and layout (llama.cpp cannot copy a sequence between a unified
    and a per-sequence cache: with several sequences this context has as many, of which it uses the first)."""

    def __init__(self, path: Path, cparams):
        mparams = _lib.llama_model_default_params()
        mparams.use_extra_bufts = True
        mparams.n_gpu_layers = 0
        self.model = _lib.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise ValueError(
                f"llama.cpp could not load {path} a second time for the fast prefill; set "
                f"PARASPEC_LLAMACPP_FAST_PREFILL=0 to decode prompts on the exact context alone"
            )
        self.ctx = _lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            _lib.llama_model_free(self.model)
            self.model = None
            raise ValueError(
                f"llama.cpp could not create the fast-prefill context for {path}; lower max_context or "
                f"set PARASPEC_LLAMACPP_FAST_PREFILL=0"
            )
        self.mem = _lib.llama_get_memory(self.ctx)
        self.batch = _lib.llama_batch_init(cparams.n_batch, 0, 1)

    def prefill(self, token_ids: list[int], n_batch: int, into: LlamaCppModel, sequence_id: int = 0) -> None:
        """Decode `token_ids` from position 0 here and copy the sequence's KV into sequence `sequence_id` of `into`
        (whose cache for it it replaces)."""
        _lib.llama_memory_clear(self.mem, True)
        for start in range(0, len(token_ids), n_batch):
            _llama_decode_many(self.ctx, self.batch, [(0, token_ids[start : start + n_batch], start, 0)])
        size = _lib.llama_state_seq_get_size(self.ctx, 0)
        state = (ctypes.c_uint8 * size)()
        written = _lib.llama_state_seq_get_data(self.ctx, state, size, 0)
        into._clear(sequence_id)
        if written == 0 or _lib.llama_state_seq_set_data(into._ctx, state, written, sequence_id) != written:
            raise RuntimeError(
                "llama.cpp could not copy the prompt's KV cache from the fast-prefill context; set "
                "PARASPEC_LLAMACPP_FAST_PREFILL=0"
            )
        _lib.llama_memory_clear(self.mem, True)  # its cache is not used again until the next prompt

    def close(self) -> None:
        if self.ctx:
            _lib.llama_batch_free(self.batch)
            _lib.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            _lib.llama_model_free(self.model)
            self.model = None


def _architecture(path: Path) -> str:
    try:
        from paraspec.models.gguf import read_gguf

        return str(read_gguf(path).architecture)
    except Exception:
        return "unreadable"


# -- batch invariance, measured ---------------------------------------------------------------------------
def _probe_cache(model: LlamaCppModel) -> Path:
    from paraspec.models.cache import cache_dir, sha256_prefix

    key = hashlib.sha256(
        "\n".join(
            [
                build_fingerprint(model.kernels, model.flash_attention, model._asked["kv_f32"]),
                sha256_prefix(model.path),
                str(model.n_threads),
                str(PROBE_WIDTH),
                str(PROBE_CONTEXTS),
                str(model.max_context),
            ]
            + ([f"seqs={model.n_seqs}"] if model.n_seqs > 1 else [])
        ).encode()
    )
    return cache_dir() / "llamacpp" / "exactness" / f"{key.hexdigest()[:24]}.json"


def measure_exact_width(
    model: LlamaCppModel, widths: int = PROBE_WIDTH, contexts: tuple[int, ...] = PROBE_CONTEXTS
) -> tuple[int, list[dict]]:
    """The largest W such that for every w <= W, at every context length P, one forward of w tokens gives
    logits bitwise equal to the same tokens decoded one at a time (llama.cpp's own `ar`)."""
    rng = np.random.default_rng(0)
    exact = widths
    rows = []
    for p in contexts:
        p = min(p, model.max_context - widths - 1)
        if p < 1:
            continue
        ids = rng.integers(0, model.vocab_size, size=p + widths).tolist()
        model.prefill(ids[:p])
        reference = torch.cat([model._decode([t], outputs=1) for t in ids[p:]])
        for w in range(2, widths + 1):
            model.rollback(p)
            got = model._decode(ids[p : p + w], outputs=w)
            diff = float((got - reference[:w]).abs().max())
            rows.append({"context": p, "width": w, "max_abs_diff": diff})
            if diff != 0.0:
                exact = min(exact, w - 1)
        model.rollback(0)
    _lib.llama_memory_clear(model._mem, True)
    model._lengths[0] = 0
    return exact, rows


def probe_batch(model: LlamaCppModel, width: int) -> list[dict]:
    """measure_batch_exact (models/base.py) on a llama.cpp context of several sequences: verify-like steps of
    1..BATCH_PROBE_WIDTH tokens each, one-token steps among them (the Scheduler shares asks of 1..exact_width tokens
    here: min_shared_width 1)."""
    return measure_batch_exact(model, min(width, BATCH_PROBE_WIDTH), BATCH_PROBE_PROMPTS, shortest=1)


def run_probe(model: LlamaCppModel) -> tuple[int, list[dict]]:
    """measure_exact_width (and, with several sequences, probe_batch: its rows carry "sequences") for
    `model`'s file, kernels, threads and context, in a child process (models/llamacpp/child_tasks.py `probe`): the first
    probe of a build on a CPU is the first time its kernels run there, and a kernel that kills its process (SIGILL)
    must not kill the caller. The child loads its own copy of the model."""
    from paraspec.models.llamacpp.child import run_child

    spec = {
        "path": str(model.path),
        "max_context": model._asked["max_context"],
        "n_threads": model.n_threads,
        "kv_f32": model._asked["kv_f32"],
        "kernels": model.kernels,
        "n_seqs": model.n_seqs,
    }
    answer = run_child(
        ["probe", json.dumps(spec)],
        f"llama.cpp's exactness probe of {model.path.name} ({model.kernels} kernels, {model.n_threads} thread(s))",
    )
    return int(answer["exact_width"]), answer["rows"]


def probe_exact_width(model: LlamaCppModel) -> tuple[int, bool]:
    """The probe's verdict (exact width, whether several sequences' rows batch exactly), measured once per (build,
    kernels, tiled matmul, CPU, model file, threads, context size, sequences) in a child process (run_probe) and
    cached."""
    path = _probe_cache(model)
    if path.exists():
        try:
            record = json.loads(path.read_text())
            return int(record["exact_width"]), bool(record["batch_exact"])
        except (ValueError, KeyError, OSError):
            pass
    big = model.path.stat().st_size > 50 << 20
    if big:
        print(
            f"paraspec: checking llama.cpp batch invariance for {model.path.name} at {model.n_threads} "
            f"thread(s), {model.kernels} kernels (once, in a child process; cached)",
            file=sys.stderr,
            flush=True,
        )
    start = time.perf_counter()
    width, rows = run_probe(model)
    batch_exact = model.n_seqs == 1 or all(r["max_abs_diff"] == 0.0 for r in rows if "sequences" in r)
    record = {
        "exact_width": width,
        "batch_exact": batch_exact,
        "kernels": model.kernels,
        "tiled_matmul": tiled_matmul(),
        "model": str(model.path),
        "threads": model.n_threads,
        "seconds": round(time.perf_counter() - start, 2),
        "rows": rows,
    }
    from paraspec.models.cache import write_json

    write_json(path, record)
    return width, batch_exact


def load_llamacpp(
    gguf_path: Path,
    folder: Path | None,
    max_context: int | None = None,
    device: str = "cpu",
    n_seqs: int = 1,
    draft: bool = False,
) -> LlamaCppModel:
    """A LlamaCppModel with torch's thread count: the Engine (or a worker) has set it to its device group's cores
    and pinned the process there before loading. A draft runs llama.cpp's fastest configuration (exact=False)."""
    from paraspec.models.base import generation_eos_ids

    if str(device) != "cpu" and not str(device).startswith("cpu"):
        raise ValueError(
            f"the llamacpp backend runs on CPU cores only, got device {device!r}; use backend='native' for {device}"
        )
    gguf_path = Path(gguf_path)
    if not gguf_path.exists():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    with open(gguf_path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{gguf_path} is not a GGUF file (bad magic); pass a .gguf model file")
    eos = generation_eos_ids(folder, ()) if folder is not None else ()
    return LlamaCppModel(gguf_path, max_context or 4096, eos, n_seqs=n_seqs, exact=not draft)
