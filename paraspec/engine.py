"""Engine: owns the models for one (target, draft, strategy) setup and serves generate() / stream().

Everything a user can get wrong is checked here, before the first forward: strategy and options, devices,
checkpoints, tokenizer compatibility, sampling values, prompt length.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from paraspec.models.loader import choose_backend, load_model, load_tokenizer, parse_dtype, resolve_checkpoint
from paraspec.runtime.devices import apply_device, parse_devices, Device
from paraspec.sampling import SamplingParams, make_generator
from paraspec.stats import GenerationStats, compute_stats
from paraspec.strategies import OPTIONS, STRATEGIES, get_strategy
from paraspec.strategies.base import Run
from paraspec.trace import Trace


class IncompatibleModelsError(ValueError):
    pass


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    trace: Trace = field(repr=False)
    finish_reason: str = "length"     # "stop" | "length" | "context"
    prompt_ids: list[int] = field(default_factory=list, repr=False)
    margins: dict[int, float] | None = field(default=None, repr=False)   # see generate(record_margins=...)
    worker_reports: dict = field(default_factory=dict, repr=False)      # raw counters of worker loops


class Engine:
    def __init__(self, target, draft=None, strategy: str = "ar", dtype="auto", target_devices=("cpu",),
                 draft_devices=("cpu",), backend: str = "auto", max_context: int = 4096,
                 allow_vocab_mismatch: bool = False, runtime: str = "process", **options):
        """Strategy options (e.g. lookahead=5, max_ahead=16) are keyword arguments named like their CLI
        flags; every option of every strategy is listed in `paraspec.strategies.OPTIONS`. `runtime` places the
        workers of amusd/dsi: "process" (one process per device group), "inprocess" (threads, for tests),
        "ray" (Ray actors). `backend`: "auto" (llama.cpp's quantized kernels for GGUF-backed models on CPU when
        the strategy allows it, else the native decoder), "native", "hf" or "llamacpp"."""
        self.spec = get_strategy(strategy)
        drafts = list(draft) if isinstance(draft, (list, tuple)) else [] if draft is None else [draft]
        if self.spec.needs_draft and not drafts:
            raise ValueError(f"strategy {strategy!r} needs a draft model; pass draft=... (--draft)")
        if len(drafts) > 1 and not self.spec.several_drafts:
            takes = [name for name, s in STRATEGIES.items() if s.several_drafts]
            raise ValueError(f"strategy {strategy!r} takes one draft model, got {len(drafts)}; only "
                             f"{', '.join(takes)} takes several (pass --draft once)")
        if not isinstance(max_context, int) or max_context < 2:
            raise ValueError(f"max_context must be an integer >= 2, got {max_context!r}")
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TypeError(f"unknown Engine option(s) {unknown}; strategy options are {sorted(OPTIONS)}")
        self.options = {name: OPTIONS[name].check(options.get(name, OPTIONS[name].default))
                        for name in self.spec.options}
        parse_dtype(dtype)
        self.target_devices = parse_devices(target_devices)
        self.draft_devices = parse_devices(draft_devices) if self.spec.needs_draft else []
        if len(drafts) > 1 and len(self.draft_devices) not in (1, len(drafts)):
            raise ValueError(f"{len(drafts)} drafts take one draft device group (shared) or one per draft, got "
                             f"{len(self.draft_devices)}; pass --draft-devices D0 ... D{len(drafts) - 1}")
        self.strategy = strategy
        self.last_result: GenerationResult | None = None
        self.runtime = self.channel = None
        self._unpin = None
        self.target = self.draft = None
        self.drafts = []               # every draft model (several only for dsi); self.draft is the first

        # resolve (and convert, for .gguf) in this process first: bad paths fail before any worker starts
        dtype_of = lambda devices: parse_dtype(dtype, devices[0].torch_device)
        models = [target] + (drafts if self.spec.needs_draft else [])
        backend = self._choose_backend(backend, models, dtype)
        self.backend = backend
        target_dir = _resolve(target, dtype_of(self.target_devices), backend)
        draft_dirs = ([_resolve(d, dtype_of(self.draft_devices), backend) for d in drafts]
                      if self.spec.needs_draft else [])
        draft_dir = draft_dirs[0] if draft_dirs else None
        self._draft_dir = draft_dir
        self.tokenizer = self._maybe_tokenizer(target_dir)
        load = dict(dtype=dtype, backend=backend, max_context=max_context)
        if self.spec.workers:
            self._start_workers(target_dir, draft_dirs, load, runtime)
        else:
            self._pin_in_process(self.target_devices + self.draft_devices)
            self.target = _loader(target_dir)(target_dir, device=self.target_devices[0].torch_device, **load)
            if draft_dir is not None:
                self.draft = _loader(draft_dir)(draft_dir, device=self.draft_devices[0].torch_device, **load)
                self.drafts = [self.draft]
        if not allow_vocab_mismatch:
            try:
                for model, folder in zip(self.drafts, draft_dirs):
                    check_compatible(self.target, model, self.tokenizer, self._maybe_tokenizer(folder))
            except BaseException:
                self.close()
                raise

    def _choose_backend(self, backend: str, models: list, dtype) -> str:
        """The backend every model of this engine runs on ("auto" resolved), or a clear error."""
        if any(_simulated(m) for m in models) or (backend == "auto" and str(dtype) != "auto"):
            return "native"       # a dtype asks for torch weights; simulated models have no backend
        probe = [_resolve(m, parse_dtype("float32"), "auto") for m in models] if backend == "auto" else []
        chosen = choose_backend(backend, probe, self.target_devices + self.draft_devices,
                                trees="llamacpp" not in self.spec.backends)
        if chosen not in self.spec.backends:
            raise ValueError(f"strategy {self.strategy!r} runs on the {', '.join(self.spec.backends)} backend(s), not "
                             f"{chosen!r}; pass backend='native' (--backend native)")
        if chosen == "llamacpp" and str(dtype) != "auto":
            raise ValueError(f"dtype={dtype!r} does not apply to the llamacpp backend (it runs the GGUF's own "
                             f"quantized weights); leave dtype='auto' or use backend='native'")
        return chosen

    def _start_workers(self, target_dir, draft_dirs: list, load: dict, backend: str = "process") -> None:
        """One worker process per model, pinned to its device group, plus one channel per drafter."""
        from paraspec.runtime import RemoteError, Runtime
        from paraspec.runtime.remote import RemoteModel
        from paraspec.strategies.dsi import channel_name, drafter_name
        self.runtime = Runtime(backend=backend)
        try:
            # dsi: one target server per target device (group), target0..N-1; others: one "target"
            targets = ([(f"target{i}", d) for i, d in enumerate(self.target_devices)] if self.spec.target_servers
                       else [("target", self.target_devices[0])])
            # drafters: draft, draft1, ... (several only for dsi), each on its own draft device or all on one
            drafters = [(drafter_name(i), folder, self.draft_devices[min(i, len(self.draft_devices) - 1)])
                        for i, folder in enumerate(draft_dirs)]
            for role, folder, device in [(name, target_dir, d) for name, d in targets] + drafters:
                spec = folder if _simulated(folder) else str(folder)
                self.runtime.add_worker(role, device, _loader(folder),
                                        dict(spec=spec, device=device.torch_device, **load))
            try:
                self.runtime.wait_ready()
            except RemoteError as e:      # a bad checkpoint found while loading: raise its own clear error
                raise (e.original if isinstance(e.original, ValueError) else e) from None
            self.target = RemoteModel(self.runtime[targets[0][0]])
            self.drafts = [RemoteModel(self.runtime[name]) for name, _, _ in drafters]
            self.draft = self.drafts[0]
            channels = [self.runtime.channel(channel_name(i), capacity=self.max_context,
                                             vocab_size=self.target.vocab_size, q_window=64)
                        for i in range(len(drafters))]
            self.channel = channels[0]
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _maybe_tokenizer(folder):
        """The checkpoint's tokenizer, or None for a weights-only checkpoint (token-id prompts still work)."""
        if _simulated(folder) or not any((folder / f).exists() for f in (
                "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
            return None
        return load_tokenizer(folder)

    def _pin_in_process(self, devices: list[Device]) -> None:
        """ar, sd and tree run in the caller's process: pin it to the union of the requested cores, until
        close() puts the previous affinity and thread count back."""
        cores = sorted({c for d in devices if d.kind == "cpu" for c in d.cores})
        if cores and all(d.kind == "cpu" and d.cores for d in devices) and hasattr(os, "sched_getaffinity"):
            self._unpin = (os.sched_getaffinity(0), torch.get_num_threads())
            apply_device(Device("cpu", cores=tuple(cores)))

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
        return min(m.max_context for m in (self.target, self.draft, *self.drafts) if m is not None)

    def decode_text(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    # -- generation ----------------------------------------------------------------------------------------
    def _new_run(self, prompt, params: SamplingParams | None, record_margins: bool = False) -> Run:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError("params must be a paraspec.SamplingParams")
        stop = set(self.target.eos_token_ids) | set(params.stop_token_ids or ())
        return Run(prompt_ids=self.encode(prompt), params=params, stop_ids=frozenset(stop),
                   generator=make_generator(params.seed), max_context=self.max_context,
                   margins={} if record_margins else None)

    def _decode_loop(self, run: Run):
        if self.spec.workers:
            return self.spec.decode(run, self.runtime, self.channel, **self.options)
        placement = {}
        if self.spec.spreads_draft and len(self.draft_devices) > 1:
            placement = dict(draft_devices=[str(d) for d in self.draft_devices],
                             draft_checkpoint=str(self._draft_dir))
        return self.spec.decode(run, self.target, self.draft, **self.options, **placement)

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas as tokens are committed; the full result is then in `engine.last_result`."""
        run = self._new_run(prompt, params)
        start = time.perf_counter()
        run.trace.t0 = start
        text = ""
        for _ in self._decode_loop(run):
            now_text = self.decode_text(self._text_tokens(run))
            if now_text.endswith("\ufffd"):   # an incomplete UTF-8 sequence: wait for the next token
                continue
            if len(now_text) > len(text) and now_text.startswith(text):
                yield now_text[len(text):]
            text = now_text
        result = self._finish(run, start)
        if result.text != text and result.text.startswith(text):
            yield result.text[len(text):]

    @staticmethod
    def _text_tokens(run: Run) -> list[int]:
        return run.tokens[:-1] if run.finish_reason == "stop" else run.tokens

    def generate(self, prompt, params: SamplingParams | None = None,
                 record_margins: bool = False) -> GenerationResult:
        """Generate a completion. record_margins keeps, for each output index, the target's top-1 minus top-2
        logit as this strategy computed it: where two strategies differ in bf16, it shows a near-tie."""
        run = self._new_run(prompt, params, record_margins)
        start = time.perf_counter()
        run.trace.t0 = start
        for _ in self._decode_loop(run):
            pass
        return self._finish(run, start)

    def _finish(self, run: Run, start: float) -> GenerationResult:
        total = time.perf_counter() - start
        self.last_result = GenerationResult(
            self.decode_text(self._text_tokens(run)), list(run.tokens), compute_stats(run, self.strategy, total),
            run.trace, run.finish_reason or "length", run.prompt_ids, run.margins, run.worker_reports)
        return self.last_result

    # -- lifetime ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every worker and unlink every shared-memory segment (idempotent)."""
        if self.runtime is not None:
            self.runtime.close()
        drafter = getattr(self.draft, "_easyspec_drafter", None)   # easyspec's draft replicas on other devices
        if drafter is not None:
            drafter.close()
        if self._unpin:
            affinity, threads = self._unpin
            os.sched_setaffinity(0, affinity)
            torch.set_num_threads(threads)
            self._unpin = None
        self.target = self.draft = None
        self.drafts = []

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _simulated(spec) -> bool:
    from paraspec.models.simulated import SimulatedSpec
    return isinstance(spec, SimulatedSpec)


def _resolve(spec, dtype, backend: str = "native"):
    """A checkpoint folder (resolved and converted here), or a simulated model's spec as it is."""
    return spec if _simulated(spec) else resolve_checkpoint(spec, dtype, backend)


def _loader(spec):
    """load_model for checkpoints; simulated models (models/simulated.py) build from their spec."""
    if _simulated(spec):
        from paraspec.models.simulated import load_simulated
        return load_simulated
    return load_model


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
