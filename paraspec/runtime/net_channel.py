"""Token channels across machines: the caller's TokenChannels, reached over TCP by workers on other hosts.

A TokenChannel lives in the caller's shared memory; a worker on the same host maps it (channels.py). A worker on
another host cannot, so the caller's Runtime also serves its channels over TCP (`ChannelServer`) and such a
worker gets a `RemoteChannel` instead: a proxy with the same methods, each one call answered by running the very
same TokenChannel method in the caller. The semantics are therefore the shared-memory channel's by construction:
versioned positions (a rollback bumps the version; a stale draft is refused), one lock around every read and
write, stop and ChannelStopped, waits that return on any change. Only the cost differs: one round trip per call.

    worker (another host)                      caller (owns the segments)
    RemoteChannel.publish_draft(...)  ---->    ChannelServer thread: channel.publish_draft(...)
                                      <----    the result, or the exception it raised (re-raised here)
    RemoteChannel.wait_for_draft(...) ---->    blocks in the channel's futex wait until it holds, or stops

Messages carry token ids, positions, versions and, under sampling, the q rows a verifier needs; never logits.
`wait_until(predicate)` runs its predicate here (a closure cannot travel): it reads the state and waits for the
next change until the predicate holds. The Runtime's stop signal is served the same way (`RemoteStopSignal`).

`latency_s` (tests and benchmarks only) adds that much delay to every message, both ways, to study a link.
A worker whose connection breaks (the caller is gone) sees ChannelStopped, as a local worker would see its
channel stopped.
"""

from __future__ import annotations

import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable

from paraspec.runtime.channels import ChannelState, ChannelStopped, StopSignal, TokenChannel

STOP = "__stop__"  # the name the Runtime's stop signal is served under
_LENGTH = struct.Struct("<Q")


class _Link:
    """One TCP connection carrying whole pickled messages, each prefixed by its length. Leaner than the workers'
    Wire (one pickle, one send, buffered reads): channel calls are small and many, a round trip each."""

    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._reader = sock.makefile("rb", buffering=1 << 16)

    def send(self, message) -> None:
        data = pickle.dumps(message, protocol=5)
        self.sock.sendall(_LENGTH.pack(len(data)) + data)

    def recv(self):
        head = self._reader.read(_LENGTH.size)
        if len(head) < _LENGTH.size:
            raise EOFError("the other end of the channel connection closed")
        (n,) = _LENGTH.unpack(head)
        data = self._reader.read(n)
        if len(data) < n:
            raise EOFError("the other end of the channel connection closed")
        return pickle.loads(data)

    def close(self) -> None:
        for closable in (self._reader, self.sock):
            try:
                closable.close()
            except OSError:
                pass


# what a remote end may call: every public TokenChannel / StopSignal operation, nothing else
_CHANNEL_CALLS = {
    "state",
    "snapshot",
    "read_since",
    "tokens",
    "read_q",
    "reset",
    "publish_draft",
    "publish_and_read",
    "wait_below_ahead",
    "commit",
    "discard_drafts",
    "mark_draft_ready",
    "draft_ready",
    "stop",
    "wait_for_draft",
    "wait_for_version_change",
    "wait_for_commit",
    "wait_for_room",
    "change_count_and_state",
    "wait_for_change",
    "geometry",
    "stopped",
    "reason",
    "version",
    "committed",
    "length",
}
_STOP_CALLS = {"set", "clear", "is_set", "wait", "stopped", "reason"}


