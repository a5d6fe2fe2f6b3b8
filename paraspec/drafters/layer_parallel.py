"""Layer-parallel drafting (EasySpec's "fuzzy" drafting, Wu et al. 2025): the draft's drafters for
strategies/easyspec.py.

    LayerParallelDrafter  the draft on one device: exact and layer-parallel forwards over its own cache; the bonus
                          calibration (root) and what the cache keeps after a round (accept_tree)
    DraftRank             what a draft rank's worker holds: a replica of the draft and its end of the exchange
    DeviceGroupDrafter    rank 0 in the caller, ranks 1.. as workers of the strategy's own Runtime (its watchdog,
                          Engine.health() and cancel() see them); every cache operation runs on every rank

A layer-parallel forward lets the layers of a group read one input hidden state: their attentions run in parallel --
one share per rank, all-gathered through a shared-memory exchange (ShmExchange: one segment, a sequence word per
rank, futex waits; it beat gloo here, benchmarks/easyspec_exchange.py) -- and their MLPs run in order,
replicated on every rank (models/native/layer_parallel.py). q is the layer-parallel distribution the drafts were
sampled from (the q contract), so only acceptance depends on how close it is to the exact one.
"""

from __future__ import annotations

import os
import weakref
from contextlib import nullcontext

import torch

from paraspec.drafters.model import ModelDrafter
from paraspec.models.loader import load_model  # bound at import: a replica never shares a bench's cached model
from paraspec.models.native.layer_parallel import exact_forward, layer_parallel_forward
from paraspec.runtime.devices import pinned
from paraspec.runtime.exchange import ShmExchange


class LayerParallelDrafter(ModelDrafter):
    """The draft on one device: exact and layer-parallel forwards over its own cache.

    root(): the bonus calibration (or, with calibration off, only the first prompt) runs exactly, layer by
    layer; every tree level runs layer-parallel; accept_tree() drops every layer-parallel entry past the exact prefix
    (calibration) or keeps the accepted path's layer-parallel entries (calibration off)."""

    def __init__(self, model, groups: list[list[int]], vocab_size: int | None = None, calibration: bool = True):
        super().__init__(model, model.vocab_size if vocab_size is None else vocab_size)
        self.groups, self.calibration = groups, calibration

    def forward(self, token_ids, positions=None, mask=None, exact: bool = False, head: bool = True):
        if exact:
            return exact_forward(self.model, token_ids, positions, mask)
        return layer_parallel_forward(self.model, token_ids, self.groups, positions, mask, head=head)

    def root(self, pending: list[int]) -> torch.Tensor:
        return self.forward(pending, exact=self.calibration or self.length == 0)[-1]

    def expand(self, token_ids, positions, mask) -> torch.Tensor:
        return self.forward(token_ids, positions, mask)

    def accept_tree(self, prefix_len: int, cache, path: list[int]) -> None:
        if self.calibration:
            self.rollback(prefix_len)  # everything past the exact prefix was layer-parallel: drop it
        else:
            cache.accept(path)


# -- several devices ------------------------------------------------------------------------------------------


