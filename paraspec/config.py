"""EngineConfig: everything that defines an Engine, validated in one place (`__post_init__`) before any model
loads or any worker starts. The Engine, the CLI (`cli.engine_config`) and the bench (`BenchConfig.engine`)
build from it.

What a configuration asks of its strategy (`capability_asks`: a draft or none, several, model-free drafters, the
runtime, devices on nodes, the backend) is checked against the strategy's declared `Capabilities` by one loop
(`check_capabilities`), which names the fix and the strategies that accept it; a new strategy needs no edit here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from paraspec.drafters import DraftSpec
from paraspec.runtime.devices import parse_devices
from paraspec.strategies import OPTIONS, STRATEGIES, get_strategy, option_default
from paraspec.strategies.base import Capabilities

MAX_NUM_SEQS = 64  # llama.cpp's own limit on sequences per context (LLAMA_MAX_SEQ)


@dataclass
class EngineConfig:
    target: Any  # checkpoint folder, .gguf file, hub id (or a SimulatedSpec)
    draft: Any = None  # the same; a list of them for strategies that take several
    strategy: str = "ar"
    dtype: str = "auto"
    target_devices: Any = ("cpu",)  # device strings; parsed into Devices here
    draft_devices: Any = ("cpu",)
    backend: str = "auto"  # models.loader.BACKENDS, or "auto" (resolved here)
    max_context: int = 4096
    allow_vocab_mismatch: bool = False
    runtime_kind: str = "process"  # runtime.workers.RUNTIME_KINDS: where workers run
    options: dict = field(default_factory=dict)  # strategy options by OPTIONS name (only the strategy's own)
    on_busy: str = "wait"  # a request while another runs: "wait" its turn or "error"
    worker_timeout: float | None = 60.0  # seconds without a worker's heartbeat -> WorkerTimeout; None: off
    wait_timeout: float | None = 600.0  # on_busy="wait": seconds a request waits, then EngineBusy; None: no limit
    transport: str = "auto"  # workers' channels: "auto" (shared memory on this host, TCP to
    # another), "shm", or "tcp" (tests, benchmarks)
    ray_address: str | None = None  # runtime_kind="ray": the cluster to join (else RAY_ADDRESS, else local)
    link_latency_ms: float = 0.0  # tests and benchmarks: delay per message on the network transport
    padded_width: Any = "auto"  # native models: pad every forward to this many rows (models/native/padded.py);
    # "auto": measured on CUDA, off on CPU; None: off
    compile_step: bool = False  # native models on a padded width: the step through torch.compile
    max_num_seqs: int = 4  # requests decoded at once where the strategy batches (caps.batches)
    draft_specs: tuple[DraftSpec, ...] = field(init=False, default=())  # `draft` in order, each marked (below)
    model_backend: str = field(init=False, default="")  # `backend` checked; "auto" where the checkpoints
    # decide (the Engine resolves them)

    def __post_init__(self):
        from paraspec.models.loader import BACKENDS as MODEL_BACKENDS
        from paraspec.models.loader import parse_dtype
        from paraspec.runtime.workers import RUNTIME_KINDS

        cls = get_strategy(self.strategy)
        self.draft_specs = tuple(DraftSpec.of(d) for d in as_list(self.draft))
        if self.backend not in MODEL_BACKENDS + ("auto",):
            raise ValueError(f"unknown backend {self.backend!r}; use one of auto, {', '.join(MODEL_BACKENDS)}")
        if self.runtime_kind not in RUNTIME_KINDS:
            raise ValueError(f"unknown runtime kind {self.runtime_kind!r}; choose one of {', '.join(RUNTIME_KINDS)}")
        self.target_devices = tuple(parse_devices(self.target_devices))
        if cls.caps.needs_draft:
            self.draft_devices = tuple(parse_devices(self.draft_devices))
        check_capabilities(self, cls.caps)
        if not isinstance(self.max_context, int) or self.max_context < 2:
            raise ValueError(f"max_context must be an integer >= 2, got {self.max_context!r}")
        unknown = sorted(set(self.options) - set(OPTIONS))
        if unknown:
            raise TypeError(f"unknown Engine option(s) {unknown}; strategy options are {sorted(OPTIONS)}")
        check_strategy_takes(self.strategy, self.options)
        self.options = {name: OPTIONS[name].check(value) for name, value in self.options.items()}
        if self.on_busy not in ("wait", "error"):
            raise ValueError(
                f"on_busy must be 'wait' (a request waits for the running one) or 'error' (it "
                f"raises EngineBusy), got {self.on_busy!r}"
            )
        _check_seconds("worker_timeout", self.worker_timeout, "no watchdog")
        _check_seconds("wait_timeout", self.wait_timeout, "wait as long as it takes")
        if (
            not isinstance(self.max_num_seqs, int)
            or isinstance(self.max_num_seqs, bool)
            or not 1 <= self.max_num_seqs <= MAX_NUM_SEQS
        ):
            raise ValueError(
                f"max_num_seqs must be an integer from 1 to {MAX_NUM_SEQS} (requests decoded at once; "
                f"1: one at a time), got {self.max_num_seqs!r}"
            )
        parse_dtype(self.dtype)
        models = self.draft_checkpoints
        if cls.caps.needs_draft and len(models) > 1 and len(self.draft_devices) not in (1, len(models)):
            raise ValueError(
                f"{len(models)} draft models take one draft device group (shared) or one per "
                f"model, got {len(self.draft_devices)}; pass --draft-devices D0 ... D{len(models) - 1}"
            )
        self._check_placement()
        self.model_backend = self._resolve_backend(cls)
        self._check_padded_width()
        self._check_compile_step()
        cls.check_config(self)

    def _check_placement(self) -> None:
        """Devices on named nodes, the transport and the Ray address: checked together, naming the fix (whether
        the strategy may run across nodes at all is its Capabilities', checked before)."""
        from paraspec.runtime.runtime import check_transport

        check_transport(self.transport, self.link_latency_ms)
        if self.ray_address is not None and self.runtime_kind != "ray":
            raise ValueError(
                f"ray_address applies to runtime_kind='ray' (--runtime-kind ray), "
                f"not runtime_kind={self.runtime_kind!r}"
            )
        on_nodes = self.devices_on_nodes
        if on_nodes and self.runtime_kind != "ray":
            raise ValueError(
                f"device {on_nodes[0]} names a node: place workers on nodes with runtime_kind='ray' "
                "(--runtime-kind ray)"
            )
        if self.transport == "shm" and on_nodes:
            raise ValueError(f"transport='shm' cannot reach workers on other nodes ({on_nodes[0]}); use 'auto'")
        if self.link_latency_ms and self.transport != "tcp" and not on_nodes:
            raise ValueError(
                "link_latency_ms delays messages of the network transport; with every worker on this "
                "host pass transport='tcp' too"
            )

    def _check_compile_step(self) -> None:
        """compile_step fuses the padded step of the native decoder: it needs that step."""
        if not isinstance(self.compile_step, bool):
            raise ValueError(f"compile_step must be True or False, got {self.compile_step!r}")
        if self.compile_step and (self.model_backend not in ("native", "auto") or self.padded_width is None):
            raise ValueError(
                "compile_step=True compiles the native decoder's padded step: use "
                "backend='native' with padded_width=W (or 'auto' on a CUDA device)"
            )

    def _check_padded_width(self) -> None:
        """padded_width is the native decoder's: another backend with a fixed width is an error."""
        from paraspec.models.native.padded import check_width

        self.padded_width = check_width(self.padded_width)
        if isinstance(self.padded_width, int) and self.model_backend != "native":
            raise ValueError(
                f"padded_width={self.padded_width} pads the native decoder's forwards; the "
                f"{self.model_backend} backend runs its own kernels: pass backend='native' "
                f"(--backend native) or leave padded_width='auto'"
            )

    @property
    def runtime_options(self) -> dict:
        """The Runtime's keyword arguments beyond its backend and watchdog."""
        options = dict(transport=self.transport, link_latency_s=self.link_latency_ms / 1000)
        if self.ray_address is not None:
            options["address"] = self.ray_address
        return options

    def _resolve_backend(self, cls) -> str:
        """The backend checked against the dtype (the strategy's backends are its Capabilities', checked before).
        "auto" is "native" where llama.cpp cannot apply; else it stays "auto": the Engine chooses from the
        checkpoints when it resolves them, each once (models.loader.resolve_models). No checkpoint is read here."""
        from paraspec.models.simulated import SimulatedSpec

        models = [self.target] + (self.draft_checkpoints if cls.caps.needs_draft else [])
        backend = self.backend
        if backend == "auto":
            if (
                any(isinstance(m, SimulatedSpec) for m in models)
                or str(self.dtype) != "auto"
                or "llamacpp" not in cls.caps.backends
                or isinstance(self.padded_width, int)
                or self.compile_step
            ):
                return "native"  # a dtype asks for torch weights, a padded width for the native decoder;
                # trees need the native decoder
            return "auto"
        if backend == "llamacpp" and str(self.dtype) != "auto":
            raise ValueError(
                f"dtype={self.dtype!r} does not apply to the llamacpp backend (it runs the GGUF's own "
                f"quantized weights); leave dtype='auto' or use backend='native'"
            )
        return backend

    def for_strategy(self, strategy: str, options: dict | None = None, draft=None) -> EngineConfig:
        """This configuration for another strategy: the given `options` (default: this one's) that it takes,
        and the draft (default: this one's) only if it uses one. The bench builds each variant's Engine this way."""
        cls = get_strategy(strategy)
        options = self.options if options is None else options
        draft = self.draft if draft is None else draft
        return replace(
            self,
            strategy=strategy,
            draft=draft if cls.caps.needs_draft else None,
            options={name: value for name, value in options.items() if name in cls.option_names},
        )

    @property
    def draft_checkpoints(self) -> list:
        """The drafts that are models (checkpoints), without the model-free drafters ("ngram", "suffix")."""
        return [d.spec for d in self.draft_specs if not d.model_free]

    @property
    def devices_on_nodes(self) -> list[str]:
        """The devices the strategy uses that name a node (`NODE/cpu:0`), as written."""
        devices = list(self.target_devices) + (list(self.draft_devices) if self.strategy_class.caps.needs_draft else [])
        return [str(d) for d in devices if d.node]

    @property
    def strategy_class(self):
        return get_strategy(self.strategy)

    @property
    def strategy_options(self) -> dict:
        """The strategy's own options: given values, defaults for the rest."""
        cls = self.strategy_class
        return {name: self.options.get(name, option_default(cls, name)) for name in cls.option_names}

    @property
    def used_draft_devices(self) -> list:
        """The parsed draft devices, or none for a strategy without a draft model."""
        return list(self.draft_devices) if self.strategy_class.caps.needs_draft and self.draft_checkpoints else []


def _check_seconds(name: str, value, none_means: str) -> None:
    if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"{name} must be a number of seconds > 0, or None ({none_means}), got {value!r}")


