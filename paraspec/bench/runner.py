"""The benchmark runner: every strategy on the same prompts, interleaved, after a warm-up.

Each engine (and each transformers baseline) is built once. Then prompt 1 runs on every variant, then prompt 2,
..., so machine drift hits all variants alike; the variant that goes first rotates with the prompt, so none is
always the one that runs right after a thread-count switch. Every variant gets the same prompt token ids.

In-process engines and the transformers baselines share one copy of each model (`shared_model_loads`);
strategies that run in worker processes load their own copies there. The llama.cpp peers run llama-server
processes on the GGUF files (llamacpp_peers.py); llamacpp-spec and llamacpp-ngram pick their draft settings on the
first prompt of each dataset before the warm-up.
"""

from __future__ import annotations

import re
import statistics
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from paraspec.bench.datasets import BenchPrompt, encode_prompt
from paraspec.bench.hf_baselines import HF_STRATEGIES, PROMPT_LOOKUP_TOKENS, HFBaseline, hf_causal_lm
from paraspec.bench.llamacpp_peers import DEFAULT_NGRAM_GRID, DEFAULT_SPEC_GRID, LLAMACPP_STRATEGIES, LlamaCppPeer
from paraspec.bench.metrics import Record, Variant
from paraspec.config import EngineConfig
from paraspec.runtime.devices import current_pinning, set_pinning
from paraspec.sampling import SamplingParams
from paraspec.strategies import STRATEGIES


def runs_in_workers(strategy: str) -> bool:
    """Strategies whose models run in worker processes pinned to their devices: this process's thread count
    does not apply to them."""
    return strategy in STRATEGIES and STRATEGIES[strategy].caps.in_workers


# The drafters a variant may name in brackets: the model-free ones, and `model` = the bench's --draft checkpoint(s).
DRAFTER_NAMES = ("ngram", "suffix", "model")


def split_items(spec: str) -> list[str]:
    """`ar,sd[ngram,model]{adaptive,lookahead=16}@2t` -> ["ar", "sd[ngram,model]{adaptive,lookahead=16}@2t"]: commas
    inside brackets separate drafters, inside braces options."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(spec):
        depth += {"[": 1, "]": -1, "{": 1, "}": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"unbalanced brackets in --strategies {spec!r}; write e.g. sd[ngram,model]")
        if char == "," and depth == 0:
            items.append(spec[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced brackets in --strategies {spec!r}; write e.g. sd[ngram,model]")
    return [item.strip() for item in items + [spec[start:]] if item.strip()]


def parse_drafts(strategy: str, text: str, item: str) -> tuple[str, ...]:
    """The drafters in `sd[ngram,model]`, checked against DRAFTER_NAMES and the strategy."""
    drafts = tuple(d.strip() for d in text.split(","))
    unknown = [d for d in drafts if d not in DRAFTER_NAMES]
    if not drafts or unknown:
        raise ValueError(
            f"bad drafter {(unknown or [''])[0]!r} in {item!r}; name drafters among "
            f"{', '.join(DRAFTER_NAMES)} (model: the --draft checkpoint), e.g. sd[ngram,model]"
        )
    if strategy not in STRATEGIES or not STRATEGIES[strategy].caps.needs_draft:
        takes = [name for name, cls in STRATEGIES.items() if cls.caps.needs_draft]
        raise ValueError(
            f"{strategy} takes no drafters, so {item!r} does not apply; brackets go with {', '.join(takes)}"
        )
    if len(set(drafts)) < len(drafts):
        raise ValueError(f"{item!r} names a drafter twice")
    return drafts


def parse_options(strategy: str, text: str, item: str) -> tuple[tuple[str, object], ...]:
    """The options in `sd{adaptive,lookahead=16}` (a bare name is True), checked against the strategy's options."""
    from paraspec.strategies.registry import OPTIONS

    takes = STRATEGIES[strategy].option_names if strategy in STRATEGIES else ()
    out = []
    for piece in (p.strip() for p in text.split(",")):
        name, _, value = piece.partition("=")
        name = name.strip().replace("-", "_")
        if name not in takes:
            raise ValueError(
                f"bad option {name!r} in {item!r}: {strategy} takes "
                f"{', '.join(takes) or 'no options'} (e.g. sd{{adaptive,lookahead=16}})"
            )
        kind = OPTIONS[name].type
        if not value:
            if kind is not bool:
                raise ValueError(f"{name} in {item!r} needs a value: write {name}=...")
            parsed = True
        elif kind is bool:
            if value.strip() not in ("0", "1", "true", "false"):
                raise ValueError(f"{name}={value} in {item!r}: write {name}, {name}=1 or {name}=0")
            parsed = value.strip() in ("1", "true")
        else:
            try:
                parsed = kind(value.strip())
            except ValueError:
                raise ValueError(
                    f"{name}={value} in {item!r} is not {'an integer' if kind is int else 'a number'}"
                ) from None
        OPTIONS[name].check(parsed)
        out.append((name, parsed))
    return tuple(out)


