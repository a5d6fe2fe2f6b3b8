"""EasySpec (Wu et al. 2025): layer-parallel ("fuzzy") drafting across devices, then bonus calibration.

Each round (Fig. 2 of the paper; drafting and verification alternate):
    1. bonus calibration: the draft drops every KV entry written since the last exact position and runs the
       tokens accepted last round plus the bonus token through its layers in the normal order, in one forward:
       this refills exact KV values and gives the draft distribution at the root;
    2. the draft grows a chain (tree_width 1) or a token tree (strategies/tree.py) with fuzzy forwards: the
       layers of a group read one input hidden state, their attentions run in parallel -- one per device
       (`draft_devices`), all-gathered -- and their MLPs run in order, replicated on every device;
    3. the target verifies the whole tree in one forward, and the path is accepted exactly as in `tree`.

Lossless like every strategy: the fuzzy q is the distribution the drafts were sampled from and the one the
acceptance divides by; only acceptance, not correctness, depends on how close fuzzy is to exact.
With calibration off (the ablation), the accepted tokens keep their fuzzy KV entries and the bonus token
goes through a fuzzy forward as well.

Devices: rank 0 runs in the caller's process with the Engine's draft (and the target, which verifies
with every core of the caller while the draft ranks wait); each further draft device gets a worker (on the
Engine's runtime: a process by default) holding a replica of the draft. Ranks exchange attention outputs through a shared-memory all-gather
(ShmExchange: one segment, a sequence word per rank, futex waits), which beat gloo here
(benchmarks/easyspec_exchange.py).
"""
from __future__ import annotations

import os
import weakref
from contextlib import nullcontext

import torch

from paraspec.drafters import ModelDrafter
from paraspec.models.loader import load_model     # bound at import: a replica never shares a bench's cached model
from paraspec.models.fuzzy import exact_forward, fuzzy_forward, lp_groups, parse_layer_groups
from paraspec.runtime.devices import pinned
from paraspec.runtime.exchange import ShmExchange
from paraspec.strategies.registry import register
from paraspec.strategies.base import Placement
from paraspec.strategies.tree import TreeStrategy


@register
class EasySpec(TreeStrategy):
    name = "easyspec"
    summary = "layer-parallel fuzzy drafting with bonus calibration (EasySpec)"
    options = TreeStrategy.options + ("lp_size", "layer_groups", "calibration")
    runtimes = ("process", "inprocess", "ray")        # where the draft ranks 1.. run
    device_group = None            # DeviceGroupDrafter: started on first use, kept across requests

    def setup(self, placement: Placement) -> None:
        super().setup(placement)
        self.draft_devices, self.runtime_backend = placement.draft_devices, placement.runtime
        self.draft_checkpoint = placement.drafts[0]

    def drafter(self) -> "FuzzyDrafter":
        """One draft device: every group in this process. Several: the attention layers of each group spread
        over them, one rank per device (the ranks' workers are reused while the groups stay the same)."""
        o, draft = self.options, self.drafts[0]
        n_layers = draft.cfg.num_layers
        groups = (parse_layer_groups(o["layer_groups"], n_layers) if o["layer_groups"]
                  else lp_groups(o["lp_size"], n_layers))
        if len(self.draft_devices) < 2:
            return FuzzyDrafter(draft, groups, self.target.vocab_size, o["calibration"])
        if self.device_group is None or self.device_group.groups != groups:
            self.close_device_group()
            self.device_group = DeviceGroupDrafter(draft, groups, self.draft_devices, self.draft_checkpoint,
                                                   self.target.vocab_size, self.runtime_backend)
        self.device_group.calibration = o["calibration"]
        return self.device_group

    def close_device_group(self) -> None:
        if self.device_group is not None:
            self.device_group.close()
            self.device_group = None

    def close(self) -> None:
        self.close_device_group()
        super().close()


class FuzzyDrafter(ModelDrafter):
    """The draft on one device: exact and fuzzy forwards over its own cache.

    root(): the bonus calibration (or, with calibration off, only the first prompt) runs exactly, layer by
    layer; every tree level runs fuzzily; settle() drops every fuzzy entry past the exact prefix (calibration)
    or keeps the accepted path's fuzzy entries (calibration off)."""

    def __init__(self, model, groups: list[list[int]], vocab_size: int | None = None, calibration: bool = True):
        super().__init__(model, model.vocab_size if vocab_size is None else vocab_size)
        self.groups, self.calibration = groups, calibration

    def forward(self, token_ids, positions=None, mask=None, exact: bool = False, head: bool = True):
        if exact:
            return exact_forward(self.model, token_ids, positions, mask)
        return fuzzy_forward(self.model, token_ids, self.groups, positions, mask, head=head)

    def root(self, pending: list[int]) -> torch.Tensor:
        return self.forward(pending, exact=self.calibration or self.length == 0)[-1]

    def expand(self, token_ids, positions, mask) -> torch.Tensor:
        return self.forward(token_ids, positions, mask)

    def settle(self, prefix_len: int, cache, path: list[int]) -> None:
        if self.calibration:
            self.rollback(prefix_len)        # everything past the exact prefix was fuzzy: drop it
        else:
            cache.accept(path)


# -- several devices ------------------------------------------------------------------------------------------

