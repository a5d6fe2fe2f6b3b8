"""Engine: one (target, drafts, strategy) setup, serving generate() / stream().

Everything a user can get wrong is checked before the first forward: strategy, options and devices in
EngineConfig (config.py), before anything loads; checkpoints and tokenizer compatibility here, before and right
after the strategy's setup(); sampling values and prompt length per request. The strategy object owns the models,
its workers and channels (strategies/base.py: setup, decode, cancel, close).

Requests (what the server relies on):
- One generation at a time per Engine. A second generate()/stream() from another thread waits its turn
  (`on_busy="wait"`, the default) or raises EngineBusy (`on_busy="error"`). A new request from the thread that
  left a stream open cancels that stream first (it ends with finish_reason "cancelled").
- A stream's close() (or its garbage collection) and Engine.cancel() (from any thread) stop the generation in
  every worker within one round; the request ends with finish_reason "cancelled" and the Engine is ready for
  the next one.
- A worker that dies or stops answering (WorkerDied, WorkerTimeout) leaves the Engine unusable until
  restart_workers(); every request until then raises that error again, saying so.
- close() is idempotent and retryable; an interrupted close is finished by the next close(), by garbage
  collection or at interpreter exit. Any request after it raises EngineClosed.
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Iterator

from paraspec.config import EngineConfig
from paraspec.drafters import is_model_free
from paraspec.models.loader import load_tokenizer, parse_dtype, resolve_checkpoint
from paraspec.runtime.errors import RemoteError, WorkerError
from paraspec.sampling import SamplingParams, make_generator
from paraspec.stats import GenerationStats, compute_stats
from paraspec.strategies.base import Placement
from paraspec.run import Run
from paraspec.trace import Trace


class IncompatibleModelsError(ValueError):
    pass


class EngineBusy(RuntimeError):
    """Another generation is running on this Engine (raised with on_busy="error")."""


class EngineClosed(RuntimeError):
    """The Engine was closed; create a new one."""


@dataclass(eq=False)
class _Request:
    """The generation in progress: who started it, and whether it was asked to stop."""
    thread: int                                   # threading.get_ident() of the caller that started it
    stream: weakref.ref | None = None             # the stream's generator (weak: dropping it cancels it)
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    trace: Trace = field(repr=False)
    finish_reason: str = "length"     # "stop" (a stop token or string) | "length" | "context" | "cancelled"
    prompt_ids: list[int] = field(default_factory=list, repr=False)
    margins: dict[int, float] | None = field(default=None, repr=False)   # see generate(record_margins=...)
    worker_reports: dict = field(default_factory=dict, repr=False)      # raw counters of worker loops


class Engine:
    def __init__(self, target, draft=None, strategy: str = "ar", dtype="auto", target_devices=("cpu",),
                 draft_devices=("cpu",), backend: str = "auto", max_context: int = 4096,
                 allow_vocab_mismatch: bool = False, runtime: str = "process", on_busy: str = "wait",
                 worker_timeout: float | None = 60.0, **options):
        """Strategy options (e.g. lookahead=5, max_ahead=16) are keyword arguments named like their CLI
        flags; every option of every strategy is listed in `paraspec.strategies.OPTIONS`. `runtime` places the
        workers of a strategy that starts some: "process" (one process per device group), "inprocess"
        (threads, for tests), "ray" (Ray actors); a strategy that starts none rejects "ray" (its `runtimes`).
        `backend`: "auto" (llama.cpp's quantized kernels for GGUF-backed models on CPU where the strategy allows
        them, else the native decoder), "native", "hf" or "llamacpp" (README "Backends").
        `on_busy`: what a request does while another is running: "wait" its turn or raise EngineBusy ("error").
        `worker_timeout`: seconds a worker may go without a sign of life (heartbeats, also while it loads)
        before WorkerTimeout is raised and the worker killed; None disables the watchdog."""
        self._start(EngineConfig(target, draft, strategy, dtype, target_devices, draft_devices, backend,
                                 max_context, allow_vocab_mismatch, runtime, options, on_busy=on_busy,
                                 worker_timeout=worker_timeout))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Engine":
        engine = cls.__new__(cls)
        engine._start(config)
        return engine

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        self.last_result: GenerationResult | None = None
        self.target_devices = list(config.target_devices)
        self.draft_devices = config.used_draft_devices
        self._busy = threading.Condition()        # guards _active, _closed, _failure
        self._active: _Request | None = None
        self._closed = False
        self._failure: WorkerError | None = None  # a dead or stuck worker: requests refused until restart_workers()
        self.strategy = config.strategy_class(config.strategy_options)
        self.options = self.strategy.options
        # close() runs on garbage collection and at interpreter exit too (and retries what an interrupted close left)
        self._finalizer = weakref.finalize(self, _close_strategy, self.strategy)
        # resolve (and convert, for .gguf) in this process first: bad paths fail before any worker starts
        dtype_of = lambda devices: parse_dtype(config.dtype, devices[0].torch_device)
        self.backend = config.model_backend        # "auto" resolved by the config
        target_dir = _resolve(config.target, dtype_of(self.target_devices), self.backend)
        draft_dirs = ([_resolve(d, dtype_of(self.draft_devices), self.backend) for d in config.model_drafts]
                      if self.draft_devices else [])
        drafts = iter(draft_dirs)         # the specs in order: model-free drafters ("ngram") stay names
        draft_specs = [d if is_model_free(d) else next(drafts) for d in config.drafts]
        self.tokenizer = self._maybe_tokenizer(target_dir)
        self._placement = Placement(target_dir, draft_specs, self.target_devices, self.draft_devices,
                                    dict(dtype=config.dtype, backend=self.backend, max_context=config.max_context),
                                    config.runtime, config.worker_timeout)
        try:
            self.strategy.setup(self._placement)
            if not config.allow_vocab_mismatch:
                for model, folder in zip(self.drafts, draft_dirs):
                    check_compatible(self.target, model, self.tokenizer, self._maybe_tokenizer(folder))
        except BaseException:
            self.close()
            raise

    def restart_workers(self) -> None:
        """Stop the strategy's workers and start new ones (models reloaded), e.g. after WorkerDied or
        WorkerTimeout; waits for (or, with on_busy="error", refuses during) a running generation."""
        request = self._acquire(failed_ok=True)
        try:
            self.strategy.close()
            self._finalizer.detach()
            self.strategy = self.config.strategy_class(self.config.strategy_options)
            self._finalizer = weakref.finalize(self, _close_strategy, self.strategy)
            self.strategy.setup(self._placement)
            self._failure = None
        finally:
            self._release(request)

    # the models and workers are the strategy's; these name them for callers and tests
    @property
    def target(self):
        return self.strategy.target

    @property
    def drafts(self) -> list:
        return self.strategy.drafts

    @property
    def draft(self):
        return self.strategy.drafts[0] if self.strategy.drafts else None

    @property
    def runtime(self):
        return self.strategy.runtime

    @staticmethod
    def _maybe_tokenizer(folder):
        """The checkpoint's tokenizer, or None for a weights-only checkpoint (token-id prompts still work)."""
        from paraspec.models.simulated import SimulatedSpec
        if isinstance(folder, SimulatedSpec) or not any((folder / f).exists() for f in (
                "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
            return None
        return load_tokenizer(folder)

    # -- prompts -------------------------------------------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        """A str (raw text, no template), a list of token ids, or chat messages (chat template applied)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            ids = self._tokenizer_for("a text prompt").encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            tok = self._tokenizer_for("chat messages")
            if not getattr(tok, "chat_template", None):
                raise ValueError("this tokenizer has no chat template; pass a plain string prompt (no --chat)")
            for m in prompt:
                if "role" not in m or "content" not in m:
                    raise ValueError(f"chat message {m!r} needs 'role' and 'content'")
            ids = tok.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            ids = list(ids)
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
            if bad:
                raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.target.vocab_size})")
        else:
            raise ValueError("prompt must be a non-empty str, list of token ids, or list of chat messages "
                             "({'role': ..., 'content': ...})")
        if not ids:
            raise ValueError("the prompt encodes to zero tokens")
        limit = self.max_context
        if len(ids) >= limit:
            raise ValueError(f"the prompt has {len(ids)} tokens but the context holds {limit}; shorten the "
                             f"prompt or create the engine with a larger max_context")
        return ids

    def _tokenizer_for(self, what: str):
        if self.tokenizer is None:
            raise ValueError(f"the target checkpoint has no tokenizer, so {what} cannot be encoded; "
                             f"pass a list of token ids")
        return self.tokenizer

    @property
    def max_context(self) -> int:
        return min(m.max_context for m in (self.target, *self.drafts))

    def decode_text(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # -- generation ----------------------------------------------------------------------------------------
    def _new_run(self, prompt, params: SamplingParams | None, record_margins: bool = False) -> Run:
        self._check_usable()
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a paraspec.SamplingParams")
        stop = set(self.target.eos_token_ids) | set(params.stop_token_ids or ())
        if params.stop:
            self._tokenizer_for("stop strings")
        return Run(prompt_ids=self.encode(prompt), params=params, stop_ids=frozenset(stop),
                   generator=make_generator(params.seed), max_context=self.max_context,
                   margins={} if record_margins else None,
                   stop_check=self._stop_check(params.stop) if params.stop else None)

    def _stop_check(self, stop: tuple[str, ...]):
        """Run.commit's test for stop strings: decode only the last tokens (enough for the longest stop string
        even at one byte per token), so that the check per committed token stays short."""
        window = 4 * max(map(len, stop)) + 4

        def check(tokens: list[int]) -> str | None:
            tail = self.decode_text(tokens[-window:])
            return next((s for s in stop if s in tail), None)
        return check

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas as tokens are committed; the full result is then in `engine.last_result`.
        The request starts at the first next(); close() on the generator (or dropping it) cancels it."""
        run = self._new_run(prompt, params)
        request = _Request(threading.get_ident())
        deltas = self._stream(run, request)
        request.stream = weakref.ref(deltas)
        return deltas

    def _stream(self, run: Run, request: _Request) -> Iterator[str]:
        self._acquire(request)
        batches = self._decode(run, request)
        try:
            start = time.perf_counter()
            run.trace.t0 = start
            text = ""
            # text that a stop string may still claim is held back: its longest proper prefix
            hold = max(map(len, run.params.stop)) - 1 if run.params.stop else 0
            for _ in batches:
                now_text = self._text(run)
                if hold and not run.done:
                    now_text = now_text[:len(now_text) - hold]
                if now_text.endswith("\ufffd"):   # an incomplete UTF-8 sequence: wait for the next token
                    continue
                if len(now_text) > len(text) and now_text.startswith(text):
                    yield now_text[len(text):]
                    text = now_text           # `text` is what was yielded: deltas always add up
            result = self._finish(run, start)
        finally:
            batches.close()
            self._release(request)
        if result.text != text and result.text.startswith(text):
            yield result.text[len(text):]

    def _text(self, run: Run) -> str:
        """The output text: without a final stop token, and cut before a stop string."""
        if run.stop_string is not None:
            text = self.decode_text(run.tokens)
            return text[:min((i for s in run.params.stop if (i := text.find(s)) >= 0), default=len(text))]
        return self.decode_text(run.tokens[:-1] if run.finish_reason == "stop" else run.tokens)

    def generate(self, prompt, params: SamplingParams | None = None,
                 record_margins: bool = False) -> GenerationResult:
        """Generate a completion. record_margins keeps, for each output index, the target's top-1 minus top-2
        logit as this strategy computed it: where two strategies differ in bf16, it shows a near-tie."""
        run = self._new_run(prompt, params, record_margins)
        request = self._acquire()
        batches = self._decode(run, request)
        try:
            start = time.perf_counter()
            run.trace.t0 = start
            for _ in batches:
                pass
            return self._finish(run, start)
        finally:
            batches.close()
            self._release(request)

    def _decode(self, run: Run, request: _Request) -> Iterator[list[int]]:
        """The strategy's batches until the run is done or the request is cancelled (checked after every
        batch; Engine.cancel() also wakes a strategy blocked on its workers). A dead or stuck worker marks the
        Engine failed until restart_workers()."""
        batches = self.strategy.decode(run)
        try:
            for batch in batches:
                if request.cancelled.is_set():
                    break
                yield batch
                if request.cancelled.is_set():
                    break
        except WorkerError as e:
            if not isinstance(e, RemoteError):
                self._failure = e
                e.args = (f"{e}; the Engine's workers must be restarted: call engine.restart_workers() (or "
                          f"create a new Engine)",)
            raise
        finally:
            batches.close()       # a strategy's own cleanup: stop its loops, collect its workers' reports
            if request.cancelled.is_set() and not run.done:
                run.finish_reason = "cancelled"

    def cancel(self) -> bool:
        """Stop the generation in progress (from any thread) within one round; it ends with finish_reason
        "cancelled" (a stream stops yielding). False if nothing was running."""
        with self._busy:
            request = self._active
            if request is None:
                return False
            request.cancelled.set()
            self.strategy.cancel()
            return True

    def health(self) -> str | None:
        """Why a request would fail now (closed, a worker failed or is not alive), or None when it would run."""
        with self._busy:
            if self._closed:
                return "the Engine is closed"
            if self._failure is not None:
                return str(self._failure)
        runtime = self.strategy.runtime
        if runtime is not None:
            if runtime.closed:
                return "the Engine's workers are stopped"
            dead = [name for name, worker in runtime.workers.items() if not worker.alive]
            if dead:
                return f"worker(s) {', '.join(map(repr, dead))} not alive; restart_workers() starts new ones"
        return None

    # -- one request at a time -------------------------------------------------------------------------------
    def _acquire(self, request: _Request | None = None, failed_ok: bool = False) -> _Request:
        """Make `request` the one in progress: wait for (or refuse, with on_busy="error") another thread's;
        cancel a stream the calling thread left open."""
        request = request or _Request(threading.get_ident())
        while True:
            with self._busy:
                self._check_usable(failed_ok)
                active = self._active
                if active is None:
                    self._active = request
                    return request
                open_stream = active.stream() if active.thread == request.thread and active.stream else None
                if open_stream is None:
                    if self.config.on_busy == "error":
                        raise EngineBusy("another generation is running on this Engine; wait for it, cancel it "
                                         "(engine.cancel()), or create the Engine with on_busy='wait'")
                    self._busy.wait()
                    continue
            open_stream.close()       # this thread left a stream open: it ends as cancelled, outside the lock
            with self._busy:          # (a stream that never started holds nothing: drop it as the active one)
                if self._active is active:
                    self._active = None

    def _release(self, request: _Request) -> None:
        with self._busy:
            if self._active is request:
                self._active = None
                self._busy.notify_all()

    def _check_usable(self, failed_ok: bool = False) -> None:
        if self._closed:
            raise EngineClosed("this Engine is closed; create a new Engine to generate again")
        if self._failure is not None and not failed_ok:
            raise self._failure

    def _finish(self, run: Run, start: float) -> GenerationResult:
        total = time.perf_counter() - start
        self.last_result = GenerationResult(
            self._text(run), list(run.tokens), compute_stats(run, self.strategy.name, total),
            run.trace, run.finish_reason or "length", run.prompt_ids, run.margins, run.worker_reports)
        return self.last_result

    # -- lifetime ------------------------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """Stop every worker and unlink every shared-memory segment. Idempotent and retryable: a close that was
        interrupted (Ctrl-C) is finished by the next one, by garbage collection or at interpreter exit.
        A generation running in another thread is cancelled first (given `timeout` seconds to end); one this
        thread left open as a stream is closed. Any request afterwards raises EngineClosed."""
        if getattr(self, "strategy", None) is None:   # __init__ failed before the strategy existed
            return
        with self._busy:
            self._closed = True
            active = self._active
        if active is not None:
            if active.thread == threading.get_ident() and active.stream and active.stream() is not None:
                active.stream().close()
            else:
                self.cancel()
                with self._busy:
                    self._busy.wait_for(lambda: self._active is None, timeout)
        self.strategy.close()
        self._finalizer.detach()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _close_strategy(strategy) -> None:
    """The Engine's finalizer (garbage collection, interpreter exit): holds the strategy, not the Engine."""
    strategy.close()