def parse_variants(spec: str, threads: list[int] | None = None) -> list[Variant]:
    """`ar,sd@2t,sd[ngram,model],hf-assisted` -> variants. A name without `@Nt` runs at every --threads count
    (or, without --threads, at the engine's own thread count); strategies that run in worker processes run once,
    on their devices. `STRATEGY[D1,D2]` gives a strategy its drafters (ngram, suffix, or model: the --draft
    checkpoint) in that order; without brackets it takes --draft as it is. `STRATEGY{adaptive,lookahead=16}` sets
    its own options over the bench's (to compare settings in one interleaved run). `all` is every registered
    paraspec strategy."""
    names = []
    for item in split_items(spec):
        names += list(STRATEGIES) if item == "all" else [item]
    if not names:
        raise ValueError("--strategies is empty; pass e.g. ar,sd,hf-assisted")
    if threads is not None and (not threads or any(not isinstance(t, int) or t < 1 for t in threads)):
        raise ValueError(f"--threads takes positive integers like 1,2, got {threads}")
    known = list(STRATEGIES) + list(HF_STRATEGIES) + list(LLAMACPP_STRATEGIES)
    variants: list[Variant] = []
    for name in names:
        found = re.fullmatch(r"([^\[\]{}@]*)(?:\[([^\]]*)\])?(?:\{([^}]*)\})?(?:@([^\[\]{}@]*))?", name)
        if found is None:
            raise ValueError(
                f"bad variant {name!r} in --strategies; write STRATEGY, STRATEGY@2t, "
                f"STRATEGY[ngram,model]@2t or STRATEGY{{adaptive}}"
            )
        strategy, drafts_text, options_text, suffix = found.groups()
        strategy = strategy.strip()
        if strategy not in known:
            raise ValueError(f"unknown strategy {strategy!r} in --strategies; choose from {', '.join(known)}, all")
        drafts = None if drafts_text is None else parse_drafts(strategy, drafts_text, name)
        options = () if options_text is None else parse_options(strategy, options_text, name)
        if suffix is not None and runs_in_workers(strategy):
            raise ValueError(
                f"{strategy} runs in worker processes on --target-devices/--draft-devices; it takes "
                f"no @Nt thread count (give it devices instead)"
            )
        counts: list[int | None]
        if suffix is not None:
            try:
                count = int(suffix.removesuffix("t"))
            except ValueError:
                raise ValueError(f"bad thread count in {name!r}; write it like {strategy}@2t") from None
            if count < 1:
                raise ValueError(f"bad thread count in {name!r}: it must be >= 1")
            counts = [count]
        else:
            counts = [None] if runs_in_workers(strategy) or not threads else [*threads]
        for n in counts:
            if Variant(strategy, n, drafts, options) not in variants:
                variants.append(Variant(strategy, n, drafts, options))
    return variants


