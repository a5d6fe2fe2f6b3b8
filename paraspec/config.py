"""EngineConfig: everything that defines an Engine, validated in one place (`__post_init__`) before any model
loads or any worker starts. The Engine, the CLI (`cli.engine_config`) and the bench (`BenchConfig.engine`)
build from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from paraspec.drafters import DraftSpec
from paraspec.runtime.devices import parse_devices
from paraspec.strategies import OPTIONS, STRATEGIES, get_strategy


@dataclass
class EngineConfig:
    target: Any                                   # checkpoint folder, .gguf file, hub id (or a SimulatedSpec)
    draft: Any = None                             # the same; a list of them for strategies that take several
    strategy: str = "ar"
    dtype: str = "auto"
    target_devices: Any = ("cpu",)                # device strings; parsed into Devices here
    draft_devices: Any = ("cpu",)
    backend: str = "auto"                         # models.loader.BACKENDS, or "auto" (resolved here)
    max_context: int = 4096
    allow_vocab_mismatch: bool = False
    runtime: str = "process"                      # runtime.workers.BACKENDS: where workers run
    options: dict = field(default_factory=dict)   # strategy options by OPTIONS name (only the strategy's own)
    on_busy: str = "wait"                         # a request while another runs: "wait" its turn or "error"
    worker_timeout: float | None = 60.0           # seconds without a worker's heartbeat -> WorkerTimeout; None: off
    wait_timeout: float | None = None             # on_busy="wait": seconds a request waits, then EngineBusy; None: no limit
    transport: str = "auto"                       # workers' channels: "auto" (shared memory on this host, TCP to
                                                  # another), "shm", or "tcp" (tests, benchmarks)
    ray_address: str | None = None                # runtime="ray": the cluster to join (else RAY_ADDRESS, else local)
    link_latency_ms: float = 0.0                  # tests and benchmarks: delay per message on the network transport
    static_width: Any = "auto"                    # native models: pad every forward to this many rows (models/static.py);
                                                  # "auto": measured on CUDA, off on CPU; None: off
    draft_specs: tuple[DraftSpec, ...] = field(init=False, default=())   # `draft` in order, each marked (below)
    model_backend: str = field(init=False, default="")   # `backend` with "auto" resolved for this strategy

    def __post_init__(self):
        from paraspec.models.loader import BACKENDS as MODEL_BACKENDS, parse_dtype
        from paraspec.runtime.workers import BACKENDS as RUNTIMES
        cls = get_strategy(self.strategy)
        drafts = self.drafts
        self.draft_specs = tuple(DraftSpec.of(d) for d in drafts)
        if cls.needs_draft and not drafts:
            raise ValueError(f"strategy {self.strategy!r} needs a draft model; pass draft=... (--draft)")
        if drafts and not cls.needs_draft:
            raise ValueError(f"strategy {self.strategy!r} decodes the target alone and takes no draft, got "
                             f"{self.draft!r}; drop draft=... (--draft) or pick a speculative strategy "
                             f"({', '.join(n for n, s in STRATEGIES.items() if s.needs_draft)})")
        if len(drafts) > 1 and not cls.several_drafts:
            takes = [name for name, s in STRATEGIES.items() if s.several_drafts]
            raise ValueError(f"strategy {self.strategy!r} takes one draft model, got {len(drafts)}; only "
                             f"{', '.join(takes)} takes several (pass --draft once)")
        free = [d.spec for d in self.draft_specs if d.model_free]
        if free and not cls.model_free_drafts:
            takes = [name for name, s in STRATEGIES.items() if s.model_free_drafts]
            raise ValueError(f"strategy {self.strategy!r} needs a draft model, not {free[0]!r}"
                             f"{': ' + cls.no_model_free_reason if cls.no_model_free_reason else ''}; model-free "
                             f"drafters run with {', '.join(takes)}")
        if not isinstance(self.max_context, int) or self.max_context < 2:
            raise ValueError(f"max_context must be an integer >= 2, got {self.max_context!r}")
        unknown = sorted(set(self.options) - set(OPTIONS))
        if unknown:
            raise TypeError(f"unknown Engine option(s) {unknown}; strategy options are {sorted(OPTIONS)}")
        check_strategy_takes(self.strategy, self.options)
        self.options = {name: OPTIONS[name].check(value) for name, value in self.options.items()}
        if self.on_busy not in ("wait", "error"):
            raise ValueError(f"on_busy must be 'wait' (a request waits for the running one) or 'error' (it "
                             f"raises EngineBusy), got {self.on_busy!r}")
        _check_seconds("worker_timeout", self.worker_timeout, "no watchdog")
        _check_seconds("wait_timeout", self.wait_timeout, "wait as long as it takes")
        parse_dtype(self.dtype)
        if self.backend not in MODEL_BACKENDS + ("auto",):
            raise ValueError(f"unknown backend {self.backend!r}; use one of auto, {', '.join(MODEL_BACKENDS)}")
        if self.runtime not in RUNTIMES:
            raise ValueError(f"unknown runtime {self.runtime!r}; choose one of {', '.join(RUNTIMES)}")
        if self.runtime not in cls.runtimes:
            raise ValueError(f"strategy {self.strategy!r} runs its models in this process and starts no workers, so "
                             f"runtime={self.runtime!r} does not apply to it; pass runtime='process' (the default), "
                             f"or pick a strategy that runs workers "
                             f"({', '.join(n for n, s in STRATEGIES.items() if self.runtime in s.runtimes)})")
        self.target_devices = tuple(parse_devices(self.target_devices))
        if cls.needs_draft:
            self.draft_devices = tuple(parse_devices(self.draft_devices))
            models = self.model_drafts
            if len(models) > 1 and len(self.draft_devices) not in (1, len(models)):
                raise ValueError(f"{len(models)} draft models take one draft device group (shared) or one per "
                                 f"model, got {len(self.draft_devices)}; pass --draft-devices D0 ... "
                                 f"D{len(models) - 1}")
        self._check_placement(cls)
        self.model_backend = self._resolve_backend(cls)
        self._check_static_width()
        cls.check_config(self)

    def _check_placement(self, cls) -> None:
        """Devices on named nodes, the transport and the Ray address: checked together, naming the fix."""
        from paraspec.runtime.runtime import check_transport
        check_transport(self.transport, self.link_latency_ms)
        if self.ray_address is not None and self.runtime != "ray":
            raise ValueError(f"ray_address applies to runtime='ray' (--runtime ray), not runtime={self.runtime!r}")
        devices = list(self.target_devices) + (list(self.draft_devices) if cls.needs_draft else [])
        on_nodes = [str(d) for d in devices if d.node]
        if on_nodes and not cls.across_nodes:
            raise ValueError(f"strategy {self.strategy!r} cannot run across nodes ({cls.across_nodes_reason}); "
                             f"give its devices without a node, or use amusd or dsi to place workers on nodes")
        if on_nodes and self.runtime != "ray":
            raise ValueError(f"device {on_nodes[0]} names a node: place workers on nodes with runtime='ray' "
                             f"(--runtime ray)")
        if self.transport == "shm" and on_nodes:
            raise ValueError(f"transport='shm' cannot reach workers on other nodes ({on_nodes[0]}); use 'auto'")
        if self.link_latency_ms and self.transport != "tcp" and not on_nodes:
            raise ValueError("link_latency_ms delays messages of the network transport; with every worker on this "
                             "host pass transport='tcp' too")

    def _check_static_width(self) -> None:
        """static_width is the native decoder's: another backend with a fixed width is an error."""
        from paraspec.models.static import check_width
        self.static_width = check_width(self.static_width)
        if isinstance(self.static_width, int) and self.model_backend != "native":
            raise ValueError(f"static_width={self.static_width} pads the native decoder's forwards; the "
                             f"{self.model_backend} backend runs its own kernels: pass backend='native' "
                             f"(--backend native) or leave static_width='auto'")

    @property
    def runtime_options(self) -> dict:
        """The Runtime's keyword arguments beyond its backend and watchdog."""
        options = dict(transport=self.transport, link_latency_s=self.link_latency_ms / 1000)
        if self.ray_address is not None:
            options["address"] = self.ray_address
        return options

    def _resolve_backend(self, cls) -> str:
        """"auto" made concrete, and the backend checked against the strategy and the dtype."""
        from paraspec.models.loader import CheckpointError, choose_backend, resolve_checkpoint
        from paraspec.models.simulated import SimulatedSpec
        models = [self.target] + (self.model_drafts if cls.needs_draft else [])
        backend = self.backend
        if backend == "auto":
            if any(isinstance(m, SimulatedSpec) for m in models) or str(self.dtype) != "auto" \
                    or "llamacpp" not in cls.backends:
                return "native"      # a dtype asks for torch weights; trees need the native decoder
            try:
                folders = [resolve_checkpoint(m, backend="auto") for m in models]   # never converts weights
            except CheckpointError:
                return "native"      # the Engine reports the bad checkpoint where it resolves it
            devices = list(self.target_devices) + list(self.draft_devices if cls.needs_draft else [])
            return choose_backend("auto", folders, devices, trees=False)
        if backend not in cls.backends:
            raise ValueError(f"strategy {self.strategy!r} runs on the {', '.join(cls.backends)} backend, not "
                             f"{backend!r}; pass backend='native' (--backend native)")
        if backend == "llamacpp" and str(self.dtype) != "auto":
            raise ValueError(f"dtype={self.dtype!r} does not apply to the llamacpp backend (it runs the GGUF's own "
                             f"quantized weights); leave dtype='auto' or use backend='native'")
        return backend

    def for_strategy(self, strategy: str, options: dict | None = None, draft=None) -> "EngineConfig":
        """This configuration for another strategy: the given `options` (default: this one's) that it takes,
        and the draft (default: this one's) only if it uses one. The bench builds each variant's Engine this way."""
        cls = get_strategy(strategy)
        options = self.options if options is None else options
        draft = self.draft if draft is None else draft
        return replace(self, strategy=strategy, draft=draft if cls.needs_draft else None,
                       options={name: value for name, value in options.items() if name in cls.options})

    @property
    def drafts(self) -> list:
        """The draft models as a list (empty, one, or several)."""
        if self.draft is None:
            return []
        return list(self.draft) if isinstance(self.draft, (list, tuple)) else [self.draft]

    @property
    def model_drafts(self) -> list:
        """The drafts that are models (checkpoints), without the model-free drafters ("ngram", "suffix")."""
        return [d.spec for d in self.draft_specs if not d.model_free]

    @property
    def strategy_class(self):
        return get_strategy(self.strategy)

    @property
    def strategy_options(self) -> dict:
        """The strategy's own options: given values, defaults for the rest."""
        return {name: self.options.get(name, OPTIONS[name].default) for name in self.strategy_class.options}

    @property
    def used_draft_devices(self) -> list:
        """The parsed draft devices, or none for a strategy without a draft model."""
        return list(self.draft_devices) if self.strategy_class.needs_draft and self.model_drafts else []


def _check_seconds(name: str, value, none_means: str) -> None:
    if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"{name} must be a number of seconds > 0, or None ({none_means}), got {value!r}")


def check_strategy_takes(strategy: str, options: dict) -> None:
    """Reject options that `strategy` does not take (they would be ignored), naming the strategies that take them."""
    cls = get_strategy(strategy)
    foreign = [name for name in options if name in OPTIONS and name not in cls.options]
    if foreign:
        takers = {name: [n for n, s in STRATEGIES.items() if name in s.options] for name in foreign}
        taken = "; ".join(f"{name} is taken by {', '.join(t) or 'no strategy'}" for name, t in takers.items())
        raise ValueError(f"strategy {strategy!r} does not take option(s) {', '.join(foreign)} ({taken}); its options "
                         f"are {', '.join(cls.options) or 'none'}")
