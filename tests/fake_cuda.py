"""Tensors that say they are on cuda:0 while computing on the CPU: device checks on a machine without a GPU.

Inside `with fake_cuda() as device:`, `device.tensor(t)` (or any factory given device="cuda") makes such a tensor,
and every op checks its arguments as CUDA would, a little more strictly: a CPU tensor (even a 0-dim one, which
CUDA lets into elementwise ops) or a CPU generator meeting a cuda tensor raises. Values are real, so code that
must read numbers back (sampling, acceptance) runs whole; `device.reads` counts the read-backs (`.item()`,
`.tolist()`, `.cpu()`), each a device sync on a real GPU, and `fake_cuda(log)` appends "read" to `log` at each.

`Timeline` checks timers: it records queued device work, syncs, read-backs and clock reads in order.

torch.tensor(..., device="cuda") cannot be faked (torch copies its data below the dispatcher), nor can .to("cuda")
without an index (torch asks CUDA for its current device): code under test moves data with .to(t.device), as it
may on any device, and tests name cuda:0.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
CUDA = torch.device("cuda", 0)


class CudaTensor(torch.Tensor):
    """A CPU tensor (`backing`) presented as a cuda:0 tensor of the same shape, strides and dtype."""

    @staticmethod
    def __new__(cls, backing: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            backing.shape,
            strides=backing.stride(),
            storage_offset=backing.storage_offset(),
            dtype=backing.dtype,
            device="cpu",
            requires_grad=False,
        )
        out.backing = backing
        return out

    @property
    def device(self) -> torch.device:  # torch's C++ sees a CPU tensor (its device guards need no CUDA)
        return CUDA

    def __repr__(self) -> str:
        return f"CudaTensor({self.backing!r})"

    # torch's C++ sees a CPU tensor, so .cpu() and .to("cpu") would return it as it is: copy it out instead
    def cpu(self) -> torch.Tensor:
        return aten._to_copy.default(self, device=torch.device("cpu"))

    def to(self, *args, **kwargs) -> torch.Tensor:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if device is None or device.type == "cuda":
            return self if dtype is None or dtype == self.dtype else super().to(dtype)
        return aten._to_copy.default(self, device=device, dtype=dtype or self.dtype)

    def tolist(self):  # torch's own refuses subclasses
        return self.cpu().tolist()

    def __setitem__(self, index, value):  # torch makes a number's tensor below the dispatcher: make it here
        if not isinstance(value, torch.Tensor):
            value = torch.full((), value, dtype=self.dtype, device=self.device)
        super().__setitem__(index, value)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on a fake cuda tensor outside `with fake_cuda():`")


class FakeCuda(TorchDispatchMode):
    """The mode that checks every op's devices and runs it on the CPU tensors behind (see the module docstring)."""

    def __init__(self, log: list | None = None):
        super().__init__()
        self.reads, self.log = 0, log

    def tensor(self, t) -> CudaTensor:
        return CudaTensor(torch.as_tensor(t).clone())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        inputs = [a for a in leaves if isinstance(a, torch.Tensor)]
        on_cuda = any(isinstance(t, CudaTensor) for t in inputs)
        named = kwargs.get("device") or next((a for a in args if isinstance(a, torch.device)), None)
        out_cuda = on_cuda if named is None else torch.device(named).type == "cuda"
        if func is not aten.copy_.default and on_cuda and any(not isinstance(t, CudaTensor) for t in inputs):
            raise RuntimeError(
                f"{func}: expected all tensors to be on the same device, but found at least two "
                f"devices, cuda:0 and cpu!"
            )
        for generator in (a for a in leaves if isinstance(a, torch.Generator)):
            if generator.device.type != ("cuda" if out_cuda else "cpu"):
                raise RuntimeError(
                    f"{func}: expected a '{'cuda' if out_cuda else 'cpu'}' device type for "
                    f"generator but found '{generator.device.type}'"
                )
        wrappers = {id(t.backing): t for t in inputs if isinstance(t, CudaTensor)}
        args, kwargs = pytree.tree_map_only(CudaTensor, lambda t: t.backing, (args, kwargs))
        args, kwargs = pytree.tree_map_only(torch.device, lambda d: torch.device("cpu"), (args, kwargs))
        out = func(*args, **kwargs)
        read = not out_cuda or not any(isinstance(o, torch.Tensor) for o in pytree.tree_leaves(out))
        if on_cuda and read:  # a copy to the CPU, or numbers (item, a comparison's verdict)
            self.reads += 1
            if self.log is not None:
                self.log.append("read")

        def present(t):
            if id(t) in wrappers:  # an in-place op returns its own argument
                return wrappers[id(t)]
            return CudaTensor(t) if out_cuda else t

        return pytree.tree_map_only(torch.Tensor, present, out)


@contextmanager
def fake_cuda(log: list | None = None):
    """A fake cuda:0 for the block (torch's CUDA initialisation skipped: there is no CUDA to initialise)."""
    lazy_init = torch.cuda._lazy_init
    torch.cuda._lazy_init = lambda: None
    try:
        with FakeCuda(log) as mode:
            yield mode
    finally:
        torch.cuda._lazy_init = lazy_init


class Timeline:
    """Device work, syncs and clock reads in the order they happen, to check timers: "work" (a fake model's forward,
    queued on the GPU), "sync" (torch.cuda.synchronize, patched), "read" (a read-back: pass `events` to fake_cuda),
    "clock" (time.perf_counter, patched). A clock read that finds work queued since the last sync or read-back
    would time the work's launch, not the work: `unsynced_clocks` counts them."""

    def __init__(self, monkeypatch):
        self.events: list[str] = []
        clock = time.perf_counter
        monkeypatch.setattr(time, "perf_counter", lambda: self.events.append("clock") or clock())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.events.append("sync"))

    def work(self) -> None:
        self.events.append("work")

    def unsynced_clocks(self) -> int:
        assert "work" in self.events and "clock" in self.events, f"nothing timed: {self.events}"
        queued, unsynced = False, 0
        for event in self.events:
            if event == "work":
                queued = True
            elif event in ("sync", "read"):
                queued = False
            elif event == "clock":
                unsynced += queued
        return unsynced


class QueuedModel:
    """A Model on the fake cuda:0 whose forwards queue work (Timeline "work") and return logits there, token 3 the
    most likely."""

    vocab_size, eos_token_ids, max_context = 8, (0,), 64
    device = CUDA

    def __init__(self, timeline: Timeline):
        self.timeline, self.length = timeline, 0

    def prefill(self, token_ids):
        self.length = 0
        return self.forward(token_ids)[-1]

    def forward(self, token_ids, positions=None, tree_mask=None, last_n=None):
        self.timeline.work()
        self.length += len(token_ids)
        logits = torch.zeros(len(token_ids), self.vocab_size)
        logits[:, 3] = 1.0
        return logits[-(last_n or len(token_ids)) :].to(self.device)

    def rollback(self, length: int) -> None:
        self.length = length