def variant_drafts(variant: Variant, draft) -> str | list | None:
    """The Engine's `draft` for a variant: the bench's --draft (`draft`) without brackets; else the bracket's
    drafters with `model` replaced by the --draft checkpoint(s) — one drafter as itself, several as a list."""
    if variant.drafts is None:
        return draft
    if "model" in variant.drafts and draft is None:
        raise ValueError(f"{variant.name} names the draft model; pass --draft")
    models = list(draft) if isinstance(draft, (list, tuple)) else [draft]
    out = [m for d in variant.drafts for m in (models if d == "model" else [d])]
    return out[0] if len(out) == 1 else out


def interleave(num_prompts: int, variants: list[Variant]) -> list[tuple[int, Variant]]:
    """(prompt index, variant) in run order: every variant finishes prompt i before prompt i+1 starts."""
    n = len(variants)
    return [(i, variants[(i + j) % n]) for i in range(num_prompts) for j in range(n)]


@dataclass
class BenchConfig:
    engine: EngineConfig  # models, devices, options; its strategy is replaced
    variants: list[Variant]  # by each variant's
    params: SamplingParams
    chat: bool | None = None  # None: on when the tokenizer has a chat template
    warmup_tokens: int = 8
    hf_assistant_tokens: int | None = None
    hf_confidence_threshold: float | None = None
    hf_prompt_lookup_tokens: int = PROMPT_LOOKUP_TOKENS  # hf-prompt-lookup: candidates per round
    hf_prompt_lookup_ngram: int | None = None  # and the longest n-gram matched (None: transformers' 2)
    llamacpp_spec_grid: tuple = DEFAULT_SPEC_GRID  # llamacpp-spec's (draft max, p-min) settings to try
    llamacpp_ngram_grid: tuple = DEFAULT_NGRAM_GRID  # llamacpp-ngram's (spec type, n, m) settings to try
    progress: bool = True
    options: dict = field(default_factory=dict)  # strategy options; each variant takes its own


class Contender:
    """One variant's generator with the process state (core affinity, torch threads) it must run under.

    `cores` is its hardware budget: the threads it computes with in this process, or for a strategy in worker
    processes the threads of all its devices together; speedups compare variants of equal budget.
    """

    def __init__(
        self,
        variant: Variant,
        generate,
        devices: str,
        affinity,
        default_threads: int,
        settings: dict | None = None,
        worker_cores: int | None = None,
        tune=None,
    ):
        self.variant, self._generate, self.devices = variant, generate, devices
        self.affinity, self.default_threads, self.settings = affinity, default_threads, settings or {}
        self.worker_cores = worker_cores
        self.tune = tune  # llamacpp-spec/-ngram: pick draft settings on tuning prompts (tune(ids, params))

    @property
    def threads(self) -> int:
        return self.variant.threads or self.default_threads

    @property
    def cores(self) -> int:
        return self.worker_cores or self.threads

    @property
    def threads_label(self) -> str:
        return f"{self.worker_cores} (workers)" if self.worker_cores else str(self.threads)

    def generate(self, prompt_ids: list[int], params: SamplingParams, record_margins: bool):
        set_pinning(self.affinity, self.threads)
        return self._generate(prompt_ids, params, record_margins=record_margins)


@dataclass
class BenchResult:
    dataset: str
    config: BenchConfig
    prompts: list[BenchPrompt]
    prompt_ids: list[list[int]]
    chat: bool
    records: list[Record]
    contenders: dict[str, dict]  # variant name -> devices, threads, settings


@contextmanager
def shared_model_loads():
    """Engines built inside share one Model object per (checkpoint, dtype, backend, context, device).

    Strategies reset the caches at the start of every request, and the benchmark runs one request at a time, so
    sharing is safe; it keeps a benchmark of ar, sd and the transformers baselines at one copy of each model.
    """
    import paraspec.models.loader as loader_module  # strategies load through loader.load_model
    from paraspec.models.loader import parse_dtype, resolve_checkpoint

    original, cache = loader_module.load_model, {}

    def load(
        spec,
        dtype="bfloat16",
        backend="native",
        max_context=None,
        device="cpu",
        padded_width="auto",
        compile_step=False,
        n_seqs=1,
        draft=False,
    ):
        # a hub id and the folder it resolves to are one model; a draft is another (llama.cpp: its fast kernels)
        torch_dtype = parse_dtype(dtype, device)
        key = (
            str(resolve_checkpoint(spec, torch_dtype, backend)),
            torch_dtype,
            backend,
            max_context,
            str(device),
            padded_width,
            compile_step,
            n_seqs,
            draft,
        )
        if key not in cache:
            cache[key] = original(
                spec,
                dtype,
                backend=backend,
                max_context=max_context,
                device=device,
                padded_width=padded_width,
                compile_step=compile_step,
                n_seqs=n_seqs,
                draft=draft,
            )
        return cache[key]

    loader_module.load_model = load
    try:
        yield load
    finally:
        loader_module.load_model = original


