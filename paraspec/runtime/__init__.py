"""Process-per-device execution: devices, workers, shared-memory channels, fault propagation.

    devices.py   device strings (cpu, cpu:N, cpu:A-B, cuda:N) and pinning a process to one
    workers.py   Runtime (the owner), Worker backends (process, inprocess), Handle, LoopContext, errors
    channels.py  TokenChannel (versioned token exchange, optional q ring) and StopSignal
    remote.py    RemoteModel: the Model protocol over a worker (imports torch; import it from there)
    wire.py      message framing between a caller and a worker (arrays out-of-band)
    shm.py       shared-memory segments, a cross-process lock and futex waits
"""
from paraspec.runtime.channels import (ChannelFull, ChannelState, ChannelStopped, CommitResult, DraftSnapshot,
                                       StaleVersion, StopSignal, TokenChannel)
from paraspec.runtime.devices import Device, DeviceError, parse_device, parse_devices
from paraspec.runtime.workers import (Handle, LoopContext, ProcessWorker, RemoteError, Runtime, ThreadWorker,
                                      TraceRecorder, Worker, WorkerClosed, WorkerDied, WorkerError, WorkerInfo)

__all__ = ["ChannelFull", "ChannelState", "ChannelStopped", "CommitResult", "Device", "DeviceError",
           "DraftSnapshot", "Handle", "LoopContext", "ProcessWorker", "RemoteError", "Runtime", "StaleVersion",
           "StopSignal", "ThreadWorker", "TokenChannel", "TraceRecorder", "Worker", "WorkerClosed", "WorkerDied",
           "WorkerError", "WorkerInfo", "parse_device", "parse_devices"]
