"""Engine: one (target, drafts, strategy) setup, serving generate() / stream() one request at a time.

The Engine arbitrates requests and delegates the rest: options, devices and the draft list are checked once in
EngineConfig (config.py) before anything loads; checkpoints are resolved (once each) and tokenizers found by the
loader (models/loader.py); prompts, stop strings and output text are prompts.py's, streamed text text_stream.py's;
the strategy (strategies/base.py) owns the models, its workers and channels, and says whether they are healthy.

Requests (what the server relies on):
- One generation at a time per Engine. A second generate()/stream() from another thread waits its turn
  (`on_busy="wait"`, the default; at most `wait_timeout` seconds if set, default no limit) or raises EngineBusy
  (`on_busy="error"`). EngineBusy names the request holding the Engine (a stream left open: which thread opened it,
  when) and how to end it: read it to its end, stream.close() in its thread, or engine.cancel() from any thread.
- engine.stream() returns a Stream: iterate it for text deltas; `stream.result` is its GenerationResult once it
  has ended. The request starts at the first next(), so a stream never iterated holds nothing.
- How a stream ends early, and what its reader sees:
    stream.close() (or dropping it)      it just ends; result.finish_reason "cancelled"
    engine.cancel() (any thread)         it ends within one round; result.finish_reason "cancelled"
    a newer request from the thread that left it open, or engine.close()
                                         its next iteration raises StreamCancelled naming what ended it: text is
                                         never cut short silently
  In every case the workers stop within one round and the Engine is ready for the next request.
- A worker that dies or stops answering (WorkerDied, WorkerTimeout) leaves the Engine unusable until
  restart_workers(); every request until then raises that error again, saying so.
- close() is idempotent and retryable; an interrupted close is finished by the next close(), by garbage
  collection or at interpreter exit. Any request after it raises EngineClosed.
"""
from __future__ import annotations

import itertools
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Iterator

from paraspec.config import EngineConfig
from paraspec.models.loader import load_tokenizer_if_any, output_rows, parse_dtype, resolve_models
from paraspec.prompts import decode_text, encode_prompt, output_text, stop_string_check
from paraspec.run import Run
from paraspec.runtime.errors import RemoteError, WorkerError
from paraspec.sampling import SamplingParams, make_generator
from paraspec.stats import GenerationStats, compute_stats
from paraspec.strategies.base import Placement
from paraspec.text_stream import IncrementalText, TextDeltas
from paraspec.trace import Trace


class IncompatibleModelsError(ValueError):
    pass


class EngineBusy(RuntimeError):
    """Another request holds this Engine: raised with on_busy="error", or after `wait_timeout` seconds of waiting."""


class EngineClosed(RuntimeError):
    """The Engine was closed; create a new one."""


class StreamCancelled(RuntimeError):
    """A stream was ended by someone other than its reader (a newer request from the thread that left it open, or
    engine.close()): raised at its next iteration, so that its text is never cut short without a word."""


_numbers = itertools.count(1)


@dataclass(eq=False)
class _Request:
    """A generation: who opened it and when, whether it was asked to stop, and its result once it has ended."""
    kind: str                                     # "generate()" | "stream"
    number: int = field(default_factory=lambda: next(_numbers))
    thread: int = field(default_factory=threading.get_ident)
    thread_name: str = field(default_factory=lambda: threading.current_thread().name)
    opened: float = field(default_factory=time.time)
    stream: weakref.ref | None = None             # the Stream (weak: dropping it cancels the generation)
    cancelled: threading.Event = field(default_factory=threading.Event)
    ended_by: str | None = None                   # why another thread ended it, if not by cancel()
    result: "GenerationResult | None" = None

    def __str__(self) -> str:
        opened = time.strftime("%H:%M:%S", time.localtime(self.opened))
        return (f"{self.kind} #{self.number} (opened by thread {self.thread_name!r} at {opened}, "
                f"{time.time() - self.opened:.1f} s ago)")

    def how_to_end(self) -> str:
        if self.kind == "stream":
            return ("read that stream to its end or close it (stream.close(), in its thread), or cancel it from any "
                    "thread (engine.cancel())")
        return "wait for it, or cancel it from any thread (engine.cancel())"


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