def build_contenders(config: BenchConfig) -> tuple[list[Contender], list, int]:
    """Engines and baselines for every variant, each built once; returns them, the engines to close, and the
    smallest context (prompt + new tokens) any of them holds."""
    check_drafts_given(config)
    # one engine per (strategy, drafters), shared by that variant's thread counts; every config is checked
    # before any model loads
    engine_configs = {
        engine_key(v): variant_engine_config(config, v) for v in config.variants if v.strategy in STRATEGIES
    }
    start_affinity, start_threads = current_pinning()
    engines: list = []  # what close() must close
    built: dict[tuple | Variant, dict] = {}  # by engine_key, or by variant (hf and llama.cpp contenders)
    limits = [config.engine.max_context]
    try:
        # worker strategies load their models in their own processes: build them outside the shared loads
        for key in [k for k in engine_configs if runs_in_workers(k[0])]:
            built[key] = _engine_contender(engine_configs[key], engines, limits)
            set_pinning(start_affinity, start_threads)
        with shared_model_loads() as load:
            for key in [k for k in engine_configs if not runs_in_workers(k[0])]:
                built[key] = _engine_contender(engine_configs[key], engines, limits)
                # an in-process engine pins this process to its cores; undo it, or the next engine could not
                # even name the other cores (device parsing checks them against the current affinity)
                set_pinning(start_affinity, start_threads)
            built.update(_hf_contenders(config, load, limits, start_affinity, start_threads))
        for v in [v for v in config.variants if v.strategy in LLAMACPP_STRATEGIES]:
            built[v] = _peer_contender(config, v, start_affinity, engines, limits)
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    return [_contender(v, built, start_affinity) for v in config.variants], engines, min(limits)


def check_drafts_given(config: BenchConfig) -> None:
    """Variants that draft with a model need --draft: said before anything loads."""
    needs_draft = [
        v.name
        for v in config.variants
        if v.strategy in ("hf-assisted", "llamacpp-spec")
        or "model" in (v.drafts or ())
        or (v.strategy in STRATEGIES and STRATEGIES[v.strategy].caps.needs_draft and v.drafts is None)
    ]
    if needs_draft and config.engine.draft is None:
        raise ValueError(f"{', '.join(needs_draft)} need a draft model; pass --draft")


def _hf_contenders(config: BenchConfig, load, limits: list, start_affinity, start_threads) -> dict:
    """transformers' baselines, on the native decoder's weight tensors (the same names) whatever the paraspec
    engines run on, loaded through the bench's shared loads."""
    from paraspec.models.loader import parse_dtype, resolve_checkpoint

    hf_wanted = list(dict.fromkeys(v.strategy for v in config.variants if v.strategy in HF_STRATEGIES))
    if not hf_wanted:
        return {}
    engine = config.engine
    device = _torch_device(engine.target_devices[0])
    torch_dtype = parse_dtype(engine.dtype, device)
    hf_backend = "hf" if engine.backend == "hf" else "native"
    target_model = load(engine.target, engine.dtype, backend=hf_backend, max_context=engine.max_context, device=device)
    limits.append(target_model.max_context)
    target = hf_causal_lm(target_model, resolve_checkpoint(engine.target, torch_dtype))
    draft = None
    if "hf-assisted" in hf_wanted:
        draft_model = load(
            engine.draft,
            engine.dtype,
            backend=hf_backend,
            max_context=engine.max_context,
            device=_torch_device(engine.draft_devices[0]),
        )
        limits.append(draft_model.max_context)
        draft = hf_causal_lm(draft_model, resolve_checkpoint(engine.draft, torch_dtype))
    built = {}
    for name in hf_wanted:
        baseline = HFBaseline(
            name,
            target,
            draft,
            max_context=min(limits),
            num_assistant_tokens=config.hf_assistant_tokens,
            confidence_threshold=config.hf_confidence_threshold,
            prompt_lookup_tokens=config.hf_prompt_lookup_tokens,
            prompt_lookup_ngram=config.hf_prompt_lookup_ngram,
        )
        built[(name, None, ())] = dict(
            generate=baseline.generate,
            devices=f"{device} (in-process, transformers)",
            affinity=start_affinity,
            default_threads=start_threads,
            settings=baseline.settings(),
        )
    return built