def _resolve(spec, dtype, backend: str = "native"):
    """A checkpoint folder (resolved and converted here), or a simulated model's spec as it is."""
    from paraspec.models.simulated import SimulatedSpec
    return spec if isinstance(spec, SimulatedSpec) else resolve_checkpoint(spec, dtype, backend)


def check_compatible(target, draft, target_tok, draft_tok) -> None:
    """Draft and target must share one token space; only the padding rows of the output layers may differ."""
    if target_tok is not None and draft_tok is not None:
        tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
        if tv != dv:
            raise IncompatibleModelsError(
                f"draft and target tokenizers differ (vocab {len(dv)} vs {len(tv)}); pass a draft from the "
                f"same family or allow_vocab_mismatch=True (--allow-vocab-mismatch)")
        if min(target.vocab_size, draft.vocab_size) < len(tv):
            raise IncompatibleModelsError(
                f"a model's output layer ({min(target.vocab_size, draft.vocab_size)} rows) is smaller than its "
                f"tokenizer ({len(tv)} tokens); the checkpoint and tokenizer do not belong together")
    elif target.vocab_size != draft.vocab_size:
        raise IncompatibleModelsError(
            f"draft and target vocabularies differ ({draft.vocab_size} vs {target.vocab_size}) and there is no "
            f"tokenizer to show they agree; pass a draft from the same family or allow_vocab_mismatch=True")