class Stream:
    """A generation streamed as text deltas (Engine.stream): iterate it; `result` is its GenerationResult once it
    has ended; close() (also `with engine.stream(...) as s:`) cancels it. The request starts at the first next()."""

    def __init__(self, deltas: Iterator[str], request: _Request):
        self._deltas, self._request = deltas, request
        self._ended_by: str | None = None      # why it was ended by its own thread, not by its reader

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> str:
        if self._ended_by is not None:
            raise StreamCancelled(f"{self._request} was cancelled: {self._ended_by}")
        return next(self._deltas)

    @property
    def result(self) -> GenerationResult | None:
        """The GenerationResult once the stream has ended (read to its end, closed or cancelled), else None."""
        return self._request.result

    def close(self) -> None:
        """Cancel the generation (in the thread that reads the stream); the stream ends, its result says
        "cancelled". Closing a stream that has ended does nothing."""
        self._request.cancelled.set()
        self._deltas.close()

    def _end(self, why: str) -> None:
        """Its thread ends it, not its reader: its next iteration raises StreamCancelled saying `why`."""
        self._ended_by = why
        self.close()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Engine:
    def __init__(self, target, draft=None, strategy: str = "ar", dtype="auto", target_devices=("cpu",),
                 draft_devices=("cpu",), backend: str = "auto", max_context: int = 4096,
                 allow_vocab_mismatch: bool = False, runtime: str = "process", on_busy: str = "wait",
                 worker_timeout: float | None = 60.0, wait_timeout: float | None = None, transport: str = "auto",
                 ray_address: str | None = None, link_latency_ms: float = 0.0, static_width="auto", **options):
        """Strategy options (e.g. lookahead=5, max_ahead=16) are keyword arguments named like their CLI
        flags; every option of every strategy is listed in `paraspec.strategies.OPTIONS`. `runtime` places the
        workers of a strategy that starts some: "process" (one process per device group), "inprocess"
        (threads, for tests), "ray" (Ray actors); a strategy that starts none rejects "ray" (its `caps.runtimes`).
        `backend`: "auto" (llama.cpp's quantized kernels for GGUF-backed models on CPU where the strategy allows
        them, else the native decoder), "native", "hf" or "llamacpp" (docs/LLAMACPP.md).
        `on_busy`: what a request does while another is running: "wait" its turn or raise EngineBusy ("error").
        `wait_timeout`: with on_busy="wait", seconds a request waits before EngineBusy (None: no limit).
        `worker_timeout`: seconds a worker may go without a sign of life (heartbeats, also while it loads)
        before WorkerTimeout is raised and the worker killed; None disables the watchdog.
        Across machines (runtime="ray"; docs/SERVING.md): a device `NODE/cpu:0-3` runs its worker on that
        Ray node; `ray_address` joins a cluster (else RAY_ADDRESS, else a local Ray); `transport` is how workers'
        loops reach the token channels: "auto" (shared memory on this host, TCP to another), "shm" or "tcp";
        `link_latency_ms` (tests, benchmarks) delays every network message by that much.
        `static_width` (native backend): pad every forward to W rows, so that a token's logits do not depend on
        how many tokens its forward carried (one kernel shape; a CUDA graph on GPUs; models/static.py): an int,
        "auto" (a width measured on CUDA devices, off on CPUs) or None (off)."""
        self._start(EngineConfig(target, draft, strategy, dtype, target_devices, draft_devices, backend,
                                 max_context, allow_vocab_mismatch, runtime, options, on_busy=on_busy,
                                 worker_timeout=worker_timeout, wait_timeout=wait_timeout, transport=transport,
                                 ray_address=ray_address, link_latency_ms=link_latency_ms,
                                 static_width=static_width))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Engine":
        engine = cls.__new__(cls)
        engine._start(config)
        return engine

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        self.target_devices = list(config.target_devices)
        self.draft_devices = config.used_draft_devices
        self._busy = threading.Condition()        # guards _active, _closed, _failure
        self._active: _Request | None = None
        self._closed = False
        self._failure: WorkerError | None = None  # a dead or stuck worker: requests refused until restart_workers()
        # nothing loads and no worker starts before every checkpoint is resolved and the vocabularies agree
        self._placement = self._resolve(config)
        self.tokenizer = load_tokenizer_if_any(self._placement.target)
        late = [] if config.allow_vocab_mismatch else self._check_vocabularies()
        self.strategy = config.strategy_class(config.strategy_options)
        # close() runs on garbage collection and at interpreter exit too (and retries what an interrupted close left)
        self._finalizer = weakref.finalize(self, _close_strategy, self.strategy)
        try:
            self.strategy.setup(self._placement)
            for i, draft_tokenizer in late:   # an output layer config.json does not state: known once loaded
                check_compatible(self.target.vocab_size, self.draft_models[i].vocab_size, self.tokenizer, draft_tokenizer)
        except BaseException:
            self.close()
            raise

    def _resolve(self, config: EngineConfig) -> Placement:
        """Each checkpoint resolved (and, for a .gguf, converted) once, in this process: a bad path fails before any
        worker starts; the backend "auto" chosen from them (models.loader.resolve_models)."""
        draft_dtype = parse_dtype(config.dtype, self.draft_devices[0].torch_device) if self.draft_devices else None
        specs = [config.target] + config.draft_checkpoints
        dtypes = [parse_dtype(config.dtype, self.target_devices[0].torch_device)] + [draft_dtype] * (len(specs) - 1)
        self.backend, resolved = resolve_models(specs, dtypes, config.model_backend,
                                                self.target_devices + self.draft_devices)
        folders = iter(resolved[1:])
        drafts = [d if d.model_free else replace(d, spec=next(folders))
                  for d in config.draft_specs]          # in order; model-free drafters ("ngram") stay names
        return Placement(resolved[0], drafts, self.target_devices, self.draft_devices,
                         dict(dtype=config.dtype, backend=self.backend, max_context=config.max_context,
                              static_width=config.static_width),
                         config.runtime, config.worker_timeout, config.runtime_options)

    def _check_vocabularies(self) -> list[tuple[int, object]]:
        """Draft and target share one token space: checked from their tokenizers and config.json (output_rows)
        before any model loads. Returns what only the loaded models can tell: (draft index, its tokenizer) for a
        checkpoint whose config.json does not state its output rows."""
        target_rows, late = output_rows(self._placement.target), []
        for i, folder in enumerate(self._placement.draft_checkpoints):
            draft_tokenizer, rows = load_tokenizer_if_any(folder), output_rows(folder)
            check_compatible(target_rows, rows, self.tokenizer, draft_tokenizer)
            if target_rows is None or rows is None:
                late.append((i, draft_tokenizer))
        return late

    def restart_workers(self) -> None:
        """Stop the strategy's workers and start new ones (models reloaded), e.g. after WorkerDied or
        WorkerTimeout; waits for (or, with on_busy="error", refuses during) a running generation."""
        request = self._acquire(_Request("restart_workers()"), failed_ok=True)
        try:
            self.strategy.close()
            self._finalizer.detach()
            self.strategy = self.config.strategy_class(self.config.strategy_options)
            self._finalizer = weakref.finalize(self, _close_strategy, self.strategy)
            self.strategy.setup(self._placement)
            self._failure = None
        finally:
            self._release(request)

    def set_options(self, **options) -> None:
        """Change strategy options between requests (the models stay loaded), checked like the Engine's own
        arguments (EngineConfig); EngineBusy while a request runs. The strategy takes them now
        (Strategy.set_options: what it built from the old ones, e.g. its kept drafters, is built again)."""
        config = replace(self.config, options={**self.config.options, **options})
        request = _Request("set_options()")
        with self._busy:
            self._check_usable(failed_ok=True)
            if self._active is not None:
                raise EngineBusy(f"options cannot change while {self._active} runs; "
                                 f"{self._active.how_to_end()}")
            self._active, self.config = request, config    # no request starts while the strategy rebuilds
        try:
            self.strategy.set_options(config.strategy_options)
        finally:
            self._release(request)

    @property
    def options(self) -> dict:
        """The strategy's options (given values, defaults for the rest); change them with set_options()."""
        return self.strategy.options

    # the models and workers are the strategy's; these name them for callers and tests
    @property
    def target(self):
        return self.strategy.target

    @property
    def draft_models(self) -> list:
        return self.strategy.draft_models

    @property
    def draft(self):
        return self.strategy.draft_models[0] if self.strategy.draft_models else None

    @property
    def runtime(self):
        return self.strategy.runtime

    # -- prompts (prompts.py) ------------------------------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        """A str (raw text, no template), a list of token ids, or chat messages (chat template applied)."""
        return encode_prompt(prompt, self.tokenizer, self.target.vocab_size, self.max_context)

    def decode_text(self, token_ids: list[int]) -> str:
        return decode_text(self.tokenizer, token_ids)

    @property
    def max_context(self) -> int:
        return min(m.max_context for m in (self.target, *self.draft_models))

    # -- generation ----------------------------------------------------------------------------------------
    def _new_run(self, prompt, params: SamplingParams | None, record_margins: bool = False) -> Run:
        self._check_usable()
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a paraspec.SamplingParams")
        stop = set(self.target.eos_token_ids) | set(params.stop_token_ids or ())
        return Run(prompt_ids=self.encode(prompt), params=params, stop_ids=frozenset(stop),
                   generator=make_generator(params.seed), max_context=self.max_context,
                   margins={} if record_margins else None,
                   stop_check=stop_string_check(self.tokenizer, params.stop) if params.stop else None)

    def stream(self, prompt, params: SamplingParams | None = None) -> Stream:
        """A Stream of text deltas as tokens are committed; its `result` once it has ended. The request starts at
        the first next(); close() (or dropping the stream) cancels it. See the module docstring for the ways a
        stream can end early."""
        run = self._new_run(prompt, params)
        request = _Request("stream")
        stream = Stream(self._stream(run, request), request)
        request.stream = weakref.ref(stream)
        return stream

    def _stream(self, run: Run, request: _Request) -> Iterator[str]:
        self._acquire(request)
        batches = self._decode(run, request)
        text, decoder = TextDeltas(run.params.stop), IncrementalText(self.tokenizer)
        start = run.trace.t0 = time.perf_counter()
        try:
            for _ in batches:
                # the last batch's text decoded whole: a held-back half character may complete a stop string
                delta = text.update(output_text(self.tokenizer, run, None if run.done else decoder), final=run.done)
                if delta:
                    yield delta
        finally:
            batches.close()
            try:
                request.result = self._finish(run, start)   # closed or cancelled too: the text it had
            finally:
                self._release(request)
        if request.ended_by is not None and run.finish_reason == "cancelled":   # engine.close(), another thread
            raise StreamCancelled(f"{request} was cancelled: {request.ended_by}")
        delta = text.update(request.result.text, final=True)
        if delta:
            yield delta

    def generate(self, prompt, params: SamplingParams | None = None,
                 record_margins: bool = False) -> GenerationResult:
        """Generate a completion. record_margins keeps, for each output index, the target's top-1 minus top-2
        logit as this strategy computed it: where two strategies differ in bf16, it shows a near-tie."""
        run = self._new_run(prompt, params, record_margins)
        request = self._acquire(_Request("generate()"))
        batches = self._decode(run, request)
        try:
            start = run.trace.t0 = time.perf_counter()
            for _ in batches:
                pass
            request.result = self._finish(run, start)
            return request.result
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
        return self.strategy.health()

    # -- one request at a time -------------------------------------------------------------------------------
    def _acquire(self, request: _Request, failed_ok: bool = False) -> _Request:
        """Make `request` the one in progress: wait for (at most wait_timeout), or refuse with on_busy="error",
        another thread's; end a stream the calling thread left open (its reader gets StreamCancelled)."""
        timeout = self.config.wait_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
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
                        raise EngineBusy(f"{active} is running on this Engine; {active.how_to_end()}, or create "
                                         f"the Engine with on_busy='wait'")
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise EngineBusy(f"waited {timeout:g} s (wait_timeout) for {active}, which still holds "
                                         f"this Engine; {active.how_to_end()}")
                    self._busy.wait(left)
                    continue
            # this thread left a stream open: it ends (its reader is told), outside the lock; a stream that never
            # started holds nothing: drop it as the active one
            open_stream._end(f"{request} was started on the same thread before this stream ended; read a stream "
                             f"to its end or close() it before starting another request")
            with self._busy:
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
        return GenerationResult(
            output_text(self.tokenizer, run), list(run.tokens), compute_stats(run, self.strategy.name, total),
            run.trace, run.finish_reason or "length", run.prompt_ids, run.margins, run.worker_reports)

    # -- lifetime ------------------------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """Stop every worker and unlink every shared-memory segment. Idempotent and retryable: a close that was
        interrupted (Ctrl-C) is finished by the next one, by garbage collection or at interpreter exit.
        A generation running in another thread is cancelled first (given `timeout` seconds to end); one this
        thread left open as a stream is closed. Any request afterwards raises EngineClosed."""
        if getattr(self, "strategy", None) is None:   # __init__ failed before the strategy existed
            return
        why = "the Engine was closed (engine.close())"
        with self._busy:
            self._closed = True
            active = self._active
            if active is not None:
                active.ended_by = why
        if active is not None:
            if active.thread == threading.get_ident() and active.stream and active.stream() is not None:
                active.stream()._end(why)
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


def check_compatible(target_rows: int | None, draft_rows: int | None, target_tok, draft_tok) -> None:
    """Draft and target must share one token space; only the padding rows of the output layers may differ.
    `*_rows` are the output layers' rows (None: not known yet, that part is left for later)."""
    rows = [r for r in (target_rows, draft_rows) if r is not None]
    if target_tok is not None and draft_tok is not None:
        tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
        if tv != dv:
            raise IncompatibleModelsError(
                f"draft and target tokenizers differ (vocab {len(dv)} vs {len(tv)}); pass a draft from the "
                f"same family or allow_vocab_mismatch=True (--allow-vocab-mismatch)")
        if rows and min(rows) < len(tv):
            raise IncompatibleModelsError(
                f"a model's output layer ({min(rows)} rows) is smaller than its tokenizer ({len(tv)} tokens); the "
                f"checkpoint and tokenizer do not belong together")
    elif len(rows) == 2 and target_rows != draft_rows:
        raise IncompatibleModelsError(
            f"draft and target vocabularies differ ({draft_rows} vs {target_rows}) and there is no "
            f"tokenizer to show they agree; pass a draft from the same family or allow_vocab_mismatch=True")
