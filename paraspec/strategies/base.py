"""What every strategy shares: the Strategy interface the Engine calls and what setup() gets (`Placement`); the
request in flight (`RequestState`) and the rules for committing tokens are in paraspec/request_state.py.

    Strategy.setup(placement)  load the models (here or in workers it starts), open its channels
    Strategy.decode(run, seat) a generator yielding the token ids of each commit, decoding on `seat`'s models
    Strategy.set_options(o)    new options between requests: stored, and what was built from the old ones rebuilt
    Strategy.cancel()          (any thread) wake a decode() blocked on its workers so it ends soon
    Strategy.health()          why a request would fail now because of its workers, or None
    Strategy.close()           stop its workers, unlink its segments, undo its pinning (idempotent, retryable)

The Engine turns the committed tokens into streamed text and, at the end, into stats. Committing goes through
`RequestState.commit`, the one place that enforces stop tokens and `max_new_tokens`, so no strategy can overshoot.
A new strategy subclasses LocalStrategy (models in the caller's process) or Strategy and registers itself with
`paraspec.strategies.register` (a built-in one is also imported by strategies/__init__.py, so that importing
paraspec registers it); the Engine, the config, the CLI and the lossless suite then take it with no other edit.

What a strategy accepts -- no draft, one or several, model-free drafters, runtime kinds, model backends, workers,
nodes -- is one declaration, `caps = Capabilities(...)`; EngineConfig checks every configuration against it generically
(config.py, `capability_asks`) and names the strategies that accept what this one refuses. Its option names,
`option_names`, sit beside it (registry.register checks them against OPTIONS).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from paraspec.request_state import RequestState, TokenLogprob, token_logprob
from paraspec.runtime.devices import Device, apply_device, current_pinning, set_pinning

if TYPE_CHECKING:
    from paraspec.drafters.adaptive import Load
    from paraspec.runtime import Runtime

# -- what a strategy accepts -------------------------------------------------------------------------------------

DRAFT_COUNTS = ("none", "one", "several")
IN_PROCESS = ("process", "inprocess")  # runtime kinds of a strategy that starts no workers: nothing for Ray to place
WITH_RAY = IN_PROCESS + ("ray",)  # and of one that starts workers Ray can place


def _here(fn: Callable[[], Any]) -> Any:
    """fn() on this thread: where the steps run when requests decode one at a time on their own threads."""
    return fn()


@dataclass(frozen=True)
class Capabilities:
    """What a strategy accepts, declared once per strategy (`Strategy.caps`). EngineConfig refuses a configuration
    that asks for more, naming the fix and the strategies that accept it; the bench reads `in_workers`."""

    drafts: str = "one"  # "none" (decodes the target alone), "one" draft, "several" (a list)
    model_free: bool = False  # takes "ngram" / "suffix" (drafters.MODEL_FREE) as drafts
    why_not_model_free: str = ""  # why not, when it does not (the error says it)
    runtime_kinds: tuple[str, ...] = IN_PROCESS  # the runtime_kind= values it honours
    backends: tuple[str, ...] = ("native", "hf", "llamacpp")  # model backends its forwards run on
    in_workers: bool = False  # its models run in pinned workers: the caller's thread count does
    # not apply (the bench's @Nt)
    across_nodes: bool = False  # its workers may sit on other nodes (devices NODE/...)
    why_not_across_nodes: str = "its models run in the caller's process"  # why not, when it may not
    processors: bool = True  # applies a request's logit bias and penalties (SamplingParams.adjusts_logits)
    logprobs: bool = True  # reports each output token's target logprobs (RequestState.observe_target, every row)
    structured: bool = True  # masks the target's rows to SamplingParams.structured's grammar (RequestState.grammar)
    batches: bool = False  # its loop runs in the caller on a Seat's models alone: requests may
    # share forwards (Engine max_num_seqs, scheduler.py; llama.cpp and the native decoder)

    def __post_init__(self):
        if self.drafts not in DRAFT_COUNTS:
            raise ValueError(f"Capabilities(drafts={self.drafts!r}): say {', '.join(map(repr, DRAFT_COUNTS))}")
        if self.model_free and self.drafts == "none":
            raise ValueError("Capabilities(model_free=True) takes drafts: say drafts='one' or 'several'")

    @property
    def needs_draft(self) -> bool:
        """The question most readers ask (the config, the bench, the lossless suite): does it speculate at all."""
        return self.drafts != "none"


# -- the Strategy interface -------------------------------------------------------------------------------------


@dataclass(eq=False)
class Seat:
    """What one request decodes on. Alone: the strategy's own models (`Strategy.seat`). With several requests at once
    (scheduler.py) one Seat per sequence: a view of that sequence of each model, whose forwards the Scheduler runs
    in the step every running request shares; `load`, what each other request brings to that step, and `split`, the
    forwards the model runs a step of such widths as (what the adaptive rule prices a step by). A strategy keeps
    per Seat what must persist across its requests (sd's and tree's drafters: LocalStrategy.kept_policy); the Seat
    itself is never copied or patched."""

    target: Any
    draft_models: list
    load: Callable[[], Load] | None = None  # None: the request has its forwards alone
    split: Callable[[list[int]], list[int]] | None = None  # a step's widths -> its forwards' rows (Scheduler)
    # one of its views -> the (rows, seconds) of the forwards its asks rode in since the last call (Scheduler)
    timed: Callable[[Any], list[tuple[int, float]]] | None = None


@dataclass
class Placement:
    """What the Engine resolved before setup(): the checkpoints, the devices, how to load."""

    target: Any  # a checkpoint folder, or a SimulatedSpec (models/simulated.py)
    draft_specs: list  # DraftSpecs in the order given: resolved checkpoints and model-free names
    target_devices: list[Device]
    draft_devices: list[Device]
    load: dict  # load_model's keyword arguments: dtype, backend, max_context
    runtime_kind: str  # the kind of Runtime: where workers run (runtime/workers.RUNTIME_KINDS)
    worker_timeout: float | None = None  # the workers' watchdog (Runtime's worker_timeout)
    runtime_options: dict = field(default_factory=dict)  # the Runtime's transport, link latency, Ray address

    @property
    def draft_checkpoints(self) -> list:
        """The drafts that are models (not "ngram" / "suffix")."""
        return [d.spec for d in self.draft_specs if not d.model_free]

    @staticmethod
    def loader(spec):
        """load_model for checkpoints; a simulated model builds from its spec (the same signature)."""
        from paraspec.models.simulated import SimulatedSpec, load_simulated

        if isinstance(spec, SimulatedSpec):
            return load_simulated
        from paraspec.models.loader import load_model

        return load_model

    def load_here(self, spec, device: Device, draft: bool = False):
        """`spec` loaded in this process; `draft`: it drafts (llama.cpp runs it on its fastest kernels)."""
        return self.loader(spec)(spec, device=device.torch_device, draft=draft, **self.load)

    def worker_args(self, spec, device: Device, draft: bool = False) -> dict:
        """The factory arguments of a worker building `spec` on `device` (`draft`: as load_here)."""
        from paraspec.models.simulated import SimulatedSpec

        return dict(
            spec=spec if isinstance(spec, SimulatedSpec) else str(spec),
            device=device.torch_device,
            draft=draft,
            **self.load,
        )


class Strategy(abc.ABC):
    """One decoding strategy: owns its models, workers, channels and drafters from setup() to close()."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    caps: ClassVar[Capabilities] = Capabilities()  # what it accepts (above); EngineConfig checks it
    option_names: ClassVar[tuple[str, ...]] = ()  # names in strategies.OPTIONS (composed by subclasses)
    # this strategy's defaults where they differ from the option's own (sd: adaptive=None, auto);
    # registry.option_default reads both
    option_defaults: ClassVar[dict[str, Any]] = {}

    @classmethod  # noqa: B027  (optional hook: most strategies check nothing more)
    def check_config(cls, config) -> None:
        """Checks across options, devices and backend (EngineConfig calls it); raise ValueError naming the fix."""

    def __init__(self, options: dict):
        self.options = options  # the strategy's options, read at each decode()
        # Model protocol (a RemoteModel when it runs in a worker), set by setup(); backends add attributes of their
        # own (exact_width, n_seqs, ...) that strategies read where present
        self.target: Any = None
        self.draft_models: list = []  # the draft models (model-free drafters are not models)
        self.draft_specs: list = []  # every draft as given (DraftSpecs): checkpoints and model-free names, in order
        self.runtime: Runtime | None = None  # the Runtime of its workers, if it has any
        self._own_seat: Seat | None = None

    def set_options(self, options: dict) -> None:
        """New options between requests (Engine.set_options, checked by EngineConfig), read from the next decode()
        on. A strategy that built something from its options at setup() builds it again here."""
        self.options = options

    @abc.abstractmethod
    def setup(self, placement: Placement) -> None:
        """Load the models (set target and drafts) and start whatever workers and channels it needs."""

    def start_steps(self, call: Callable[[Callable[[], Any]], Any] | None = None) -> None:  # noqa: B027 -- a hook
        """The Engine's steps start (after setup()): with `call` None on the requests' own threads, one request at
        a time; else on a Scheduler's thread, where `call(fn)` runs set-up work that runs forwards."""

    @abc.abstractmethod
    def decode(self, run: RequestState, seat: Seat | None = None) -> Generator[list[int], None, None]:
        """Decode one request on `seat`'s models (None: the strategy's own, `self.seat`); yield the tokens of each
        commit (RequestState.commit's return value)."""

    @property
    def seat(self) -> Seat:
        """The strategy's own models as a Seat: where a request decodes when requests run one at a time."""
        own = self._own_seat
        if own is None or own.target is not self.target or own.draft_models != self.draft_models:
            own = self._own_seat = Seat(self.target, list(self.draft_models))  # (re)loaded models: a new seat
        return own

    def make_drafters(self, for_model, models=None) -> list:
        """One entry per draft spec, in order: `for_model(model)` for the next draft model (of `models`, default
        self.draft_models), else the model-free Drafter the spec names."""
        from paraspec.drafters import model_free

        models = iter(self.draft_models if models is None else models)
        return [
            model_free(d.spec, self.target.vocab_size, self.options) if d.model_free else for_model(next(models))
            for d in self.draft_specs
        ]

    def open_runtime(self, placement: Placement) -> Runtime:
        """The Runtime for this strategy's workers (`self.runtime`): of the placement's kind, with its
        worker_timeout watchdog. Every worker a strategy starts goes in it, so Engine.health() sees them,
        cancel() reaches their channels and close() stops them."""
        from paraspec.runtime import Runtime

        self.runtime = Runtime(
            kind=placement.runtime_kind, worker_timeout=placement.worker_timeout, **placement.runtime_options
        )
        return self.runtime

    def cancel(self) -> None:
        """Called from another thread to stop the decode() in progress: the Engine stops pulling its commits
        after the current one; every channel of the strategy's Runtime stops, so the loops in its workers and
        a caller waiting on them end at once."""
        if self.runtime is not None and not self.runtime.closed:
            for channel in self.runtime.channels.values():
                channel.stop("cancelled by the caller")

    def health(self) -> str | None:
        """Why a request would fail now because of this strategy's workers (stopped, or one not alive), or None;
        the Engine's health() and the server's /health say it."""
        if self.runtime is None:
            return None
        if self.runtime.closed:
            return "the Engine's workers are stopped"
        dead = [name for name, worker in self.runtime.workers.items() if not worker.alive]
        if dead:
            return f"worker(s) {', '.join(map(repr, dead))} not alive; restart_workers() starts new ones"
        return None

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()
        self.target, self.draft_models = None, []

    def score_prompt(self, prompt_ids: list[int], n: int, seat: Seat | None = None) -> list[TokenLogprob | None]:
        """Each prompt token's log-probability under the target (`seat`'s) given the tokens before it (the first has
        none), from one forward over the prompt; the cache is emptied after, so decoding starts as it does without."""
        target = (seat or self.seat).target
        target.rollback(0)
        rows = torch.log_softmax(target.forward(list(prompt_ids), last_n=len(prompt_ids)).float(), -1)
        target.rollback(0)
        return [None] + [token_logprob(row, token, n) for row, token in zip(rows[:-1], prompt_ids[1:])]