def _contender(v: Variant, built: dict, start_affinity) -> Contender:
    """Variant v's contender from what was built for it (its engine's, a baseline's or a peer's)."""
    kwargs = dict(built[v] if v in built else built[engine_key(v)])
    if v.threads is not None:
        # an explicit thread count runs on every core this process may use, not the engine's pinned set
        kwargs["affinity"] = start_affinity
    model_drafts = kwargs.pop("model_drafts", False)  # paraspec engines say it; baselines and peers not
    if kwargs["devices"] is None:  # an in-process engine: its models run where this process does
        kwargs["devices"] = in_process_devices(kwargs["affinity"], model_drafts)
    return Contender(v, **kwargs)


def in_process_devices(cores, model_drafts: bool) -> str:
    """`cpu:0,1 (in-process, target and draft)`: the cores an in-process variant runs on (all its models, one
    after the other, with its thread count)."""
    from paraspec.runtime.devices import Device, available_cores

    where = str(Device("cpu", tuple(sorted(cores or available_cores()))))
    return f"{where} (in-process{', target and draft' if model_drafts else ''})"


def engine_key(variant: Variant) -> tuple:
    """Variants with the same key share one engine (or baseline): they differ in thread count only (their own
    options, `sd{adaptive}`, make another engine)."""
    return variant.strategy, variant.drafts, variant.options


def variant_engine_config(config: BenchConfig, variant: Variant) -> EngineConfig:
    """The bench's EngineConfig for the variant's strategy (with the options it takes) and drafters (validated
    here, before loading)."""
    needs_draft = STRATEGIES[variant.strategy].caps.needs_draft
    # a bracket naming only model-free drafters needs no --draft: the variant's drafts go in before the check;
    # one sequence: the bench times one request at a time (its variants share the loaded models)
    engine = replace(
        config.engine.for_strategy(
            variant.strategy,
            {**config.options, **dict(variant.options)},
            variant_drafts(variant, config.engine.draft) if needs_draft else None,
        ),
        max_num_seqs=1,
    )
    return replace(engine, **variant_cpu_devices(engine, variant))


def variant_cpu_devices(engine: EngineConfig, variant: Variant) -> dict:
    """An in-process variant with a thread count (`sd@2t`) runs with that many threads on this process's cores,
    not on --target-devices (meant for the worker strategies): its engine is built on as many of those cores,
    since what the engine measures at start-up — the adaptive rule's costs by width — must be measured with the
    threads the variant decodes with (a 1-thread profile is steeper than a 2-thread one). GPUs and nodes stay."""
    from paraspec.runtime.devices import Device, available_cores, parse_device

    if variant.threads is None or runs_in_workers(variant.strategy):
        return {}
    # (a config without a draft model leaves its draft devices unparsed)
    devices = [parse_device(d) for d in [*engine.target_devices, *engine.draft_devices]]
    if any(d.kind != "cpu" or d.node for d in devices):
        return {}
    cores = sorted(current_pinning()[0] or available_cores())
    here = [str(Device("cpu", tuple(cores[: variant.threads])))]
    return dict(target_devices=here, draft_devices=here)


