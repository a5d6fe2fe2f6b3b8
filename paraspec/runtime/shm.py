"""Shared-memory segments, a cross-process lock and a kernel-side wait: the floor the channels stand on.

Ownership: only the creating process unlinks a segment (and registers it with multiprocessing's
resource_tracker, the backstop if that process is SIGKILLed). Other processes attach *without* registering,
so a worker that exits or is killed never unlinks, or warns about, a segment it did not create. Names start
with `paraspec_<owner pid>_` so a leak is one `ls /dev/shm/paraspec_*` away. When the owner and its resource
tracker are SIGKILLed together (a killed process group, a container stopped) nobody is left to unlink: the
first segment a process creates first removes every paraspec segment of this user whose owner pid is gone
(`reap_stale`). (The pid is checked in this pid namespace: a /dev/shm shared between namespaces is not
supported.)

Waiting: every segment starts with a 32-bit sequence word. Writers bump it under the lock and wake all
waiters with a Linux futex; waiters sleep in the kernel until the word differs from the value they saw under
the lock, so no wake-up is lost and nothing polls. Unlike multiprocessing.Condition, whose notify() blocks
until every woken sleeper acknowledges, nobody waits for a waiter: a killed waiter cannot wedge a writer.

Locking: a threading.Lock (threads of one process) plus flock() on the segment's own file descriptor
(processes). The kernel drops an flock when its holder dies, so a SIGKILLed worker never leaves the lock held.
"""

from __future__ import annotations

import ctypes
import fcntl
import itertools
import mmap
import os
import platform
import sys
import threading
import time

try:
    import _posixshmem
except ImportError:  # Windows
    _posixshmem = None

PREFIX = "paraspec_"
_counter = itertools.count()


_reaped = False


def reap_stale() -> list[str]:
    """Unlink this user's paraspec segments whose owner process no longer exists; the names removed."""
    removed: list[str] = []
    try:
        entries = list(os.scandir("/dev/shm"))
    except OSError:
        return removed
    for entry in entries:
        parts = entry.name.split("_")
        if not entry.name.startswith(PREFIX) or len(parts) < 3 or not parts[1].isdigit():
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            os.kill(int(parts[1]), 0)
            continue  # the owner is alive (or someone else's: EPERM)
        except ProcessLookupError:
            pass
        except OSError:
            continue
        try:
            os.unlink(entry.path)
            removed.append(entry.name)
        except OSError:
            pass
    return removed


def segment_name(tag: str) -> str:
    """A fresh segment name: paraspec_<pid>_<n>_<tag>; the pid says which process owns (unlinks) it."""
    tag = "".join(c if c.isalnum() else "_" for c in tag)[:40]
    return f"{PREFIX}{os.getpid()}_{next(_counter)}_{tag}"


class Segment:
    """One POSIX shared-memory segment mapped into this process. `buf` is a writable memoryview."""

    def __init__(self, name: str, fd: int, size: int, owner: bool):
        self.name, self.size, self.owner = name, size, owner
        self.fd = fd
        self._mmap = mmap.mmap(fd, size)
        self.buf = memoryview(self._mmap)
        self._unlinked = False

    @classmethod
    def create(cls, tag: str, size: int) -> Segment:
        global _reaped
        _require_posix()
        if not _reaped:
            _reaped = True
            reap_stale()
        name = segment_name(tag)
        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.ftruncate(fd, size)
            # Reserve the pages now: on a full /dev/shm ftruncate still succeeds and the first write to a
            # missing page kills the writer with SIGBUS. posix_fallocate fails here instead, with a message.
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise OSError(
                    e.errno,
                    f"cannot reserve {size / 2**20:.1f} MiB of shared memory for {name} "
                    f"({e.strerror}); free space in /dev/shm (docker: --shm-size) or shrink the "
                    f"channel (capacity, q_window)",
                ) from None
            segment = cls(name, fd, size, owner=True)
        except BaseException:
            os.close(fd)
            _posixshmem.shm_unlink("/" + name)
            raise
        from multiprocessing import resource_tracker

        resource_tracker.register("/" + name, "shared_memory")
        return segment

    @classmethod
    def attach(cls, name: str) -> Segment:
        _require_posix()
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            return cls(name, fd, os.fstat(fd).st_size, owner=False)
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        """Unmap (views into `buf` must be gone) and, for the owner, unlink the name."""
        if self.fd >= 0:
            try:
                self.buf.release()
                self._mmap.close()
            except BufferError:  # someone still holds a numpy view; the mapping goes when that view does
                pass
            fd, self.fd = self.fd, -1
            os.close(fd)
        if self.owner:
            self.unlink()  # also when a close interrupted after the unmap is repeated

    def unlink(self) -> None:
        if self._unlinked:
            return
        from multiprocessing import resource_tracker

        try:
            _posixshmem.shm_unlink("/" + self.name)
        except FileNotFoundError:
            pass
        self._unlinked = True
        resource_tracker.unregister("/" + self.name, "shared_memory")