class LocalStrategy(Strategy):
    """Models loaded in the caller's process, which is pinned to the union of the requested cores until close()
    (when every device is a CPU core set)."""

    _pinning = None

    def __init__(self, options: dict):
        super().__init__(options)
        # the kept drafters (sd, tree: the suffix cache, the learned costs), one DraftPolicy per Seat, persisting
        # across that seat's requests; built from the options
        self.policies: dict[Seat, Any] = {}
        self.cost_tables: dict = {}  # the models' forward costs by width, timed once (make_policy)
        self.on_step_thread: Callable[[Callable[[], Any]], Any] = _here  # runs fn where the steps run (start_steps)
        self.step_rows = 0  # the widest step a verification shares with other requests' rows (0: alone)

    def setup(self, placement: Placement) -> None:
        devices = placement.target_devices + (placement.draft_devices if placement.draft_checkpoints else [])
        cores = sorted({c for d in devices if d.kind == "cpu" for c in d.cores})
        if cores and all(d.kind == "cpu" and d.cores for d in devices) and hasattr(os, "sched_getaffinity"):
            self._pinning = current_pinning()
            apply_device(Device("cpu", cores=tuple(cores)))
        self.target = placement.load_here(placement.target, placement.target_devices[0])
        # with several sequences (placement.load's n_seqs) a verification shares its step with the other requests'
        # rows, up to the target's exact width where its rows may share a forward: the cost table reaches that far
        batched = placement.load.get("n_seqs", 1) > 1
        self.step_rows = self.target.exact_width if batched and self.target.batch_exact else 0
        self.draft_specs = list(placement.draft_specs)
        self.draft_models = [
            placement.load_here(d, placement.draft_devices[0], draft=True) for d in placement.draft_checkpoints
        ]

    def start_steps(self, call: Callable[[Callable[[], Any]], Any] | None = None) -> None:
        """The own seat's kept drafters built now (sd, tree), the models' forwards timed for the adaptive rule on
        the thread that runs the steps: another thread's forwards start an OpenMP pool beside the steps' pool, and
        both are throttled while both exist (docs/LLAMACPP.md, "Threads and OpenMP pools"), pricing every forward too
        high."""
        self.on_step_thread = call or _here
        if type(self).build_policy is not LocalStrategy.build_policy:  # it keeps drafters (sd, tree)
            self.kept_policy()

    def build_policy(self, seat: Seat):
        """A DraftPolicy for `seat` from the options (sd, tree: make_policy with their drafters)."""
        raise NotImplementedError

    def kept_policy(self, seat: Seat | None = None):
        """`seat`'s kept drafters (default: the strategy's own seat): built by start_steps() for its own seat
        (timing the costs), at a seat's first request for the others, and again after set_options()."""
        seat = seat or self.seat
        policy = self.policies.get(seat)
        if policy is None:
            policy = self.policies[seat] = self.build_policy(seat)
        return policy

    @property
    def policy(self):
        """The own seat's kept drafters (requests one at a time), or None before they are built."""
        return self.policies.get(self.seat)

    def set_options(self, options: dict) -> None:
        """The kept drafters were built with the drafters' options (ngram sizes, suffix depth, cache, factor, ...)
        and the adaptive rule's calibration: dropped (every seat's) and the own seat's built again with the new
        options, now rather than in the next request (the suffix cache and the learned costs start afresh)."""
        super().set_options(options)
        if self.policies:
            for policy in self.policies.values():
                policy.close()
            self.policies.clear()
            self.kept_policy()

    def make_policy(self, for_model, widest: int, seat: Seat):
        """`seat`'s kept drafters (`make_drafters` on its draft models) in order; with the `adaptive` option, the
        target's verification widths up to `widest` + 1 (and the widest shared step) and each draft model's forwards
        (its drafts and catch-ups) timed once, at start-up (the own seat's policy, built by start_steps()), not in a
        first request. adaptive=None (auto): the same, the rule standing aside for seeded sampled requests
        (DraftPolicy.begin)."""
        from paraspec.drafters import DraftPolicy
        from paraspec.drafters.adaptive import DRAFT_WIDTHS, calibration_widths

        drafters = self.make_drafters(for_model, seat.draft_models)
        if self.options["adaptive"] is False:
            return DraftPolicy(drafters)
        cost = self.forward_cost("target", self.target, calibration_widths(max(widest, self.step_rows - 1)))
        models = iter(self.draft_models)  # timed on the models themselves, not on a seat's views of them
        draft_costs = {
            i: self.forward_cost(f"draft{i}", next(models), DRAFT_WIDTHS, last_only=True)
            for i, d in enumerate(drafters)
            if not d.free
        }
        policy = DraftPolicy(drafters, cost, draft_costs, auto=self.options["adaptive"] is None)
        policy.load, policy.split, policy.timed, policy.verifier = seat.load, seat.split, seat.timed, seat.target
        own = self.policies.get(self.seat)
        if own is not None and seat is not self.seat:
            # the acceptance estimates are the pair's (and the text's), not a sequence's: every seat reads and adds
            # to the own seat's, so a draft model's trial (its catch-up, its first drafts) is paid once, not once
            # per seat while the others wait in the same steps; the costs stay each seat's (refined apart)
            policy.acceptance = own.acceptance
        return policy

    def forward_cost(self, key: str, model, widths, last_only: bool = False):
        """`model`'s forward cost at `widths` (ForwardCost.measure), timed the first time a policy needs it and then
        copied out of `cost_tables`: each policy refines its own copy (ForwardCost.observe)."""
        from paraspec.drafters.adaptive import ForwardCost

        known = self.cost_tables.get(key)
        if known is None or not set(widths) <= set(known.seconds):
            known = self.cost_tables[key] = self.on_step_thread(
                lambda: ForwardCost.measure(model, widths, last_only=last_only)
            )
        return ForwardCost(dict(known.seconds))

    def close(self) -> None:
        super().close()
        for policy in self.policies.values():
            policy.close()
        self.policies.clear()
        if self._pinning is not None:
            set_pinning(*self._pinning)
            self._pinning = None