def check_strategy_takes(strategy: str, options: dict) -> None:
    """Reject options that `strategy` does not take (they would be ignored), naming the strategies that take them."""
    cls = get_strategy(strategy)
    foreign = [name for name in options if name in OPTIONS and name not in cls.option_names]
    if foreign:
        takers = {name: [n for n, s in STRATEGIES.items() if name in s.option_names] for name in foreign}
        taken = "; ".join(f"{name} is taken by {', '.join(t) or 'no strategy'}" for name, t in takers.items())
        raise ValueError(
            f"strategy {strategy!r} does not take option(s) {', '.join(foreign)} ({taken}); its options "
            f"are {', '.join(cls.option_names) or 'none'}"
        )


# -- what a configuration asks of its strategy, checked against the strategy's Capabilities -------------------


class Ask(NamedTuple):
    """One thing a configuration may ask of its strategy."""

    asked: bool  # this configuration asks it
    accepts: Callable[[Capabilities], bool]  # whether a strategy's Capabilities accept it
    refusal: Callable[[Capabilities, str], str]  # what is wrong and the fix, from the refusing strategy's
    # Capabilities and the names of the strategies that accept it


def capability_asks(config: EngineConfig) -> list[Ask]:
    """What `config` asks of its strategy, in the order it is checked."""
    drafts, free = [d.spec for d in config.draft_specs], [d.spec for d in config.draft_specs if d.model_free]
    runtime_kind, backend, on_nodes = config.runtime_kind, config.backend, config.devices_on_nodes
    return [
        Ask(
            not drafts,
            lambda caps: not caps.needs_draft,
            lambda caps, takers: (
                f"needs a draft model; pass draft=... (--draft), or decode the target alone with {takers}"
            ),
        ),
        Ask(
            bool(drafts),
            lambda caps: caps.needs_draft,
            lambda caps, takers: (
                f"decodes the target alone and takes no draft, got {config.draft!r}; drop "
                f"draft=... (--draft) or pick a speculative strategy ({takers})"
            ),
        ),
        Ask(
            len(drafts) > 1,
            lambda caps: caps.drafts == "several",
            lambda caps, takers: (
                f"takes one draft model, got {len(drafts)}; only {takers} takes several (pass --draft once)"
            ),
        ),
        Ask(
            bool(free),
            lambda caps: caps.model_free,
            lambda caps, takers: (
                f"needs a draft model, not {free[0]!r}"
                f"{': ' + caps.why_not_model_free if caps.why_not_model_free else ''}; model-free "
                f"drafters run with {takers}"
            ),
        ),
        Ask(
            True,
            lambda caps: runtime_kind in caps.runtime_kinds,
            lambda caps, takers: (
                f"runs on runtime kind {' or '.join(map(repr, caps.runtime_kinds))}, so runtime_kind={runtime_kind!r} "
                f"does not apply to it; pass runtime_kind={caps.runtime_kinds[0]!r}, or pick a strategy "
                f"that runs on {runtime_kind!r} ({takers})"
            ),
        ),
        Ask(
            bool(on_nodes),
            lambda caps: caps.across_nodes,
            lambda caps, takers: (
                f"cannot run across nodes ({caps.why_not_across_nodes}); give its devices without "
                f"a node, or use {takers} to place workers on nodes"
            ),
        ),
        Ask(
            backend != "auto",
            lambda caps: backend in caps.backends,
            lambda caps, takers: (
                f"runs on the {', '.join(caps.backends)} backend, not {backend!r}; pass "
                f"backend={caps.backends[0]!r} (--backend {caps.backends[0]}), or pick a strategy "
                f"that runs on {backend} ({takers})"
            ),
        ),
    ]


def check_capabilities(config: EngineConfig, caps: Capabilities) -> None:
    """Refuse the first thing `config` asks that its strategy's `caps` do not accept, naming the fix and the
    registered strategies whose Capabilities accept it."""
    for asked, accepts, refusal in capability_asks(config):
        if asked and not accepts(caps):
            takers = ", ".join(name for name, s in STRATEGIES.items() if accepts(s.caps)) or "no strategy"
            raise ValueError(f"strategy {config.strategy!r} {refusal(caps, takers)}")


def as_list(draft) -> list:
    """`draft` as given -- None, one, or a list -- as a list (empty, one, or several)."""
    if draft is None:
        return []
    return list(draft) if isinstance(draft, (list, tuple)) else [draft]