def _require_posix() -> None:
    if _posixshmem is None:
        raise OSError(
            "paraspec's multi-process runtime needs POSIX shared memory (Linux or macOS); "
            "use the in-process runtime or a single device"
        )


# --- futex -----------------------------------------------------------------------------------------------

_SYS_FUTEX = {
    "x86_64": 202,
    "amd64": 202,
    "aarch64": 98,
    "arm64": 98,
    "riscv64": 98,
    "ppc64le": 221,
    "ppc64": 221,
    "s390x": 238,
    "i386": 240,
    "i686": 240,
    "armv7l": 240,
}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_futex():
    if not sys.platform.startswith("linux"):
        return None
    number = _SYS_FUTEX.get(platform.machine().lower())
    if number is None:
        return None
    syscall = ctypes.CDLL(None, use_errno=True).syscall  # CDLL calls release the GIL
    syscall.restype = ctypes.c_long
    return number, syscall


_FUTEX = _load_futex()


def futex_wait(address: int, expected: int, timeout: float | None) -> None:
    """Sleep while the uint32 at `address` equals `expected`, at most `timeout` seconds.

    Returns on a wake, a value change, the timeout, or a signal (the caller re-checks its condition).
    Without futexes (not Linux) this degrades to a short sleep, i.e. polling every 0.5 ms.
    """
    if _FUTEX is None:
        time.sleep(0.0005 if timeout is None else max(0.0, min(timeout, 0.0005)))
        return
    number, syscall = _FUTEX
    ts = None
    if timeout is not None:
        timeout = max(0.0, timeout)
        ts = ctypes.byref(_Timespec(int(timeout), int((timeout % 1.0) * 1e9)))
    # Not FUTEX_PRIVATE: the word lives in a shared mapping and waiters are in other processes.
    syscall(
        ctypes.c_long(number),
        ctypes.c_void_p(address),
        ctypes.c_long(_FUTEX_WAIT),
        ctypes.c_long(expected & 0xFFFFFFFF),
        ts,
        None,
        ctypes.c_long(0),
    )


def futex_wake_all(address: int) -> None:
    if _FUTEX is None:
        return
    number, syscall = _FUTEX
    syscall(
        ctypes.c_long(number),
        ctypes.c_void_p(address),
        ctypes.c_long(_FUTEX_WAKE),
        ctypes.c_long(2**31 - 1),
        None,
        None,
        ctypes.c_long(0),
    )


class ProcessLock:
    """Mutual exclusion across threads (threading.Lock) and processes (flock on the segment's fd)."""

    def __init__(self, segment: Segment):
        self._segment = segment
        self._thread_lock = threading.Lock()

    def __enter__(self):
        self._thread_lock.acquire()
        try:
            fcntl.flock(self._segment.fd, fcntl.LOCK_EX)
        except BaseException:
            self._thread_lock.release()
            raise
        return self

    def __exit__(self, *exc):
        try:
            fcntl.flock(self._segment.fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()
