"""The Ray runtime: the same workers, each served from a Ray actor, on this host or on any node of a Ray cluster
(`Runtime("ray")`, `Engine(..., runtime_kind="ray")`; install `paraspec[ray]`).

Only where the worker runs changes. The actor connects back to the caller over TCP and runs the very request
loop the process runtime runs (`worker_main.serve`), so requests, loops, traces, errors and the token protocol
are unchanged.

    caller (driver)                              actor (a Ray worker process, on the device's node)
    RayWorker._start: listen on the driver's --> _WorkerActor.serve: connect, check the device on its node, pin,
    node address; Wire over the accepted         build the model, answer requests until shutdown or EOF
    socket
    channels: shared memory when the actor is on this host; otherwise the Runtime's ChannelServer over TCP
    (net_channel.py); the Runtime decides with `same_host` and its `transport`
    death: on this host the actor's pidfd; elsewhere a thread blocked in ray.wait on the actor's serve task
    (it returns when the actor or its node dies), both as the sentinel the Runtime's monitor watches

Ray itself: a running Ray is used as it is; otherwise the first worker joins the cluster at `address` (the
`ray_address` Engine option / `--ray-address`), else at RAY_ADDRESS, else starts a local Ray.

Placing a worker: a device `NODE/cpu:0-3` (or `NODE/cuda:1`) runs on the node NODE names: `head` (the head node),
a node's name (`ray start --node-name`), a prefix of its node id (6+ hex digits), or a custom resource only that
node has (`ray start --resources='{"gpu-box": 1}'`). Anything else is an error before the worker starts, listing
the cluster's nodes. A device without a node goes wherever Ray schedules it (num_cpus=0: on the driver's node
when it can). A `cuda:N` worker asks Ray for one GPU (so Ray places it on a node with a free one), and keeps
seeing the node's GPUs by their own indices: `cuda:N` is GPU N there, not the one Ray would have picked.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from typing import Any

from paraspec.runtime.devices import Device, DeviceError
from paraspec.runtime.errors import WorkerError
from paraspec.runtime.wire import Wire
from paraspec.runtime.worker_main import serve
from paraspec.runtime.workers import Worker, remaining

try:
    import ray
except ImportError:  # the Ray runtime is optional: `pip install paraspec[ray]`
    ray = None


_RAY = threading.Lock()
_ray_users = 0  # RayWorkers started and not yet stopped
_ray_ours = False  # whether paraspec called ray.init (then the last worker's stop calls ray.shutdown)


def ensure_ray(address: str | None = None) -> None:
    """Join (or start) Ray unless this process already has: `address`, else RAY_ADDRESS, else a local Ray."""
    global _ray_ours
    if ray is None:
        raise WorkerError("the ray runtime needs Ray: pip install 'paraspec[ray]' (or pip install ray)")
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise WorkerError(
            f"cannot join the Ray cluster at {address!r}: {exc}; start it with `ray start --head` "
            f"(and `ray start --address=HEAD:6379` on the other nodes) or pass the right "
            f"--ray-address"
        ) from None
    _ray_ours = True


def acquire_ray(address: str | None) -> None:
    """A RayWorker starts: join or start Ray (ensure_ray) and count the worker."""
    global _ray_users
    with _RAY:
        ensure_ray(address)
        _ray_users += 1


def release_ray() -> None:
    """A RayWorker has stopped. After the last one, leave the Ray that paraspec joined or started: a local Ray it
    started (raylet, GCS, agents: 7 processes) stops with it, instead of running until the interpreter exits. A
    Ray the caller initialised is the caller's to shut down."""
    global _ray_users, _ray_ours
    with _RAY:
        _ray_users -= 1
        if _ray_users == 0 and _ray_ours:
            _ray_ours = False
            ray.shutdown()


def host_identity() -> tuple[str, str]:
    """(hostname, boot id): two processes can share memory segments only if both are equal."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


def describe_nodes() -> str:
    rows = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        custom = sorted(
            k
            for k in n.get("Resources", {})
            if not k.startswith(("node:", "CPU", "GPU", "memory", "object_store_memory"))
        )
        head = " (head)" if "node:__internal_head__" in n.get("Resources", {}) else ""
        rows.append(
            f"{n['NodeID'][:8]} name={n.get('NodeName', '?')}{head}{' resources=' + ','.join(custom) if custom else ''}"
        )
    return "; ".join(rows) or "none alive"


def resolve_node(name: str) -> str:
    """The node id of the one alive node that `name` designates (see the module docstring)."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    if name == "head":
        found = [n for n in alive if "node:__internal_head__" in n.get("Resources", {})]
    else:
        found = [
            n
            for n in alive
            if n.get("NodeName") == name
            or name in n.get("Resources", {})
            or (len(name) >= 6 and n["NodeID"].startswith(name))
        ]
    if len(found) == 1:
        return found[0]["NodeID"]
    what = "no alive Ray node" if not found else f"{len(found)} Ray nodes"
    raise DeviceError(
        f"{what} matches {name!r} (a node name, a node id prefix of 6+ digits, a custom resource only "
        f"one node has, or head); the cluster has: {describe_nodes()}"
    )


