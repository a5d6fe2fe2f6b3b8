"""The Ray backend: the same workers, each served from a Ray actor (`Runtime(backend="ray")`,
`Engine(..., runtime="ray")`; install `paraspec[ray]` and call `ray.init()` first).

Only where the worker runs changes. The actor connects back to the caller over TCP and runs the very request
loop the process backend runs (`serve.serve`), so requests, loops, traces, errors and the token protocol are
unchanged: loops still exchange tokens through the Runtime's shared-memory TokenChannels, attached by name.

    caller (driver)                             actor (a Ray worker process)
    RayWorker._start: listen on 127.0.0.1  -->  _WorkerActor.serve: connect, pin to the device, build the model,
    Wire over the accepted socket         <-->  answer requests (serve.serve) until shutdown or EOF
    death: the actor's pidfd (the process       a killed actor closes its socket too, so a waiter also sees EOF
    sentinel of the other backends)

Single host only, like the channels. A multi-node deployment would need: (1) the wire on a routable address (the
driver listens on its node IP, or the roles reverse and the actor listens); (2) TokenChannels that are not
/dev/shm segments -- e.g. a channel actor holding the state, or the verifier's commits and the drafts streamed
over the wire -- with the same versioned semantics; (3) death detection without pidfds: socket EOF already works,
and the Runtime's monitor would watch the actors' `serve` object refs (ray.wait raises RayActorError when an
actor dies) to stop the channels; (4) GPU placement through Ray resources (num_gpus=1 per actor: Ray then sets
CUDA_VISIBLE_DEVICES, so the worker's device would be "cuda:0" inside the actor).
"""
from __future__ import annotations

import os
import select
import socket
import time

from paraspec.runtime.wire import Wire
from paraspec.runtime.errors import WorkerError
from paraspec.runtime.worker_main import serve
from paraspec.runtime.workers import Worker, remaining

try:
    import ray
except ImportError:     # the backend is optional: `pip install paraspec[ray]`
    ray = None


def _require_ray() -> None:
    if ray is None:
        raise WorkerError("the ray backend needs Ray: pip install 'paraspec[ray]' (or pip install ray)")
    if not ray.is_initialized():
        raise WorkerError("the ray backend needs a running Ray: call ray.init() (local) or "
                          "ray.init(address=...) before starting workers")


class _WorkerActor:
    def pid(self) -> int:
        return os.getpid()

    def serve(self, address: tuple[str, int], name: str, device: str, spec: bytes,
              heartbeat_s: float | None = None) -> None:
        from paraspec.runtime.devices import parse_device
        sock = socket.create_connection(address)
        serve(sock, name, parse_device(device), spec, in_process=False, heartbeat_s=heartbeat_s)


class RayWorker(Worker):
    """A worker served from a Ray actor on this host."""

    backend = "ray"
    connect_timeout = 120.0

    def _start(self) -> None:
        _require_ray()
        self._their_sock.close()            # the actor connects over TCP instead of inheriting a socket
        listener = socket.create_server(("127.0.0.1", 0))
        try:
            actor_class = ray.remote(num_cpus=0)(_WorkerActor)
            self._actor = actor_class.options(name=None, max_concurrency=1).remote()
            self._pid = ray.get(self._actor.pid.remote(), timeout=self.connect_timeout)
            self._serving = self._actor.serve.remote(listener.getsockname(), self.name, str(self.device),
                                                     self._spec, self.heartbeat_s)
            listener.settimeout(self.connect_timeout)
            conn, _ = listener.accept()
        except BaseException:
            if getattr(self, "_actor", None) is not None:
                ray.kill(self._actor)
            raise
        finally:
            listener.close()
        conn.settimeout(None)
        self._wire.close()
        self._wire = Wire(conn)
        try:                                # the actor's process as a sentinel, like a child process's
            self._pidfd = os.pidfd_open(self._pid)
            self._sentinel = self._pidfd
        except (AttributeError, OSError):   # no pidfds: death is still seen as EOF on the socket
            self._pidfd = None

    @property
    def pid(self) -> int | None:
        return self._pid

    def _is_alive(self) -> bool:
        if self._pidfd is not None:
            return not select.select([self._pidfd], [], [], 0)[0]
        done, _ = ray.wait([self._serving], timeout=0)
        return not done

    def _exitcode(self) -> int | None:
        return None                         # a Ray worker process is not our child: no exit status

    def _kill(self) -> None:
        try:
            ray.kill(self._actor)
        except Exception:
            pass

    def _stop_worker(self, deadline: float) -> None:
        try:
            ray.wait([self._serving], timeout=remaining(deadline))
        except Exception:
            pass
        try:
            ray.kill(self._actor)           # ends the actor's process (Ray reaps it)
        except Exception:
            pass
        if self._pidfd is not None:
            end = time.monotonic() + 2.0
            while time.monotonic() < end and not select.select([self._pidfd], [], [], 0.05)[0]:
                pass
            self._sentinel = None
            os.close(self._pidfd)
            self._pidfd = None