class DraftRank:
    """What a draft worker process holds: a replica of the draft and its end of the exchange."""

    def __init__(
        self,
        spec: str,
        dtype: str,
        max_context: int,
        groups: list[list[int]],
        segment: str,
        rank: int,
        world: int,
        max_bytes: int,
        device: str = "cpu",
    ):
        self.model = load_model(spec, dtype=dtype, max_context=max_context, device=device)
        parent = os.getppid()
        self.exchange = ShmExchange.attach(segment, rank, world, max_bytes, alive=lambda: os.getppid() == parent)
        self.groups = groups
        self.vocab_size, self.eos_token_ids, self.max_context = (
            self.model.vocab_size,
            self.model.eos_token_ids,
            self.model.max_context,
        )

    def forward(self, token_ids, positions=None, mask=None, exact: bool = False) -> None:
        mask = None if mask is None else torch.as_tensor(mask)  # arrays travel as numpy
        if exact:
            exact_forward(self.model, token_ids, positions, mask, head=False)
        else:
            layer_parallel_forward(
                self.model, token_ids, self.groups, positions, mask, exchange=self.exchange, head=False
            )

    def set_groups(self, groups: list[list[int]]) -> None:
        self.groups = groups

    def rollback(self, length: int) -> None:
        self.model.rollback(length)

    def keep_path(self, prefix_len: int, slots: list[int]) -> None:
        self.model.keep_path(prefix_len, slots)

    def cache_entries(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` KV entries (tests compare replicas)."""
        return self.model.cache_entries(length)


class DeviceGroupDrafter(LayerParallelDrafter):
    """Rank 0 in this process, ranks 1.. in workers of `runtime` (draft1, draft2, ...: the strategy's Runtime,
    so its watchdog covers them, Engine.health() names a dead one and closing the strategy stops them); every
    cache operation runs on every rank.

    Each rank computes the attention of its share of each group's layers (group[rank::world]); the calibration
    forward runs whole on every rank (it is sequential, and every rank needs every layer's exact KV).
    While drafting, this process uses one thread on the first draft device; verification gets its usual
    threads and cores back.
    """

    def __init__(self, model, groups, devices, checkpoint, runtime, vocab_size: int | None = None):
        from paraspec.runtime.devices import parse_devices

        super().__init__(model, groups, vocab_size)
        self.devices = parse_devices(devices)
        if checkpoint is None:
            raise ValueError(
                "easyspec across several draft devices needs the draft's checkpoint to load a "
                "replica on each device; pass the draft as a checkpoint folder, .gguf or hub id"
            )
        world = len(self.devices)
        # any grouping (set_groups) gives a rank at most ceil(layers / world) attention outputs per all-gather
        per_rank = -(-model.cfg.num_layers // world)
        self.max_bytes = per_rank * model.max_context * model.cfg.hidden_size * model.dtype.itemsize
        # a tree level or a calibration is much shorter than the context; cap the segment at 64 MiB
        self.max_bytes = min(self.max_bytes, 64 << 20)
        self.exchange = ShmExchange.create(world, self.max_bytes, tag="easyspec")
        self._finalizer = weakref.finalize(self, _close_exchange, self.exchange)
        dtype = str(model.dtype).removeprefix("torch.")
        try:
            self.workers = [
                runtime.add_worker(
                    f"draft{rank}",
                    device,
                    DraftRank,
                    dict(
                        spec=str(checkpoint),
                        dtype=dtype,
                        max_context=model.max_context,
                        groups=groups,
                        segment=self.exchange.segment.name,
                        rank=rank,
                        world=world,
                        max_bytes=self.max_bytes,
                        device=device.torch_device,
                    ),
                )
                for rank, device in enumerate(self.devices[1:], start=1)
            ]
            for worker in self.workers:
                worker.wait_ready()
        except BaseException:
            self.close()
            raise
        workers = self.workers  # closures below must not hold `self` (the finalizer holds them)
        self.exchange.alive = lambda: all(w.alive for w in workers)

    def set_groups(self, groups: list[list[int]]) -> None:
        """Regroup the layers on every rank (an option changed between requests)."""
        if groups != self.groups:
            for worker in self.workers:
                worker.call("set_groups", groups)
            self.groups = groups

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
                out = layer_parallel_forward(
                    self.model, token_ids, self.groups, positions, mask, exchange=self.exchange, head=head
                )
        except RuntimeError:
            for handle in handles:  # raise the rank's own error (RemoteError / WorkerDied) if it has one
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
        """Unlink the exchange (also when the drafter is garbage-collected); the rank workers are the Runtime's
        and stop with it."""
        self._finalizer()


def _close_exchange(exchange) -> None:
    if exchange.segment.fd >= 0:
        exchange.close()