class ChannelServer:
    """Serves a Runtime's channels (a live dict: channels created later are served too) and its stop signal on
    one TCP port. One thread per connection; a connection is one remote proxy of one channel."""

    def __init__(self, channels: dict[str, TokenChannel], stop: StopSignal, host: str = "127.0.0.1"):
        self._channels, self._stop = channels, stop
        self._listener = socket.create_server((host, 0))
        self.address = (host, self._listener.getsockname()[1])
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="paraspec-channel-server", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="paraspec-channel-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        link = _Link(conn)
        try:
            _, name, latency_s = link.recv()
            target = self._stop if name == STOP else self._channels.get(name)
            allowed = _STOP_CALLS if name == STOP else _CHANNEL_CALLS
            if target is None:
                link.send(("error", KeyError(f"no channel named {name!r} in this runtime")))
                return
            link.send(("ok", None))
            while True:
                method, args, kwargs = link.recv()
                try:
                    if method not in allowed:
                        raise AttributeError(f"{method!r} cannot be called on a remote channel")
                    attr = getattr(target, method)
                    reply = ("ok", attr(*args, **kwargs) if callable(attr) else attr)
                except BaseException as exc:  # sent back and raised in the worker, as a local call would
                    reply = ("error", exc)
                _delay(latency_s)
                link.send(reply)
        except (EOFError, OSError):
            pass
        finally:
            with self._lock:
                self._connections.discard(conn)
            link.close()

    def close(self) -> None:
        """Stop accepting and drop every connection (their workers see ChannelStopped). Repeatable."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        try:
            self._listener.close()
        except OSError:
            pass
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# the proxies this process unpickled, by (class, address, name, latency): a worker that runs a loop per request
# keeps one connection per channel and thread instead of opening new ones each time
_proxies: dict[tuple, _Proxy] = {}
_proxies_lock = threading.Lock()


def _proxy(cls, address, name: str, latency_s: float) -> _Proxy:
    key = (cls, tuple(address), name, latency_s)
    with _proxies_lock:
        proxy = _proxies.get(key)
        if proxy is None:
            proxy = _proxies[key] = cls(address, name, latency_s)
        return proxy


def _delay(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


class _Proxy:
    """Connections to a ChannelServer, one per thread that uses the proxy (a thread blocked in a wait must not
    hold up another's publish), opened on first use; pickles as its address and name, like a shared-memory
    channel pickles as its segment name."""

    calls: frozenset[str] = frozenset()  # the methods the server answers for this kind of proxy

    def __init__(self, address: tuple[str, int], name: str, latency_s: float = 0.0):
        self.address, self.name, self.latency_s = (address[0], address[1]), name, float(latency_s)
        self._local = threading.local()
        self._links: list[_Link] = []

    def __reduce__(self):
        return _proxy, (type(self), self.address, self.name, self.latency_s)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} at {self.address[0]}:{self.address[1]}>"

    def __getattr__(self, method: str):
        """Every call the server answers, as a method of the same name."""
        if method in type(self).calls:
            return lambda *args, **kwargs: self._call(method, *args, **kwargs)
        raise AttributeError(method)

    stopped = property(lambda self: self._call("stopped"))
    reason = property(lambda self: self._call("reason"))

    def _connect(self) -> _Link:
        try:
            sock = socket.create_connection(self.address, timeout=30.0)
        except OSError as exc:
            raise ChannelStopped(f"cannot reach the caller's channel server at {self.address}: {exc}") from None
        sock.settimeout(None)
        link = _Link(sock)
        link.send(("open", self.name, self.latency_s))
        status, error = link.recv()
        if status != "ok":
            link.close()
            raise error
        return link

    def _call(self, method: str, *args, **kwargs):
        link = getattr(self._local, "link", None)
        try:
            if link is None:
                link = self._local.link = self._connect()
                self._links.append(link)
            _delay(self.latency_s)
            link.send((method, args, kwargs))
            status, result = link.recv()
        except (EOFError, OSError) as exc:
            self._local.link = None
            if link is not None:
                link.close()
            raise ChannelStopped(
                f"the connection to the caller's channel {self.name!r} was lost "
                f"({type(exc).__name__}): the caller stopped or is gone"
            ) from None
        if status != "ok":
            raise result
        return result

    def close(self) -> None:
        """Close every connection this proxy opened (each thread reconnects on its next call)."""
        for link in self._links:
            link.close()
        self._links.clear()
        self._local = threading.local()


class RemoteChannel(_Proxy):
    """A TokenChannel of the caller, over TCP: the same methods, the same results and exceptions."""

    calls = frozenset(_CHANNEL_CALLS)
    _geometry: tuple[int, int | None, int] | None = None

    def _fixed(self) -> tuple[int, int | None, int]:
        if self._geometry is None:
            self._geometry = self._call("geometry")
        return self._geometry

    capacity = property(lambda self: self._fixed()[0])
    vocab_size = property(lambda self: self._fixed()[1])
    q_window = property(lambda self: self._fixed()[2])
    version = property(lambda self: self._call("version"))
    committed = property(lambda self: self._call("committed"))
    length = property(lambda self: self._call("length"))

    def wait_until(
        self, predicate: Callable[[ChannelState], bool], timeout: float | None = None
    ) -> ChannelState | None:
        """Block until predicate(state) holds, checked here at every change of the channel; return that state.
        Like the local wait: a stopped channel whose state still satisfies the predicate returns it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            change_count, state = self._call("change_count_and_state")
            if predicate(state):
                return state
            if state.stopped:
                raise ChannelStopped(self._call("reason"))
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            self._call("wait_for_change", change_count, left)


class RemoteStopSignal(_Proxy):
    """The caller's Runtime stop signal over TCP (`ctx.stop` of a loop in a remote worker): is_set, set, clear,
    wait, as StopSignal's."""

    calls = frozenset(_STOP_CALLS)

    def __init__(self, address: tuple[str, int], name: str = STOP, latency_s: float = 0.0):
        super().__init__(address, name, latency_s)
