"""Device strings: `cpu` (all cores), `cpu:N`, `cpu:A-B`, `cpu:A,B` (a pinned core set), `cuda:N`, each optionally
on a named node of a Ray cluster: `NODE/cpu:0-3`, `NODE/cuda:1` (runtime_kind="ray"; NODE is a Ray node's name, id
prefix or custom resource, or `head`: runtime/ray_backend.py resolves it).

On a CPU-only machine each core set is one "device"; on a GPU node each GPU is. Parsing happens at the
boundary (Engine arguments, CLI flags), before any process starts, so a typo never costs a model load. A device
on another node is checked against that node when its worker starts there (its cores, its GPUs).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass


class DeviceError(ValueError):
    pass


@dataclass(frozen=True)
class Device:
    kind: str  # "cpu" or "cuda"
    cores: tuple[int, ...] = ()  # cpu: the pinned core set (empty = all cores, unpinned)
    index: int = 0  # cuda: the GPU index
    node: str | None = None  # a Ray node (runtime_kind="ray"); None: wherever the runtime puts the worker

    @property
    def torch_device(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    @property
    def num_threads(self) -> int:
        return len(self.cores) if self.cores else len(available_cores())

    def __str__(self) -> str:
        where = f"{self.node}/" if self.node else ""
        if self.kind == "cuda":
            return f"{where}cuda:{self.index}"
        return where + ("cpu" if not self.cores else "cpu:" + ",".join(map(str, self.cores)))


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


# The cores this process could use when paraspec was imported: pinning the process later (an in-process
# engine on cpu:0) must not make cpu:1 look absent to the next engine.
_CORES_AT_IMPORT = _affinity()


def available_cores() -> list[int]:
    return sorted(_CORES_AT_IMPORT | _affinity())


def _parse_core_list(spec: str, text: str) -> tuple[int, ...]:
    cores: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                cores.extend(range(lo, hi + 1))
            else:
                cores.append(int(part))
        except ValueError:
            raise DeviceError(f"bad device {text!r}: expected cpu, cpu:N, cpu:A-B, cpu:A,B or cuda:N") from None
    return tuple(dict.fromkeys(cores))


def parse_device(text: str | Device) -> Device:
    """Parse a device string and check it against this machine (a device on a named node: against that node,
    when its worker starts there); raise DeviceError naming the fix."""
    if isinstance(text, Device):
        return text
    node, _, local = str(text).strip().rpartition("/")
    if "/" in str(text) and (not node or "/" in node):
        raise DeviceError(f"bad device {text!r}: expected NODE/cpu:N, NODE/cpu:A-B or NODE/cuda:N")
    device = _parse_local(local.lower(), text, node or None)
    if device.node is None:
        check_available(device, "this machine")
    return device


def _parse_local(s: str, given: str, node: str | None) -> Device:
    """The syntax of what follows the node (if any): cpu, cpu:N, cpu:A-B, cpu:A,B, cuda, cuda:N."""
    if s == "cpu":
        return Device("cpu", node=node)
    if s.startswith("cpu:"):
        return Device("cpu", cores=_parse_core_list(s[4:], given), node=node)
    if s == "cuda" or s.startswith("cuda:"):
        try:
            return Device("cuda", index=int(s[5:]) if ":" in s else 0, node=node)
        except ValueError:
            raise DeviceError(f"bad device {given!r}: expected cuda:N") from None
    raise DeviceError(
        f"unknown device {given!r}: expected cpu, cpu:N, cpu:A-B, cpu:A,B or cuda:N (each may be "
        f"NODE/... on a Ray node)"
    )


def check_available(device: Device, where: str) -> None:
    """The device's cores and GPU exist where this process runs (`where`: "this machine", or the node a worker
    has just started on), else DeviceError naming the place and what it has."""
    if device.kind == "cpu":
        have = available_cores()
        missing = [c for c in device.cores if c not in have]
        if missing:
            raise DeviceError(
                f"device {str(device)!r} names core(s) {missing} but {where} has cores "
                f"{have[0]}-{have[-1]}; use e.g. cpu:{have[0]} or cpu"
            )
    else:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.index >= n:
            raise DeviceError(
                f"device {str(device)!r} is not available: {where} has {n} CUDA device(s); use cpu or cpu:N"
            )


def parse_devices(texts) -> list[Device]:
    if isinstance(texts, (str, Device)):
        texts = [texts]
    devices = [parse_device(t) for t in texts]
    if not devices:
        raise DeviceError("no devices given; pass at least one, e.g. cpu or cpu:0")
    return devices


def current_pinning() -> tuple[set[int] | None, int]:
    """This process's core affinity (None where the OS has none) and torch's intra-op thread count."""
    import torch

    return (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None), torch.get_num_threads()


def set_pinning(cores, threads: int) -> None:
    """Pin this process to `cores` (None: leave the affinity alone) with `threads` torch threads; the one
    place that sets both, so restoring is the same call with what current_pinning() returned."""
    import torch

    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)


def apply_device(device: Device) -> None:
    """Pin this process to the device: core affinity and thread count for CPU, the current GPU for CUDA."""
    if device.kind == "cpu":
        set_pinning(device.cores, device.num_threads)
    else:
        import torch

        torch.cuda.set_device(device.index)


def sync(device) -> None:
    """Wait until `device` has run the work queued on it, before a clock is read: a CUDA call returns once its
    kernels are queued, so a duration read without this times the launch, not the work. Nothing to do on the CPU,
    nor for None (a model without a torch device: llama.cpp, a remote worker, whose calls return when done).

    device: a torch.device, a device string (`cuda:1`, `NODE/cuda:1`, `cpu:0-3`) or a Device."""
    if isinstance(device, str):
        device = _parse_local(device.strip().lower().rpartition("/")[2], device, None)
    if isinstance(device, Device):
        if device.kind == "cuda":
            import torch

            torch.cuda.synchronize(device.index)
    elif device is not None and device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


@contextmanager
def pinned(device: Device):
    """Run a block on `device` (cores and threads), then give the process its previous cores and threads."""
    before = current_pinning()
    apply_device(device)
    try:
        yield
    finally:
        set_pinning(*before)


@contextmanager
def lend_cores(cores: tuple[int, ...] | None):
    """Run a block on `cores` with as many threads: a worker's prompt on its own cores and those of a worker that
    waits for it (amusd's and dsi's lend_cores). A llama.cpp model runs only its prompt's forwards on the lent threads
    and keeps its own count (models/threads.py `own_threads`) for every other forward and for its exactness probe.
    None, or cores this thread may not run on (a cpuset narrower than the machine's): the block as it is."""
    from paraspec.models.threads import on_loan

    before = current_pinning()
    try:
        if cores:
            set_pinning(set(cores), len(cores))
    except OSError:  # not in this process's cpuset: nothing is lent (set_pinning changed nothing: affinity first)
        cores = None
    if not cores:
        yield
        return
    try:
        with on_loan(own=before[1]):
            yield
    finally:
        set_pinning(*before)


def shared_cores(devices: list[Device], runtime_kind: str) -> tuple[int, ...] | None:
    """The cores a prompt may borrow from the workers that wait for it (lend_cores): every device's cores, where all
    are core sets of this machine (or of one named Ray node) and some worker gains by it; else None."""
    if not devices or any(d.kind != "cpu" or not d.cores for d in devices):
        return None
    nodes = {d.node for d in devices}
    if len(nodes) > 1 or (runtime_kind == "ray" and nodes == {None}):
        return None  # maybe several machines
    cores = tuple(sorted({c for d in devices for c in d.cores}))
    return None if all(tuple(sorted(d.cores)) == cores for d in devices) else cores