def _engine_contender(engine_config: EngineConfig, engines: list, limits: list) -> dict:
    from paraspec.engine import Engine
    from paraspec.models.loader import parse_dtype

    strategy = engine_config.strategy
    engine = Engine.from_config(engine_config)
    engines.append(engine)
    limits.append(engine.max_context)
    devices = None  # in-process: where the variant runs (build_contenders)
    if runs_in_workers(strategy):
        devices = f"target {' '.join(map(str, engine.target_devices))}"
        if engine.draft_devices:
            devices += f", draft {' '.join(map(str, engine.draft_devices))}"
    settings = dict(engine.options)
    settings["backend"] = engine.backend
    settings["draft"] = (
        [str(d.spec) for d in engine_config.draft_specs] if engine_config.strategy_class.caps.needs_draft else []
    )
    settings["dtype"] = (
        "gguf"
        if engine.backend == "llamacpp"
        else _dtype_name(engine.target)
        or str(parse_dtype(engine_config.dtype, engine.target_devices[0].torch_device)).removeprefix("torch.")
    )
    return dict(
        generate=engine.generate,
        devices=devices,
        model_drafts=bool(engine.draft_devices),
        affinity=current_pinning()[0],
        default_threads=torch.get_num_threads(),
        settings=settings,
        worker_cores=_cores(engine.target_devices + engine.draft_devices) if runs_in_workers(strategy) else None,
    )


def _peer_contender(config: BenchConfig, variant: Variant, start_affinity, closers: list, limits: list) -> dict:
    """A llama.cpp peer (one llama-server per variant): on every core this process may use with the variant's
    thread count, as ar@Nt; without @Nt, on the target's first device with one thread per core."""
    from paraspec.runtime.devices import parse_device

    if variant.threads is not None:
        cores, threads = start_affinity, variant.threads
    else:
        device = parse_device(config.engine.target_devices[0])
        if device.kind != "cpu":
            raise ValueError(f"{variant.strategy} runs on CPU cores; --target-devices {device} is not a CPU")
        cores, threads = device.cores or start_affinity, device.num_threads
    peer = LlamaCppPeer(
        variant.strategy,
        config.engine.target,
        config.engine.draft,
        threads=threads,
        cores=cores,
        max_context=config.engine.max_context,
        spec_grid=config.llamacpp_spec_grid,
        ngram_grid=config.llamacpp_ngram_grid,
    )
    closers.append(peer)
    limits.append(peer.max_context)
    return dict(
        generate=peer.generate,
        devices=peer.devices,
        affinity=start_affinity,
        default_threads=threads,
        settings=peer.settings,
        tune=peer.tune,
    )


def _cores(devices) -> int:
    """Cores (CPU) or GPUs that a set of devices spans together."""
    from paraspec.runtime.devices import available_cores

    cpu = {c for d in devices if d.kind == "cpu" for c in (d.cores or available_cores())}
    gpus = {d.index for d in devices if d.kind != "cpu"}
    return len(cpu) + len(gpus)


def _dtype_name(model) -> str | None:
    """The dtype of an in-process model's weights (None for a model in a worker process)."""
    dtype = getattr(model, "dtype", None)
    if dtype is None:
        module = getattr(model, "decoder", None) or getattr(model, "model", None)
        dtype = next(module.parameters()).dtype if isinstance(module, torch.nn.Module) else None
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def _torch_device(text) -> str:
    from paraspec.runtime.devices import parse_device

    return parse_device(text).torch_device


