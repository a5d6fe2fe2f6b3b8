"""Engine: one (target, drafts, strategy) setup serving generate() / stream() from any thread.

It connects parts that decide for themselves: EngineConfig (config.py) checks options, devices and drafts;
placement.py resolves checkpoints, chooses the backend, checks vocabularies; request_checks.py refuses or prepares a
request; the RequestGate (gate.py) admits requests, in arrival order, each to a Seat; the Scheduler (scheduler.py)
runs the steps of several at once; the strategy (strategies/base.py) decodes, owning its models and workers.

What callers rely on:
- Up to `max_num_seqs` generations at once where the strategy batches requests (each answer bit-identical to the
  request run alone), else one. Beyond that a request waits its turn (`on_busy="wait"`, at most `wait_timeout` s) or
  raises EngineBusy (`on_busy="error"`) naming the requests holding the Engine and how to end them.
- engine.stream() returns a Stream of text deltas; `stream.result` is its GenerationResult once it has ended. The
  request starts at the first next(), so a stream never iterated holds nothing. How one ends early:
    stream.close() (or dropping it), stream.cancel() (any thread), engine.cancel() (every running one): it ends
        within one round, finish_reason "cancelled"
    a newer request from the thread that left it open, or engine.close(): its next iteration raises
        StreamCancelled naming what ended it (text is never cut short silently)
- A worker that dies or stops answering (WorkerDied, WorkerTimeout) fails every request until restart_workers();
  with `restart_on_fault` (the server) the Engine restarts them itself and the requests in line wait for them.
- close() is idempotent and retryable (also run by garbage collection and at exit); then requests raise EngineClosed.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Generator
from contextlib import closing, nullcontext
from dataclasses import replace

from paraspec.config import EngineConfig
from paraspec.errors import EngineBusy, EngineClosed, IncompatibleModelsError, StreamCancelled
from paraspec.gate import RequestGate
from paraspec.models.loader import load_tokenizer_if_any
from paraspec.placement import check_compatible, check_vocabularies, place
from paraspec.prompts import decode_text, encode_prompt, output_text
from paraspec.request_checks import check_params, new_run
from paraspec.request_state import RequestState
from paraspec.runtime.errors import RemoteError, WorkerError
from paraspec.sampling import SamplingParams
from paraspec.scheduler import Scheduler
from paraspec.streams import GenerationResult, Request, Stream
from paraspec.text_stream import IncrementalText, TextDeltas

__all__ = ["Engine", "EngineBusy", "EngineClosed", "GenerationResult", "IncompatibleModelsError", "Stream"]
__all__ += ["StreamCancelled", "check_compatible"]


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
        """Every argument is an EngineConfig field (config.py says what each does); strategy options (lookahead=5,
        max_ahead=16, ...) are keyword arguments named like their CLI flags, every strategy's listed in
        `paraspec.strategies.OPTIONS`. The ones most asked about: `backend` "auto" (llama.cpp's quantized kernels for
        GGUF-backed models on CPU where the strategy allows them, else the native decoder), "native", "hf" or
        "llamacpp" (docs/LLAMACPP.md); `max_num_seqs` requests decoded at once, their forwards shared, where the
        strategy batches requests (1: one at a time); `on_busy` "wait" (at most `wait_timeout` s) or "error" while
        the Engine is full; `runtime_kind` "process", "inprocess" (threads, for tests) or "ray" for a strategy's
        workers (`ray_address`, `transport`, `link_latency_ms`: docs/SERVING.md); `worker_timeout` seconds a worker
        may go without a sign of life (None: no watchdog); `padded_width` and `compile_step` (native backend,
        models/native/padded.py, docs/GPU.md)."""
        given = {name: value for name, value in locals().items() if name not in ("self", "options")}
        self._start(EngineConfig(options=options, **given))

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        engine = cls.__new__(cls)
        engine._start(config)
        return engine

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        self.target_devices, self.draft_devices = list(config.target_devices), config.used_draft_devices
        # nothing loads and no worker starts before every checkpoint is resolved and the vocabularies agree
        self._placement = place(config)
        self.backend = self._placement.load["backend"]
        self.max_num_seqs: int = self._placement.load.get("n_seqs", 1)
        self._gate = RequestGate(config.on_busy, config.wait_timeout)  # its seats once the models are up (_open)
        self.restart_on_fault, self.restarts = False, 0  # the server restarts the workers after a fault
        self.tokenizer = load_tokenizer_if_any(self._placement.target)
        late = [] if config.allow_vocab_mismatch else check_vocabularies(self._placement, self.tokenizer)
        self._parts: dict = {}  # what close() stops: also on garbage collection and at interpreter exit
        self._finalizer = weakref.finalize(self, _close_parts, self._parts)
        try:
            self._open()
            for i, draft_tokenizer in late:  # an output layer config.json does not state: known once loaded
                check_compatible(
                    self.target.vocab_size, self.draft_models[i].vocab_size, self.tokenizer, draft_tokenizer
                )
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        """The strategy set up (models loaded, workers started) and its seats: with several sequences one per
        sequence, their steps run by a Scheduler; else the strategy's own models."""
        self.strategy = self._parts["strategy"] = self.config.strategy_class(self.config.strategy_options)
        self.strategy.setup(self._placement)
        scheduler = Scheduler(self.strategy.target, self.strategy.draft_models) if self.max_num_seqs > 1 else None
        self.scheduler = self._parts["scheduler"] = scheduler
        self.strategy.start_steps(scheduler.call if scheduler else None)
        self._gate.open(scheduler.seats if scheduler else [self.strategy.seat], scheduler.order if scheduler else None)

    def restart_workers(self, reserved: Request | None = None) -> None:
        """Stop the strategy's workers and start new ones (models reloaded), e.g. after WorkerDied or
        WorkerTimeout; waits for (or, with on_busy="error", refuses during) running generations."""
        request = self._gate.acquire(reserved or Request("restart_workers()", exclusive=True), failed_ok=True)
        try:
            _close_parts(self._parts)
            self._open()
            self._gate.failure = None
            self.restarts += 1
        finally:
            self._gate.release(request)

    def set_options(self, **options) -> None:
        """Change strategy options between requests (the models stay loaded), checked like the Engine's own
        arguments (EngineConfig); EngineBusy while a request runs. The strategy takes them now
        (Strategy.set_options: what it built from the old ones, e.g. every seat's kept drafters, is built again)."""
        config = replace(self.config, options={**self.config.options, **options})
        request = self._gate.claim(Request("set_options()", exclusive=True), "options cannot change")
        self.config = config
        try:
            self.strategy.set_options(config.strategy_options)
        finally:
            self._gate.release(request)

    @property
    def options(self) -> dict:
        """The strategy's options (given values, defaults for the rest); change them with set_options()."""
        return self.strategy.options

    # the models and workers are the strategy's; these name them for callers and tests
    target = property(lambda self: self.strategy.target)
    draft_models = property(lambda self: self.strategy.draft_models)
    draft = property(lambda self: self.strategy.draft_models[0] if self.strategy.draft_models else None)
    runtime = property(lambda self: self.strategy.runtime)

    def encode(self, prompt) -> list[int]:
        """A str (raw text, no template), a list of token ids, or chat messages (chat template applied)."""
        return encode_prompt(prompt, self.tokenizer, self.target.vocab_size, self.max_context)

    def decode_text(self, token_ids: list[int]) -> str:
        return decode_text(self.tokenizer, token_ids)

    @property
    def max_context(self) -> int:
        return min(m.max_context for m in (self.target, *self.draft_models))

    def check_params(self, params: SamplingParams) -> None:
        """Refuse what this Engine cannot honour (a RefusedParameter naming it and the fix; request_checks.py)."""
        check_params(params, self.strategy, self.tokenizer, self.target.vocab_size)

    def stream(self, prompt, params: SamplingParams | None = None) -> Stream:
        """A Stream of text deltas as tokens are committed; its `result` once it has ended. The request starts at
        the first next(); close() (or dropping the stream) cancels it, cancel() from any thread."""
        self._gate.check_usable()
        run = new_run(prompt, params, self.strategy, self.tokenizer, self.max_context)
        request = Request("stream")
        stream = Stream(self._stream(run, request), request, wake=lambda: self._wake(request), run=run)
        request.stream = weakref.ref(stream)
        return stream

    def _wake(self, request: Request) -> None:
        """A cancelled request: out of the line if it waits; a strategy blocked on its workers woken (one request
        at a time; with several the flag alone ends it within one round)."""
        self._gate.notify()
        if self.scheduler is None and request in self._gate.generations():
            self.strategy.cancel()

    def _stream(self, run: RequestState, request: Request) -> Generator[str, None, None]:
        text, decoder = TextDeltas(run.params.stop or ()), IncrementalText(self.tokenizer)
        with closing(self._run(run, request)) as steps:
            for _ in steps:
                # the last commit's text decoded whole: a held-back half character may complete a stop string
                delta = text.update(output_text(self.tokenizer, run, None if run.done else decoder), final=run.done)
                if delta:
                    yield delta
        if request.ended_by is not None and run.finish_reason == "cancelled":  # engine.close(), another thread
            raise StreamCancelled(f"{request} was cancelled: {request.ended_by}")
        delta = text.update(request.result.text if request.result else "", final=True)
        if delta:
            yield delta

    def generate(self, prompt, params: SamplingParams | None = None, record_margins: bool = False) -> GenerationResult:
        """Generate a completion. record_margins keeps, for each output index, the target's top-1 minus top-2
        logit as this strategy computed it: where two strategies differ in bf16, it shows a near-tie."""
        self._gate.check_usable()
        run = new_run(prompt, params, self.strategy, self.tokenizer, self.max_context, record_margins)
        request = Request("generate()")
        with closing(self._run(run, request)) as steps:
            for _ in steps:
                pass
        assert request.result is not None  # set however the run ended
        return request.result

    def _run(self, run: RequestState, request: Request) -> Generator[list[int], None, None]:
        """A request's life: admitted by the gate (in line until then), decoded on its seat (the commits), its
        result set however it ends (done, closed, cancelled: the text it had), its seat let go."""
        if self._gate.acquire(request) is None:  # cancelled while it waited: nothing ran
            run.finish_reason, request.result = "cancelled", self._finish(run, time.perf_counter())
            return
        start = run.trace.t0 = time.perf_counter()
        try:
            yield from self._decode(run, request)
        finally:
            try:
                request.result = self._finish(run, start)
            finally:
                self._gate.release(request)

    def _decode(self, run: RequestState, request: Request) -> Generator[list[int], None, None]:
        """The tokens the strategy commits on the request's seat, a list per commit, until the run is done or the
        request is cancelled (checked after every commit). A dead or stuck worker marks the Engine failed until its
        workers restart. With a Scheduler the request is a member of its steps, idle while its reader holds a commit."""
        scheduler, seat = self.scheduler, request.seat
        repeatable = not run.params.greedy and run.params.seed is not None
        with scheduler.seated(seat, repeatable) if scheduler is not None else nullcontext() as member:
            try:
                if run.params.prompt_logprobs is not None:
                    run.prompt_logprobs = self.strategy.score_prompt(run.prompt_ids, run.params.prompt_logprobs, seat)
                with closing(self.strategy.decode(run, seat)) as decoding:  # closed: the strategy's own cleanup
                    for committed in decoding:
                        if not request.cancelled.is_set():
                            with scheduler.idle(member) if scheduler is not None else nullcontext():
                                yield committed
                        if request.cancelled.is_set():
                            break
            except WorkerError as e:
                if not isinstance(e, RemoteError):  # a dead or stuck worker: the workers must restart
                    self._gate.fail(e, restart=self.restart_workers if self.restart_on_fault else None)
                raise
            finally:
                if request.cancelled.is_set() and not run.done:
                    run.finish_reason = "cancelled"

    def cancel(self) -> bool:
        """Stop every generation in progress (from any thread) within one round; each ends with finish_reason
        "cancelled" (a stream stops yielding). False if nothing was running."""
        return self._gate.cancel_all(wake=self.strategy.cancel)

    def health(self) -> str | None:
        """Why a request would fail now (closed, a worker failed or is not alive), or None when it would run."""
        return self._gate.health() or self.strategy.health()

    restarting = property(lambda self: self._gate.restarting(), doc="a restart of the workers is in line or running")
    running = property(lambda self: len(self._gate.generations()), doc="generations in progress now")
    waiting = property(lambda self: self._gate.waiting(), doc="requests in line for their turn")
    batch_stats = property(lambda self: None if self.scheduler is None else self.scheduler.stats)

    def _finish(self, run: RequestState, start: float) -> GenerationResult:
        return GenerationResult.of(run, output_text(self.tokenizer, run), self.strategy.name, start)

    def close(self, timeout: float = 10.0) -> None:
        """Stop every worker and unlink every shared-memory segment. Idempotent and retryable: a close that was
        interrupted (Ctrl-C) is finished by the next one, by garbage collection or at interpreter exit.
        A generation running in another thread is cancelled first (given `timeout` seconds to end); one this
        thread left open as a stream is closed. Any request afterwards raises EngineClosed."""
        if not getattr(self, "_parts", None):  # __init__ failed before anything started
            return
        self._gate.close("the Engine was closed (engine.close())", timeout, wake=self.strategy.cancel)
        _close_parts(self._parts)
        self._finalizer.detach()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _close_parts(parts: dict) -> None:
    """Stop the scheduler's thread and the strategy (close(), the finalizer: holds the parts, not the Engine)."""
    scheduler = parts.get("scheduler")
    if scheduler is not None:
        scheduler.close()
    strategy = parts.get("strategy")
    if strategy is not None:
        strategy.close()
