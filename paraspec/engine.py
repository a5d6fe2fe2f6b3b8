"""Engine: one (target, drafts, strategy) setup, serving generate() / stream() one request at a time.

The Engine arbitrates requests and delegates the rest: options, devices and the draft list are checked once in
EngineConfig (config.py) before anything loads; checkpoints are resolved (once each) and tokenizers found by the
loader (models/loader.py); prompts, stop strings and output text are prompts.py's, streamed text text_stream.py's;
the strategy (strategies/base.py) owns the models, its workers and channels, and says whether they are healthy.

Requests (what the server relies on; the request and its Stream are streams.py's, the errors errors.py's, the gate
gate.py's):
- Up to `max_num_seqs` generations at once where the strategy batches requests (`ar` and `sd` on llama.cpp's
  kernels or the native decoder's dynamic forward: batching.py; each answer bit-identical to the request run
  alone), else one at a time. A request beyond that waits its turn (`on_busy="wait"`, the default; at most
  `wait_timeout` seconds, 600 by default) or raises EngineBusy (`on_busy="error"`). EngineBusy names the requests
  holding the Engine (a stream left open: which thread opened it, when) and how to end them: read to the end,
  stream.close() in its thread, or engine.cancel() from any thread.
- engine.stream() returns a Stream: iterate it for text deltas; `stream.result` is its GenerationResult once it
  has ended. The request starts at the first next(), so a stream never iterated holds nothing.
- How a stream ends early, and what its reader sees:
    stream.close() (or dropping it)      it just ends; result.finish_reason "cancelled"
    engine.cancel() (any thread)         every running one ends within one round; finish_reason "cancelled"
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

import copy
import threading
import time
import weakref
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace

from paraspec.batching import BatchedSequence, Batcher
from paraspec.config import EngineConfig
from paraspec.errors import EngineBusy, EngineClosed, IncompatibleModelsError, RefusedParameter, StreamCancelled
from paraspec.gate import RequestGate
from paraspec.models.loader import load_tokenizer_if_any, output_rows, parse_dtype, resolve_models, widened_draft
from paraspec.prompts import decode_text, encode_prompt, output_text, stop_string_check
from paraspec.request_state import RequestState
from paraspec.runtime.errors import RemoteError, WorkerError
from paraspec.sampling import PROCESSOR_PARAMS, SamplingParams, make_generator
from paraspec.stats import compute_stats
from paraspec.strategies.base import Placement
from paraspec.strategies.registry import STRATEGIES
from paraspec.streams import GenerationResult, Request, Stream
from paraspec.structured import GrammarMatcher
from paraspec.text_stream import IncrementalText, TextDeltas

__all__ = [
    "Engine",
    "EngineBusy",
    "EngineClosed",
    "GenerationResult",
    "IncompatibleModelsError",
    "Stream",
    "StreamCancelled",
    "check_compatible",
]


# why a strategy without the capability refuses a request's parameter (Engine.check_params)
REFUSALS = {
    "processors": "does not apply logit_bias or penalties; drop them",
    "logprobs": "does not report logprobs; drop logprobs",
    "structured": "does not apply structured outputs; drop structured",
}


class Engine:
    def __init__(
        self,
        target,
        draft=None,
        strategy: str = "ar",
        dtype="auto",
        target_devices=("cpu",),
        draft_devices=("cpu",),
        backend: str = "auto",
        max_context: int = 4096,
        allow_vocab_mismatch: bool = False,
        runtime_kind: str = "process",
        on_busy: str = "wait",
        worker_timeout: float | None = 60.0,
        wait_timeout: float | None = 600.0,
        transport: str = "auto",
        ray_address: str | None = None,
        link_latency_ms: float = 0.0,
        padded_width="auto",
        compile_step: bool = False,
        max_num_seqs: int = 4,
        **options,
    ):
        """Strategy options (e.g. lookahead=5, max_ahead=16) are keyword arguments named like their CLI
        flags; every option of every strategy is listed in `paraspec.strategies.OPTIONS`. `runtime_kind` places the
        workers of a strategy that starts some: "process" (one process per device group), "inprocess"
        (threads, for tests), "ray" (Ray actors); a strategy that starts none rejects "ray" (its `caps.runtime_kinds`).
        `backend`: "auto" (llama.cpp's quantized kernels for GGUF-backed models on CPU where the strategy allows
        them, else the native decoder), "native", "hf" or "llamacpp" (docs/LLAMACPP.md).
        `max_num_seqs`: requests decoded at once, their forwards shared, where the strategy batches requests
        (`ar`, `sd` on the llamacpp backend and on the native decoder's dynamic forward: batching.py); 1 decodes
        one at a time. Other strategies run one.
        `on_busy`: what a request does while the Engine is full: "wait" its turn or raise EngineBusy ("error").
        `wait_timeout`: with on_busy="wait", seconds a request waits before EngineBusy (None: no limit).
        `worker_timeout`: seconds a worker may go without a sign of life (heartbeats, also while it loads)
        before WorkerTimeout is raised and the worker killed; None disables the watchdog.
        Across machines (runtime_kind="ray"; docs/SERVING.md): a device `NODE/cpu:0-3` runs its worker on that
        Ray node; `ray_address` joins a cluster (else RAY_ADDRESS, else a local Ray); `transport` is how workers'
        loops reach the token channels: "auto" (shared memory on this host, TCP to another), "shm" or "tcp";
        `link_latency_ms` (tests, benchmarks) delays every network message by that much.
        `padded_width` (native backend): pad every forward to W rows, so that a token's logits do not depend on
        how many tokens its forward carried (one kernel shape; a CUDA graph on GPUs; models/native/padded.py): an int,
        "auto" (a width measured on CUDA devices, off on CPUs) or None (off). `compile_step` runs that padded
        step through torch.compile (fused kernels, a faster step on GPUs; a compile per model at load; measured by
        benchmarks/gpu_check.py --sections compiled, docs/GPU.md)."""
        self._start(
            EngineConfig(
                target,
                draft,
                strategy,
                dtype,
                target_devices,
                draft_devices,
                backend,
                max_context,
                allow_vocab_mismatch,
                runtime_kind,
                options,
                on_busy=on_busy,
                worker_timeout=worker_timeout,
                wait_timeout=wait_timeout,
                transport=transport,
                ray_address=ray_address,
                link_latency_ms=link_latency_ms,
                padded_width=padded_width,
                compile_step=compile_step,
                max_num_seqs=max_num_seqs,
            )
        )

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        engine = cls.__new__(cls)
        engine._start(config)
        return engine

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        self.target_devices = list(config.target_devices)
        self.draft_devices = config.used_draft_devices
        # nothing loads and no worker starts before every checkpoint is resolved and the vocabularies agree
        self._placement = self._resolve(config)
        self._gate = RequestGate(self.max_num_seqs, config.on_busy, config.wait_timeout)
        self._batcher: Batcher | None = None
        self._sequence_strategies: list = []  # with several sequences: a strategy per sequence
        self.tokenizer = load_tokenizer_if_any(self._placement.target)
        late = [] if config.allow_vocab_mismatch else self._check_vocabularies()
        self.strategy = config.strategy_class(config.strategy_options)
        # close() runs on garbage collection and at interpreter exit too (and retries what an interrupted close left)
        self._finalizer = weakref.finalize(self, _close_strategy, self.strategy)
        try:
            self.strategy.setup(self._placement)
            for i, draft_tokenizer in late:  # an output layer config.json does not state: known once loaded
                check_compatible(
                    self.target.vocab_size, self.draft_models[i].vocab_size, self.tokenizer, draft_tokenizer
                )
            self._open_sequence_strategies()
        except BaseException:
            self.close()
            raise

    def _resolve(self, config: EngineConfig) -> Placement:
        """Each checkpoint resolved (and, for a .gguf, converted) once, in this process: a bad path fails before any
        worker starts; the backend "auto" chosen from them (models.loader.resolve_models)."""
        draft_dtype = parse_dtype(config.dtype, self.draft_devices[0].torch_device) if self.draft_devices else None
        specs = [config.target] + config.draft_checkpoints
        dtypes = [parse_dtype(config.dtype, self.target_devices[0].torch_device)] + [draft_dtype] * (len(specs) - 1)
        self.backend, resolved = resolve_models(
            specs, dtypes, config.model_backend, self.target_devices + self.draft_devices
        )
        if self.backend == "llamacpp":  # drafts' Q5_0 matrices as Q8_0 where that is faster (measured)
            threads = self.draft_devices[0].num_threads if self.draft_devices else self.target_devices[0].num_threads
            resolved = resolved[:1] + [widened_draft(f, threads) for f in resolved[1:]]
        # requests share forwards where the strategy's loop runs here on models with a sequence each (llama.cpp,
        # and the native decoder's dynamic forward: models/native/sequences.py)
        batches = config.strategy_class.caps.batches and (
            self.backend == "llamacpp" or (self.backend == "native" and self._native_dynamic(config))
        )
        self.max_num_seqs = config.max_num_seqs if batches else 1
        seqs = {"n_seqs": self.max_num_seqs} if self.max_num_seqs > 1 else {}
        folders = iter(resolved[1:])
        drafts = [
            d if d.model_free else replace(d, spec=next(folders)) for d in config.draft_specs
        ]  # in order; model-free drafters ("ngram") stay names
        return Placement(
            resolved[0],
            drafts,
            self.target_devices,
            self.draft_devices,
            dict(
                dtype=config.dtype,
                backend=self.backend,
                max_context=config.max_context,
                padded_width=config.padded_width,
                compile_step=config.compile_step,
                **seqs,
            ),
            config.runtime_kind,
            config.worker_timeout,
            config.runtime_options,
        )

    def _native_dynamic(self, config: EngineConfig) -> bool:
        """Native checkpoints on the dynamic forward: no padded width (None, or "auto" on CPUs only), no compile,
        no simulated model (their forwards are not a decoder's)."""
        from paraspec.models.simulated import SimulatedSpec

        if any(isinstance(m, SimulatedSpec) for m in [config.target] + config.draft_checkpoints):
            return False
        on_cpu = all(d.torch_device.startswith("cpu") for d in self.target_devices + self.draft_devices)
        return not config.compile_step and (config.padded_width is None or (config.padded_width == "auto" and on_cpu))

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

    def _open_sequence_strategies(self) -> None:
        """With max_num_seqs > 1: the Batcher, and per sequence a copy of the strategy whose models are that
        sequence of each model (BatchedSequence) and whose drafters are its own (kept across its requests)."""
        if self.max_num_seqs == 1:
            return
        self._batcher = Batcher()
        self._sequence_strategies = []
        self._sequence_strategies_lock = threading.Lock()
        for sequence_id in range(self.max_num_seqs):
            strategy = copy.copy(self.strategy)
            strategy.target = BatchedSequence(self._batcher, self.strategy.target, sequence_id)
            strategy.draft_models = [BatchedSequence(self._batcher, m, sequence_id) for m in self.strategy.draft_models]
            strategy.policy, strategy._pinning = None, None  # its own drafters; the Engine's strategy unpins
            strategy.in_use = False
            self._sequence_strategies.append(strategy)

    def restart_workers(self) -> None:
        """Stop the strategy's workers and start new ones (models reloaded), e.g. after WorkerDied or
        WorkerTimeout; waits for (or, with on_busy="error", refuses during) running generations."""
        request = self._gate.acquire(Request("restart_workers()", exclusive=True), failed_ok=True)
        try:
            self.strategy.close()
            self._finalizer.detach()
            self.strategy = self.config.strategy_class(self.config.strategy_options)
            self._finalizer = weakref.finalize(self, _close_strategy, self.strategy)
            self.strategy.setup(self._placement)
            self._open_sequence_strategies()
            self._gate.failure = None
        finally:
            self._gate.release(request)

    def set_options(self, **options) -> None:
        """Change strategy options between requests (the models stay loaded), checked like the Engine's own
        arguments (EngineConfig); EngineBusy while a request runs. The strategy takes them now
        (Strategy.set_options: what it built from the old ones, e.g. its kept drafters, is built again)."""
        config = replace(self.config, options={**self.config.options, **options})
        # no request starts while the strategy rebuilds
        request = self._gate.claim(Request("set_options()", exclusive=True), "options cannot change")
        self.config = config
        try:
            self.strategy.set_options(config.strategy_options)
            for strategy in self._sequence_strategies:  # the sequences' drafters are built again with the new options
                strategy.options, strategy.policy = self.strategy.options, None
        finally:
            self._gate.release(request)

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
    def _new_run(self, prompt, params: SamplingParams | None, record_margins: bool = False) -> RequestState:
        self._gate.check_usable()
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a paraspec.SamplingParams")
        self.check_params(params)
        stop = frozenset(self.target.eos_token_ids) | frozenset(params.stop_token_ids or ())
        grammar = None
        if params.structured is not None:  # compiled once per (tokenizer, kind, spec); this request's state
            grammar = GrammarMatcher.for_request(self.tokenizer, params.structured, self.target.vocab_size, stop)
        return RequestState(
            prompt_ids=self.encode(prompt),
            params=params,
            stop_ids=stop,
            generator=make_generator(params.seed),
            max_context=self.max_context,
            margins={} if record_margins else None,
            stop_check=stop_string_check(self.tokenizer, params.stop) if params.stop else None,
            grammar=grammar,
        )

    def check_params(self, params: SamplingParams) -> None:
        """Refuse what this Engine cannot honour (a RefusedParameter naming it and the fix; the server calls it
        before queueing):
        a logit bias, a penalty, logprobs or a structured output where the strategy does not apply it, a bias
        beyond the target's ids."""
        asked = {  # the strategy's capability -> the parameter that asks for it (None: not asked)
            "processors": next((n for n in PROCESSOR_PARAMS if getattr(params, n) != getattr(SamplingParams, n)), None),
            "logprobs": next((n for n in ("logprobs", "prompt_logprobs") if getattr(params, n) is not None), None),
            "structured": "structured" if params.structured is not None else None,
        }
        for capability, param in asked.items():
            if param is not None and not getattr(self.strategy.caps, capability):
                accepting = ", ".join(name for name, cls in STRATEGIES.items() if getattr(cls.caps, capability))
                raise RefusedParameter(
                    param, f"strategy {self.strategy.name!r} {REFUSALS[capability]} or use one of {accepting}"
                )
        if params.structured is not None and self.tokenizer is None:
            raise RefusedParameter(
                "structured",
                "structured outputs need the target's tokenizer (its grammar is matched on token text), and this "
                "checkpoint has none; pass a checkpoint folder with its tokenizer files",
            )
        vocab = self.target.vocab_size
        if params.logit_bias is not None and params.logit_bias[-1][0] >= vocab:
            raise RefusedParameter(
                "logit_bias",
                f"logit_bias names token {params.logit_bias[-1][0]}, but the target's vocabulary has {vocab} ids",
            )

    def stream(self, prompt, params: SamplingParams | None = None) -> Stream:
        """A Stream of text deltas as tokens are committed; its `result` once it has ended. The request starts at
        the first next(); close() (or dropping the stream) cancels it. See the module docstring for the ways a
        stream can end early."""
        run = self._new_run(prompt, params)
        request = Request("stream")
        # one request at a time: its strategy's workers are woken to stop (their channels); with several, the flag
        # alone ends it within one round (batching.py: its loop runs in its reader's thread)
        stream = Stream(
            self._stream(run, request),
            request,
            wake=self.strategy.cancel if not self._sequence_strategies else None,
            run=run,
        )
        request.stream = weakref.ref(stream)
        return stream

    def _stream(self, run: RequestState, request: Request) -> Generator[str, None, None]:
        self._gate.acquire(request)
        decoding = self._decode(run, request)
        text, decoder = TextDeltas(run.params.stop or ()), IncrementalText(self.tokenizer)
        start = run.trace.t0 = time.perf_counter()
        try:
            for _ in decoding:
                # the last commit's text decoded whole: a held-back half character may complete a stop string
                delta = text.update(output_text(self.tokenizer, run, None if run.done else decoder), final=run.done)
                if delta:
                    yield delta
        finally:
            decoding.close()
            try:
                request.result = self._finish(run, start)  # closed or cancelled too: the text it had
            finally:
                self._gate.release(request)
        if request.ended_by is not None and run.finish_reason == "cancelled":  # engine.close(), another thread
            raise StreamCancelled(f"{request} was cancelled: {request.ended_by}")
        delta = text.update(request.result.text, final=True)
        if delta:
            yield delta

    def generate(self, prompt, params: SamplingParams | None = None, record_margins: bool = False) -> GenerationResult:
        """Generate a completion. record_margins keeps, for each output index, the target's top-1 minus top-2
        logit as this strategy computed it: where two strategies differ in bf16, it shows a near-tie."""
        run = self._new_run(prompt, params, record_margins)
        request = self._gate.acquire(Request("generate()"))
        decoding = self._decode(run, request)
        try:
            start = run.trace.t0 = time.perf_counter()
            for _ in decoding:
                pass
            request.result = self._finish(run, start)
            return request.result
        finally:
            decoding.close()
            self._gate.release(request)

    def _decode(self, run: RequestState, request: Request) -> Generator[list[int], None, None]:
        """The tokens the strategy commits, a list per commit, until the run is done or the request is cancelled
        (checked after every commit; Engine.cancel() also wakes a strategy blocked on its workers). A dead or stuck
        worker marks the Engine failed until restart_workers(). With several sequences the request decodes on a free
        one, its forwards shared with the other requests' (batching.py); while its reader holds a commit it is idle."""
        strategy, member, batcher = self.strategy, None, self._batcher
        idle: Callable[[], AbstractContextManager] = nullcontext
        if self._sequence_strategies and batcher is not None:  # (a batcher comes with the sequence strategies)
            strategy = self._take_sequence_strategy()
            joined = member = batcher.join(repeatable=not run.params.greedy and run.params.seed is not None)
            for model in (strategy.target, *strategy.draft_models):
                model.member = member
            idle = lambda: batcher.idle(joined)  # noqa: E731
        if run.params.prompt_logprobs is not None:
            run.prompt_logprobs = strategy.score_prompt(run.prompt_ids, run.params.prompt_logprobs)
        decoding = strategy.decode(run)
        try:
            for committed in decoding:
                if request.cancelled.is_set():
                    break
                with idle():
                    yield committed
                if request.cancelled.is_set():
                    break
        except WorkerError as e:
            if not isinstance(e, RemoteError):
                self._gate.failure = e
                e.args = (
                    f"{e}; the Engine's workers must be restarted: call engine.restart_workers() (or "
                    f"create a new Engine)",
                )
            raise
        finally:
            try:
                decoding.close()  # a strategy's own cleanup: stop its loops, collect its workers' reports
            finally:
                if member is not None and batcher is not None:
                    batcher.leave(member)
                    self._give_back_sequence_strategy(strategy)
            if request.cancelled.is_set() and not run.done:
                run.finish_reason = "cancelled"

    def _take_sequence_strategy(self):
        """The strategy of the free sequence with the lowest number: the running ones stay 0, 1, 2, ... (see
        _give_back_sequence_strategy)."""
        with self._sequence_strategies_lock:
            strategy = min((s for s in self._sequence_strategies if not s.in_use), key=lambda s: s.target.sequence_id)
            strategy.in_use = True
            return strategy

    def _give_back_sequence_strategy(self, strategy) -> None:
        """A request left: the running request on the highest sequence moves into its sequence (caches copied, its
        drafters with it), so that the running sequences stay 0, 1, 2, ... and decode in one micro-batch."""
        with self._sequence_strategies_lock:
            strategy.in_use = False
            top = max(
                (s for s in self._sequence_strategies if s.in_use), key=lambda s: s.target.sequence_id, default=None
            )
            if top is not None and top.target.sequence_id > strategy.target.sequence_id and self._batcher is not None:
                self._batcher.move([top.target, *top.draft_models], [strategy.target, *strategy.draft_models])

    def cancel(self) -> bool:
        """Stop every generation in progress (from any thread) within one round; each ends with finish_reason
        "cancelled" (a stream stops yielding). False if nothing was running."""
        running = self._gate.generations()
        for request in running:
            request.cancelled.set()
        if running:
            self.strategy.cancel()
        return bool(running)

    def health(self) -> str | None:
        """Why a request would fail now (closed, a worker failed or is not alive), or None when it would run."""
        with self._gate.cv:
            if self._gate.closed:
                return "the Engine is closed"
            if self._gate.failure is not None:
                return str(self._gate.failure)
        return self.strategy.health()

    @property
    def running(self) -> int:
        """Generations in progress now (the server's /metrics)."""
        return len(self._gate.generations())

    @property
    def batch_stats(self):
        """The Batcher's counters (batching.BatchStats), or None when requests run one at a time."""
        return None if self._batcher is None else self._batcher.stats

    def _finish(self, run: RequestState, start: float) -> GenerationResult:
        total = time.perf_counter() - start
        return GenerationResult(
            output_text(self.tokenizer, run),
            list(run.tokens),
            compute_stats(run, self.strategy.name, total),
            run.trace,
            run.finish_reason or "length",
            run.prompt_ids,
            run.margins,
            run.worker_reports,
            run.logprobs,
            run.prompt_logprobs,
        )

    # -- lifetime ------------------------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """Stop every worker and unlink every shared-memory segment. Idempotent and retryable: a close that was
        interrupted (Ctrl-C) is finished by the next one, by garbage collection or at interpreter exit.
        A generation running in another thread is cancelled first (given `timeout` seconds to end); one this
        thread left open as a stream is closed. Any request afterwards raises EngineClosed."""
        if getattr(self, "strategy", None) is None:  # __init__ failed before the strategy existed
            return
        why = "the Engine was closed (engine.close())"
        gate = self._gate
        with gate.cv:
            gate.closed = True
            active = list(gate.active)
            for request in active:
                request.ended_by = why
        others = False
        for request in active:
            stream = request.open_stream()
            if request.thread == threading.get_ident() and stream is not None:
                stream.end(why)
                gate.release(request)
            else:
                request.cancelled.set()
                others = True
        if others:
            self.strategy.cancel()
            gate.wait_idle(timeout)
        self.strategy.close()
        self._finalizer.detach()

    def __enter__(self) -> Engine:
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
                f"same family or allow_vocab_mismatch=True (--allow-vocab-mismatch)"
            )
        if rows and min(rows) < len(tv):
            raise IncompatibleModelsError(
                f"a model's output layer ({min(rows)} rows) is smaller than its tokenizer ({len(tv)} tokens); the "
                f"checkpoint and tokenizer do not belong together"
            )
    elif len(rows) == 2 and target_rows != draft_rows:
        raise IncompatibleModelsError(
            f"draft and target vocabularies differ ({draft_rows} vs {target_rows}) and there is no "
            f"tokenizer to show they agree; pass a draft from the same family or allow_vocab_mismatch=True"
        )