class DraftRank:
    """What a draft worker process holds: a replica of the draft and its end of the exchange."""

    def __init__(self, spec: str, dtype: str, max_context: int, groups: list[list[int]], segment: str,
                 rank: int, world: int, max_bytes: int):
        self.model = load_model(spec, dtype=dtype, max_context=max_context)
        parent = os.getppid()
        self.exchange = ShmExchange.attach(segment, rank, world, max_bytes, alive=lambda: os.getppid() == parent)
        self.groups = groups
        self.vocab_size, self.eos_token_ids, self.max_context = (self.model.vocab_size, self.model.eos_token_ids,
                                                                 self.model.max_context)

    def forward(self, token_ids, positions=None, mask=None, exact: bool = False) -> None:
        mask = None if mask is None else torch.as_tensor(mask)     # arrays travel as numpy
        if exact:
            exact_forward(self.model, token_ids, positions, mask, head=False)
        else:
            fuzzy_forward(self.model, token_ids, self.groups, positions, mask, exchange=self.exchange, head=False)

    def rollback(self, length: int) -> None:
        self.model.rollback(length)

    def keep_path(self, prefix_len: int, slots: list[int]) -> None:
        self.model.keep_path(prefix_len, slots)

    def cache_entries(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` KV entries (tests compare replicas)."""
        return self.model.cache_entries(length)


class DeviceGroupDrafter(FuzzyDrafter):
    """Rank 0 in this process, ranks 1.. in worker processes; every cache operation runs on every rank.

    Each rank computes the attention of its share of each group's layers (group[rank::world]); the calibration
    forward runs whole on every rank (it is sequential, and every rank needs every layer's exact KV).
    While drafting, this process uses one thread on the first draft device; verification gets its usual
    threads and cores back.
    """

    def __init__(self, model, groups, devices, checkpoint, vocab_size: int | None = None, runtime: str = "process"):
        from paraspec.runtime import Runtime
        from paraspec.runtime.devices import parse_devices
        super().__init__(model, groups, vocab_size)
        self.devices = parse_devices(devices)
        if checkpoint is None:
            raise ValueError("easyspec across several draft devices needs the draft's checkpoint "
                             "(draft_checkpoint=...) to load a replica on each device")
        world = len(self.devices)
        per_rank = max(len(g[r::world]) for g in groups for r in range(world))
        self.max_bytes = per_rank * model.max_context * model.cfg.hidden_size * model.dtype.itemsize
        # a tree level or a calibration is much shorter than the context; cap the segment at 64 MiB
        self.max_bytes = min(self.max_bytes, 64 << 20)
        self.exchange = ShmExchange.create(world, self.max_bytes, tag="easyspec")
        self.runtime = Runtime(backend=runtime)
        dtype = str(model.dtype).removeprefix("torch.")
        try:
            for rank, device in enumerate(self.devices[1:], start=1):
                self.runtime.add_worker(f"draft{rank}", device, DraftRank, dict(
                    spec=str(checkpoint), dtype=dtype, max_context=model.max_context, groups=groups,
                    segment=self.exchange.segment.name, rank=rank, world=world, max_bytes=self.max_bytes))
            self.runtime.wait_ready()
        except BaseException:
            self.close()
            raise
        self.workers = [self.runtime[f"draft{r}"] for r in range(1, world)]
        self._finalizer = weakref.finalize(self, _close_group, self.runtime, self.exchange)
        workers = self.workers            # closures below must not hold `self` (the finalizer holds them)
        self.exchange.alive = lambda: all(w.alive for w in workers)

    def _everywhere(self, method: str, *args, **kwargs):
        handles = [w.submit(method, *args, **kwargs) for w in self.workers]
        try:
            return getattr(super(), method)(*args, **kwargs)
        finally:
            for handle in handles:
                handle.result()

    def forward(self, token_ids, positions=None, mask=None, exact: bool = False, head: bool = True):
        handles = [w.submit("forward", token_ids, positions, mask, exact) for w in self.workers]
        # a rank that failed before its all-gather would leave this one waiting: the exchange's liveness
        # check also looks at whether some rank already answered
        workers = self.workers
        self.exchange.alive = lambda: all(w.alive for w in workers) and not any(h.done() for h in handles)
        try:
            if exact:
                out = exact_forward(self.model, token_ids, positions, mask)
            else:
                out = fuzzy_forward(self.model, token_ids, self.groups, positions, mask, exchange=self.exchange,
                                    head=head)
        except RuntimeError:
            for handle in handles:      # raise the rank's own error (RemoteError / WorkerDied) if it has one
                if handle.done():
                    handle.result()
            raise
        for handle in handles:
            handle.result()
        return out

    def rollback(self, length: int) -> None:
        self._everywhere("rollback", length)

    def keep_path(self, prefix_len: int, slots: list[int]) -> None:
        self._everywhere("keep_path", prefix_len, slots)

    def propose_tree(self, *args, **kwargs):
        """While drafting, this process computes rank 0 on the first draft device's cores and threads;
        verification gets its usual threads and cores back."""
        first = self.devices[0]
        with pinned(first) if first.kind == "cpu" else nullcontext():
            return super().propose_tree(*args, **kwargs)

    def close(self) -> None:
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        else:
            _close_group(getattr(self, "runtime", None), getattr(self, "exchange", None))


def _close_group(runtime, exchange) -> None:
    """Stop the draft workers, then unlink the exchange (also when the draft model is garbage-collected)."""
    if runtime is not None:
        runtime.close()
    if exchange is not None and exchange.segment.fd >= 0:
        exchange.close()