def actor_options(device: Device, node_id: str | None = None) -> dict:
    """The Ray options of the actor serving a worker on `device` (on the node `node_id`, when given).

    A GPU device reserves one of Ray's GPUs, and tells Ray not to set CUDA_VISIBLE_DEVICES to the GPU it
    reserved: that would hide GPU N from a worker the user put on cuda:N."""
    options: dict[str, Any] = dict(name=None, max_concurrency=1, num_cpus=0)
    if device.kind == "cuda":
        options.update(num_gpus=1, runtime_env={"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}})
    if node_id is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return options


class _WorkerActor:
    def whereabouts(self) -> tuple[int, tuple[str, str], str]:
        return os.getpid(), host_identity(), ray.get_runtime_context().get_node_id()

    def serve(
        self, address: tuple[str, int], name: str, device: str, spec: bytes, heartbeat_s: float | None = None
    ) -> None:
        from paraspec.runtime.devices import parse_device

        sock = socket.create_connection(address)
        serve(sock, name, parse_device(device), spec, in_process=False, heartbeat_s=heartbeat_s)


class RayWorker(Worker):
    """A worker served from a Ray actor, on this host or on the node its device names."""

    kind = "ray"
    options_taken = ("address",)
    places_on_nodes = True
    connect_timeout = 120.0
    _pidfd: int | None = None  # the actor's process, where it runs on this host (a pidfd)
    _watch_fd: int | None = None  # else the read end of the pipe its watch thread closes

    def _start(self) -> None:
        acquire_ray(self.options.get("address"))
        self._holds_ray = True
        try:
            self._start_actor()
        except BaseException:
            self._release_ray()
            raise

    def _release_ray(self) -> None:
        if getattr(self, "_holds_ray", False):
            self._holds_ray = False
            release_ray()

    def _start_actor(self) -> None:
        self._their_sock.close()  # the actor connects over TCP instead of inheriting a socket
        self._pidfd = None
        self._node_id = resolve_node(self.device.node) if self.device.node else None
        self._actor = ray.remote(_WorkerActor).options(**actor_options(self.device, self._node_id)).remote()
        listener = None
        try:
            self._pid, host, self._node_id = ray.get(self._actor.whereabouts.remote(), timeout=self.connect_timeout)
            self._same_host = host == host_identity()
            listener = socket.create_server((self.caller_address(), 0))
            self._serving = self._actor.serve.remote(
                listener.getsockname(), self.name, str(self.device), self._spec, self.heartbeat_s
            )
            listener.settimeout(self.connect_timeout)
            conn, _ = listener.accept()
        except BaseException as exc:
            ray.kill(self._actor)
            if isinstance(exc, ray.exceptions.GetTimeoutError):
                raise WorkerError(
                    f"worker {self.name!r}: no Ray actor started on {self.device.node or 'the cluster'} "
                    f"within {self.connect_timeout:.0f} s (does the node have the resources?)"
                ) from None
            raise
        finally:
            if listener is not None:
                listener.close()
        conn.settimeout(None)
        self._wire.close()
        self._wire = Wire(conn)
        if self._same_host:
            try:  # the actor's process as a sentinel, like a child process's
                self._pidfd = os.pidfd_open(self._pid)
                self._sentinel = self._pidfd
                return
            except (AttributeError, OSError):
                pass
        # another host (or no pidfds): a thread waits on the actor's task; its pipe is the sentinel
        read_end, write_end = os.pipe()
        self._sentinel = self._watch_fd = read_end
        threading.Thread(
            target=self._watch, args=(write_end,), name=f"paraspec-{self.name}-ray-watch", daemon=True
        ).start()

    def _watch(self, write_end: int) -> None:
        try:
            ray.wait([self._serving], timeout=None)
        except Exception:
            pass
        try:
            os.write(write_end, b"x")
        except OSError:
            pass
        finally:
            os.close(write_end)  # the thread's own end: closed only here, never reused under it

    @property
    def same_host(self) -> bool:
        return self._same_host

    def caller_address(self) -> str:
        return "127.0.0.1" if getattr(self, "_same_host", True) else ray.util.get_node_ip_address()

    @property
    def node_id(self) -> str | None:
        return self._node_id

    @property
    def pid(self) -> int | None:
        return self._pid

    def _is_alive(self) -> bool:
        if self._pidfd is not None:
            return not select.select([self._pidfd], [], [], 0)[0]
        done, _ = ray.wait([self._serving], timeout=0)
        return not done

    def exit_code(self) -> int | None:
        return None  # a Ray worker process is not our child: no exit status

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
            ray.kill(self._actor)  # ends the actor's process (Ray reaps it)
        except Exception:
            pass
        self._release_ray()
        if self._pidfd is not None:
            end = time.monotonic() + 2.0
            while time.monotonic() < end and not select.select([self._pidfd], [], [], 0.05)[0]:
                pass
            self._sentinel = None
            os.close(self._pidfd)
            self._pidfd = None
        if self._watch_fd is not None:
            self._sentinel = None
            os.close(self._watch_fd)
            self._watch_fd = None