class WorkerStrategy(Strategy):
    """Models in workers (one per device group), started on `placement.runtime_kind`."""

    # its workers exchange tokens only through channels: any node will do
    caps = Capabilities(runtime_kinds=WITH_RAY, in_workers=True, across_nodes=True, why_not_across_nodes="")

    def start_workers(self, placement: Placement, workers: list[tuple[str, Any, Device]], drafts=()) -> Runtime:
        """Start one worker per (name, checkpoint, device) and wait until every model is built; the workers named in
        `drafts` hold draft models (load_here's `draft`). Returns the Runtime (`self.runtime`)."""
        from paraspec.runtime import RemoteError

        runtime = self.open_runtime(placement)
        for name, spec, device in workers:
            runtime.add_worker(
                name, device, placement.loader(spec), placement.worker_args(spec, device, draft=name in drafts)
            )
        try:
            runtime.wait_ready()
        except RemoteError as e:  # a bad checkpoint found while loading: raise its own clear error
            raise (e.original if isinstance(e.original, ValueError) else e) from None
        return runtime

    def remote(self, name: str):
        from paraspec.runtime.remote import RemoteModel

        if self.runtime is None:
            raise RuntimeError(f"{self.name}: remote({name!r}) before start_workers()")
        return RemoteModel(self.runtime[name])
