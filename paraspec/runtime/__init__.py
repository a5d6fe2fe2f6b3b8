"""Process-per-device execution: devices, workers, shared-memory channels, fault propagation.

devices.py   device strings (cpu, cpu:N, cpu:A-B, cuda:N); pinning a process to one, and undoing it
errors.py    WorkerError and its kinds (RemoteError, WorkerDied, WorkerTimeout, WorkerClosed); errors over the wire
worker_main.py  the worker side: serve() (every kind of worker's entry point), WorkerInfo, LoopContext
workers.py   the caller side: Worker, Handle; the kinds of runtime (process, inprocess) and their registry RUNTIME_KINDS
ray_backend.py  the Ray runtime's workers (optional extra), registered by name
runtime.py   Runtime: owns workers and channels, stops every channel when a worker dies, closes it all
channels.py  TokenChannel (versioned token exchange, optional q ring) and StopSignal
net_channel.py  the same channels over TCP, for workers on other hosts (ChannelServer, RemoteChannel)
exchange.py  ShmExchange: an all-gather among processes through one shared-memory segment
remote.py    RemoteModel: the Model protocol over a worker (imports torch; import it from there)
wire.py      message framing between a caller and a worker (arrays out-of-band)
shm.py       shared-memory segments, a cross-process lock and futex waits
"""

from paraspec.runtime.channels import (
    ChannelFull,
    ChannelState,
    ChannelStopped,
    CommitResult,
    DraftSnapshot,
    StaleVersion,
    StopSignal,
    TokenChannel,
)
from paraspec.runtime.devices import Device, DeviceError, parse_device, parse_devices
from paraspec.runtime.errors import RemoteError, WorkerClosed, WorkerDied, WorkerError, WorkerTimeout
from paraspec.runtime.runtime import Runtime
from paraspec.runtime.worker_main import LoopContext, WorkerInfo
from paraspec.runtime.workers import RUNTIME_KINDS, Handle, ProcessWorker, ThreadWorker, Worker

__all__ = [
    "ChannelFull",
    "ChannelState",
    "ChannelStopped",
    "CommitResult",
    "Device",
    "DeviceError",
    "DraftSnapshot",
    "Handle",
    "LoopContext",
    "ProcessWorker",
    "RemoteError",
    "RUNTIME_KINDS",
    "Runtime",
    "StaleVersion",
    "StopSignal",
    "ThreadWorker",
    "TokenChannel",
    "Worker",
    "WorkerClosed",
    "WorkerDied",
    "WorkerError",
    "WorkerInfo",
    "WorkerTimeout",
    "parse_device",
    "parse_devices",
]