def run_benchmark(config: BenchConfig, prompt_sets: dict[str, list[BenchPrompt]], tokenizer) -> dict[str, BenchResult]:
    """Build every contender once, warm each up, then run each dataset's prompts interleaved."""
    from paraspec.bench.datasets import resolve_chat

    if tokenizer is None:
        raise ValueError("the benchmark needs the target's tokenizer to build prompts; the checkpoint has none")
    chat = resolve_chat(config.chat, tokenizer)
    for prompts in prompt_sets.values():  # fail on a bad prompt before loading any model
        for p in prompts:
            if p.answer_of is None or not chat:
                p.as_input(chat)
    start = current_pinning()
    contenders, engines, context = build_contenders(config)
    try:
        first = next(iter(prompt_sets.values()))[0]
        warmup = SamplingParams(
            temperature=config.params.temperature,
            top_k=config.params.top_k,
            top_p=config.params.top_p,
            seed=config.params.seed,
            max_new_tokens=max(1, min(config.warmup_tokens, config.params.max_new_tokens)),
        )
        warmup_ids = encode_prompt(tokenizer, first.as_input(chat))[: max(1, context - warmup.max_new_tokens)]
        tuning_ids = [encode_prompt(tokenizer, prompts[0].as_input(chat)) for prompts in prompt_sets.values()]
        for c in contenders:
            if c.tune is not None:
                c.tune(
                    [ids[: max(1, context - config.params.max_new_tokens)] for ids in tuning_ids],
                    config.params,
                    progress=_note if config.progress else None,
                )
        for c in contenders:
            c.generate(warmup_ids, warmup, record_margins=config.params.greedy)
        return {
            name: _run(config, prompts, tokenizer, chat, contenders, name, context)
            for name, prompts in prompt_sets.items()
        }
    finally:
        for engine in engines:
            engine.close()
        set_pinning(*start)


def _run(config, prompts, tokenizer, chat, contenders, dataset: str, context: int) -> BenchResult:
    params, greedy = config.params, config.params.greedy
    answer_source = next((c for c in contenders if c.variant.strategy == "ar"), contenders[0])
    by_variant = {c.variant: c for c in contenders}
    answers: dict[str, str] = {}
    prompt_ids: list[list[int]] = []

    def ids_for(i: int) -> list[int]:
        while len(prompt_ids) <= i:
            p = prompts[len(prompt_ids)]
            ids = encode_prompt(tokenizer, p.as_input(chat, answers))
            if len(ids) + params.max_new_tokens > context:
                # every variant must be able to generate the full budget, or their token counts would differ
                raise ValueError(
                    f"prompt {p.id} has {len(ids)} tokens; with --max-new-tokens "
                    f"{params.max_new_tokens} it needs a context of {len(ids) + params.max_new_tokens}"
                    f", but the models hold {context} (raise --max-context, up to the model's limit, "
                    f"or lower --max-new-tokens)"
                )
            prompt_ids.append(ids)
        return prompt_ids[i]

    schedule = interleave(len(prompts), [c.variant for c in contenders])
    bar = _progress_bar(len(schedule), config.progress, dataset)
    records: list[Record] = []
    try:
        for i, variant in schedule:
            c = by_variant[variant]
            ids = ids_for(i)
            result = c.generate(ids, params, record_margins=greedy)
            text_tokens = result.token_ids[:-1] if result.finish_reason == "stop" else result.token_ids
            record = Record(
                variant,
                i,
                prompts[i].id,
                len(ids),
                list(result.token_ids),
                tokenizer.decode(text_tokens, skip_special_tokens=True),
                result.finish_reason,
                result.stats,
                result.trace,
                result.margins,
            )
            records.append(record)
            if c is answer_source:
                answers[prompts[i].id] = record.text
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(_running_ms(records, contenders), refresh=True)
    finally:
        if bar is not None:
            bar.close()
    info = {
        c.variant.name: {
            "strategy": c.variant.strategy,
            "devices": c.devices,
            "threads": c.threads_label,
            "cores": c.cores,
            "dtype": c.settings.get("dtype", "?"),
            "settings": c.settings,
        }
        for c in contenders
    }
    return BenchResult(dataset, config, prompts, prompt_ids, chat, records, info)


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _running_ms(records: list[Record], contenders: list[Contender]) -> str:
    """`ar@1t 312 | sd@1t 240 ms/tok`: the running median ms/token per variant, for the progress bar."""
    parts = []
    for c in contenders:
        ms = [r.stats.ms_per_token for r in records if r.variant == c.variant]
        if ms:
            parts.append(f"{c.variant.name} {statistics.median(ms):.0f}")
    return " | ".join(parts) + " ms/tok"


def _progress_bar(total: int, enabled: bool, dataset: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=dataset, unit="run", file=sys.stderr, dynamic_ncols=True)
