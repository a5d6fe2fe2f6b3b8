"""Shared-memory token channels with versioned positions, and a shared stop signal.

A `TokenChannel` is the one place where a drafter and its verifier(s) exchange tokens:

    positions [0, committed)        verified tokens: the prompt, then every accepted token and correction
    positions [committed, length)   drafted tokens not verified yet, each stamped with the version it was
                                    drafted under (always the current version: a rollback empties this range)
    version                         bumped on every rollback (and on reset), never decreases; a drafter whose
                                    version is stale can no longer publish, and a reader that asked for
                                    version v never gets tokens drafted under another version unannounced
    q ring (optional, sampling)     the draft's processed distribution q [vocab] for drafted positions, kept
                                    in a ring of `q_window` rows keyed by position (position % q_window). It
                                    bounds how far the drafter may run ahead: a drafted position p needs
                                    p < committed + q_window. 64 rows x 151,936 vocab x 4 B = 39 MB.

Writers: the drafter calls `publish_draft(position, tokens, q, version=...)`; the verifier calls
`commit(tokens)` with the tokens it verified (accepted drafts + correction or bonus token): where they differ
from the drafts the channel bumps the version and drops every later draft. Readers get consistent copies
(all reads and writes hold one lock). Waits block in the kernel (futex), wake on any change, and raise
`ChannelStopped` once the channel is stopped (end of request, a failed worker, close()).

The parent (a `Runtime`) creates and unlinks channels; a channel pickles as its segment name, so it can be
handed to a worker as an argument at any time: the worker attaches once and keeps the mapping.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from typing import NamedTuple, overload

import numpy as np

from paraspec.runtime.shm import ProcessLock, Segment, futex_wait, futex_wake_all


class ChannelStopped(RuntimeError):
    """The channel (or stop signal) was stopped; `reason` says by whom and why."""

    def __init__(self, reason: str):
        super().__init__(reason or "stopped")
        self.reason = reason


class ChannelFull(RuntimeError):
    pass


class StaleVersion(RuntimeError):
    pass


class ChannelState(NamedTuple):
    version: int
    committed: int  # verified tokens
    length: int  # committed + drafted
    stopped: bool


class DraftSnapshot(NamedTuple):
    version: int
    committed: int
    length: int
    start: int  # position of tokens[0]
    tokens: np.ndarray  # int64 copy of positions [start, start + len(tokens))
    stamps: np.ndarray  # int64 version each of those tokens was written under


class CommitResult(NamedTuple):
    version: int
    committed: int
    length: int
    rollback_at: int | None  # first position whose draft was replaced (None: every overlapping draft matched)


# header slots (int64); slot 0's low 32 bits are the futex sequence word
_SEQ, _STOPPED, _REASON_LEN, _KIND, _VERSION, _COMMITTED, _LENGTH, _CAPACITY, _VOCAB, _WINDOW, _READY = range(11)
_HEADER_BYTES = 16 * 8
_REASON_BYTES = 256
_DATA_OFFSET = _HEADER_BYTES + _REASON_BYTES
_KIND_STOP, _KIND_CHANNEL = 1, 2

_live: weakref.WeakValueDictionary[str, _SharedBlock] = weakref.WeakValueDictionary()
_attached: dict[str, _SharedBlock] = {}  # this process's attachments (not owned), kept for reuse


def _attach(cls, name: str):
    block = _live.get(name)
    if block is None:
        block = cls._from_segment(Segment.attach(name))
        _attached[name] = block
    return block


def _as_array(x, dtype) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor, without importing torch here
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


class _SharedBlock:
    """A segment with a header, a lock and a futex word: the waiting and stopping shared by both classes."""

    _kind = 0

    def __init__(self, segment: Segment):
        self._segment = segment
        self._lock = ProcessLock(segment)
        self._header = np.ndarray((16,), np.int64, buffer=segment.buf)
        self._change_count = np.ndarray((1,), np.uint32, buffer=segment.buf)
        self._change_count_address = self._change_count.__array_interface__["data"][0]
        self._reason = np.ndarray((_REASON_BYTES,), np.uint8, buffer=segment.buf, offset=_HEADER_BYTES)
        _live[segment.name] = self

    @classmethod
    def _from_segment(cls, segment: Segment):
        block = cls.__new__(cls)
        _SharedBlock.__init__(block, segment)
        if int(block._header[_KIND]) != cls._kind:
            raise TypeError(f"shared segment {segment.name} is not a {cls.__name__}")
        block._map_data()
        return block

    def _map_data(self) -> None:
        pass

    @property
    def name(self) -> str:
        return self._segment.name

    def __reduce__(self):
        return _attach, (type(self), self._segment.name)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    # -- waking and waiting ---------------------------------------------------------------------------------
    def _bump(self) -> None:
        """Mark a change; call with the lock held, then `_wake()` after releasing it."""
        self._change_count[0] = (int(self._change_count[0]) + 1) & 0xFFFFFFFF

    def _wake(self) -> None:
        futex_wake_all(self._change_count_address)

    def _wait(self, check: Callable[[], object], timeout: float | None):
        """Return check()'s first non-None value (evaluated under the lock), or None after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                seen = int(self._change_count[0])
                result = check()
                if result is not None:
                    return result
                if self._header[_STOPPED]:
                    raise ChannelStopped(self._read_reason())
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            futex_wait(self._change_count_address, seen, remaining)

    # -- stopping -------------------------------------------------------------------------------------------
    def _read_reason(self) -> str:
        n = int(self._header[_REASON_LEN])
        return bytes(self._reason[:n]).decode("utf-8", "replace")

    def _stop(self, reason: str) -> None:
        # Lock-free on purpose: stopping runs on failure and shutdown paths and must never block. The flag is
        # written before the sequence word, so a waiter either sees it under the lock or is woken after.
        data = reason.encode("utf-8")[:_REASON_BYTES]
        self._reason[: len(data)] = np.frombuffer(data, np.uint8)
        self._header[_REASON_LEN] = len(data)
        self._header[_STOPPED] = 1
        self._bump()
        self._wake()

    @property
    def stopped(self) -> bool:
        return bool(self._header[_STOPPED])

    @property
    def reason(self) -> str:
        return self._read_reason()

    def close(self) -> None:
        """Unmap; the owner also unlinks the segment (after waking every waiter with a stop). Repeatable."""
        if self._segment.fd < 0:
            self._segment.close()  # finishes the unlink of a close that was interrupted
            return
        if self._segment.owner and not self.stopped:
            self._stop("channel closed")
        _live.pop(self.name, None)
        _attached.pop(self.name, None)
        segment = self._segment
        for attr in list(vars(self)):
            if isinstance(getattr(self, attr), np.ndarray):
                setattr(self, attr, None)
        segment.close()


class StopSignal(_SharedBlock):
    """A process-shared flag with a reason: `set()`, `clear()`, `is_set()`, blocking `wait(timeout)`."""

    _kind = _KIND_STOP

    def __init__(self, tag: str = "stop"):
        super().__init__(Segment.create(tag, _DATA_OFFSET))
        self._header[_KIND] = self._kind

    def set(self, reason: str = "stopped") -> None:
        self._stop(reason)

    def clear(self) -> None:
        with self._lock:
            self._header[_STOPPED] = 0
            self._header[_REASON_LEN] = 0
            self._bump()
        self._wake()

    def is_set(self) -> bool:
        return self.stopped

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set (True) or `timeout` seconds pass (False)."""
        try:
            return self._wait(lambda: None, timeout) is not None
        except ChannelStopped:
            return True


class TokenChannel(_SharedBlock):
    """Token ids, per-position version stamps, committed/drafted lengths, a version, and optionally q."""

    _kind = _KIND_CHANNEL

    def __init__(self, capacity: int, *, vocab_size: int | None = None, q_window: int = 64, tag: str = "tokens"):
        if capacity <= 0:
            raise ValueError(f"channel capacity must be positive, got {capacity}")
        if vocab_size is not None and (vocab_size <= 0 or q_window <= 0):
            raise ValueError(f"q needs vocab_size > 0 and q_window > 0, got {vocab_size}, {q_window}")
        window = q_window if vocab_size else 0
        super().__init__(Segment.create(tag, self._layout(capacity, vocab_size or 0, window)[-1]))
        h = self._header
        h[_KIND], h[_CAPACITY], h[_VOCAB], h[_WINDOW] = self._kind, capacity, vocab_size or 0, window
        self._map_data()
        self._q_pos[:] = -1

    @staticmethod
    def _layout(capacity: int, vocab: int, window: int) -> tuple[int, ...]:
        tokens = _DATA_OFFSET
        stamps = tokens + 8 * capacity
        q_pos = stamps + 8 * capacity
        q_ver = q_pos + 8 * window
        q = (q_ver + 8 * window + 63) // 64 * 64
        return tokens, stamps, q_pos, q_ver, q, q + 4 * window * vocab

    def _map_data(self) -> None:
        cap, vocab, window = (int(self._header[i]) for i in (_CAPACITY, _VOCAB, _WINDOW))
        buf = self._segment.buf
        tokens, stamps, q_pos, q_ver, q, _ = self._layout(cap, vocab, window)
        self._tokens = np.ndarray((cap,), np.int64, buffer=buf, offset=tokens)
        self._stamps = np.ndarray((cap,), np.int64, buffer=buf, offset=stamps)
        self._q_pos = np.ndarray((window,), np.int64, buffer=buf, offset=q_pos)
        self._q_ver = np.ndarray((window,), np.int64, buffer=buf, offset=q_ver)
        self._q = np.ndarray((window, vocab), np.float32, buffer=buf, offset=q)

    # -- fixed geometry ---------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return int(self._header[_CAPACITY])

    @property
    def vocab_size(self) -> int | None:
        return int(self._header[_VOCAB]) or None

    @property
    def q_window(self) -> int:
        return int(self._header[_WINDOW])

    # -- reads ------------------------------------------------------------------------------------------------
    def _state(self) -> ChannelState:
        h = self._header
        return ChannelState(int(h[_VERSION]), int(h[_COMMITTED]), int(h[_LENGTH]), bool(h[_STOPPED]))

    def state(self) -> ChannelState:
        with self._lock:
            return self._state()

    @property
    def version(self) -> int:
        return int(self._header[_VERSION])  # one aligned int64: a consistent read without the lock

    @property
    def committed(self) -> int:
        return int(self._header[_COMMITTED])

    @property
    def length(self) -> int:
        return int(self._header[_LENGTH])

    def _snapshot(self, start: int | None, end: int | None) -> DraftSnapshot:
        version, committed, length, _ = self._state()
        start = committed if start is None else start
        end = length if end is None else max(start, min(end, length))
        return DraftSnapshot(
            version, committed, length, start, self._tokens[start:end].copy(), self._stamps[start:end].copy()
        )

    def snapshot(self, start: int | None = None, end: int | None = None) -> DraftSnapshot:
        """Tokens of positions [start, end) (default: the drafts, [committed, length)) with their stamps."""
        with self._lock:
            return self._snapshot(start, end)

    def read_since(self, start: int, version: int | None) -> DraftSnapshot:
        """A drafter's one read per step: positions [start, length) while the channel is still at `version`;
        after a change of version (a rejection, a new request) the whole sequence [0, length) instead
        (`.start == 0`), from which the drafter finds what its cache still holds. One round trip on the network
        transport where a check and a re-read would take two."""
        with self._lock:
            moved = int(self._header[_VERSION]) != version
            return self._snapshot(0 if moved else start, None)

    def tokens(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """Copy of the tokens at positions [start, end); end defaults to length, drafts included."""
        with self._lock:
            end = int(self._header[_LENGTH]) if end is None else end
            return self._tokens[start:end].copy()

    def read_q(self, start: int, end: int, *, version: int | None = None) -> np.ndarray:
        """Copy of q [end - start, vocab] for drafted positions [start, end); raises StaleVersion when the
        channel moved past `version`, KeyError when a position has no q (never drafted with one, or gone)."""
        if not self.q_window:
            raise ValueError("this channel stores no q; create it with vocab_size=... to keep q")
        with self._lock:
            current, _, length, _ = self._state()
            if version is not None and version != current:
                raise StaleVersion(f"q requested for version {version}, channel is at version {current}")
            positions = np.arange(start, end)
            slots = positions % self.q_window
            ok = (
                (end <= length)
                & np.all(self._q_pos[slots] == positions)
                & np.all(self._q_ver[slots] == self._stamps[start:end])
            )
            if not ok:
                raise KeyError(
                    f"no q stored for positions [{start}, {end}) (length {length}, q_window "
                    f"{self.q_window}): not drafted with q, or overwritten"
                )
            return self._q[slots]  # fancy indexing copies

    # -- writes -----------------------------------------------------------------------------------------------
    def _check_running(self) -> None:
        if self._header[_STOPPED]:
            raise ChannelStopped(self._read_reason())

    def reset(self, prompt: Sequence[int] | np.ndarray) -> int:
        """Start a request: the prompt becomes the committed prefix, drafts and the stop flag are cleared,
        and the version is bumped (so nothing from the previous request can pass as current)."""
        prompt = _as_array(prompt, np.int64).ravel()
        if len(prompt) > self.capacity:
            raise ChannelFull(f"prompt of {len(prompt)} tokens exceeds the channel capacity {self.capacity}")
        with self._lock:
            h = self._header
            version = int(h[_VERSION]) + 1
            n = len(prompt)
            self._tokens[:n] = prompt
            self._stamps[:n] = version
            self._q_pos[:] = -1
            h[_VERSION], h[_COMMITTED], h[_LENGTH] = version, n, n
            h[_STOPPED], h[_REASON_LEN], h[_READY] = 0, 0, 0
            self._bump()
        self._wake()
        return version

    def mark_draft_ready(self) -> None:
        """The drafter has read this request's prompt (with lent cores the target decodes on its own until then)."""
        self._header[_READY] = 1

    def draft_ready(self) -> bool:
        """Whether the drafter has read this request's prompt (reset() clears it)."""
        return bool(self._header[_READY])

    def publish_draft(self, position: int, tokens: Sequence[int] | np.ndarray, q=None, *, version: int) -> bool:
        """Append drafted tokens at `position` (<= length), with q [len(tokens), vocab] if sampling.

        Returns False, changing nothing, when `version` is stale or the tokens contradict what the channel
        already holds at those positions (the verifier committed something else there): the drafter must
        resync from `snapshot()`. Raises ChannelFull past the capacity or the q window, ChannelStopped when
        stopped. Positions the channel already holds with the same tokens are accepted and skipped.
        """
        tokens = _as_array(tokens, np.int64).ravel()
        n = len(tokens)
        if q is not None:
            if not self.q_window:
                raise ValueError("this channel stores no q; create it with vocab_size=... to publish q")
            q = _as_array(q, np.float32).reshape(n, -1)
            if q.shape[1] != self.vocab_size:
                raise ValueError(f"q has {q.shape[1]} columns, the channel's vocab_size is {self.vocab_size}")
        end = position + n
        with self._lock:
            self._check_running()
            h = self._header
            current, committed, length = int(h[_VERSION]), int(h[_COMMITTED]), int(h[_LENGTH])
            if version != current:
                return False
            if position > length:
                raise ValueError(f"draft at position {position} would leave a gap after length {length}")
            if end > self.capacity:
                raise ChannelFull(f"draft up to position {end} exceeds the channel capacity {self.capacity}")
            overlap = min(end, length)
            if overlap > position and np.any(self._tokens[position:overlap] != tokens[: overlap - position]):
                return False
            new = max(position, length)
            if end <= new:
                return True
            if q is not None and end > committed + self.q_window:
                raise ChannelFull(
                    f"draft up to position {end} runs more than q_window={self.q_window} ahead "
                    f"of the {committed} committed tokens; wait_for_room({end}) first"
                )
            self._tokens[new:end] = tokens[new - position :]
            self._stamps[new:end] = current
            if q is not None:
                slots = np.arange(new, end) % self.q_window
                self._q[slots] = q[new - position :]
                self._q_pos[slots] = np.arange(new, end)
                self._q_ver[slots] = current
            h[_LENGTH] = end
            self._bump()
        self._wake()
        return True

    def wait_below_ahead(
        self, max_ahead: int, start: int, version: int | None, timeout: float | None = None
    ) -> DraftSnapshot | None:
        """A drafter `max_ahead` drafts ahead of the verifier: wait until it falls behind that (or the version
        moves), then `read_since(start, version)`; None on timeout. On the network transport the wait runs where
        the channel is, so the drafter hears of it in one message and has its next read with it."""
        state = self.wait_until(lambda s: s.version != version or s.length - s.committed < max_ahead, timeout)
        return None if state is None else self.read_since(start, version)

    def publish_and_read(
        self, position: int, tokens: Sequence[int], q=None, *, version: int
    ) -> tuple[bool, DraftSnapshot]:
        """`publish_draft`, then `read_since(position, version)`: what the drafter needs for its next step, in
        the same round trip as the publish on the network transport."""
        published = self.publish_draft(position, tokens, q, version=version)
        return published, self.read_since(position, version)

    @overload
    def commit(
        self, tokens: Sequence[int] | np.ndarray, *, start: int | None = None, version: None = None
    ) -> CommitResult: ...
    @overload
    def commit(
        self, tokens: Sequence[int] | np.ndarray, *, start: int | None = None, version: int
    ) -> CommitResult | None: ...
    def commit(
        self, tokens: Sequence[int] | np.ndarray, *, start: int | None = None, version: int | None = None
    ) -> CommitResult | None:
        """Record verified tokens at positions [committed, committed + len(tokens)).

        Where they differ from the drafts there, the version is bumped and every draft from the first
        difference on is dropped (a rollback); tokens beyond the drafts are appended. With `version`, nothing
        happens and None is returned if the channel is no longer at that version.
        """
        tokens = _as_array(tokens, np.int64).ravel()
        with self._lock:
            self._check_running()
            h = self._header
            current, committed, length = int(h[_VERSION]), int(h[_COMMITTED]), int(h[_LENGTH])
            if version is not None and version != current:
                return None
            if start is not None and start != committed:
                raise ValueError(
                    f"commit at position {start} but {committed} tokens are committed: "
                    f"commits must extend the committed prefix in order"
                )
            end = committed + len(tokens)
            if end > self.capacity:
                raise ChannelFull(f"commit up to position {end} exceeds the channel capacity {self.capacity}")
            overlap = min(end, length)
            differ = np.nonzero(self._tokens[committed:overlap] != tokens[: overlap - committed])[0]
            rollback_at = committed + int(differ[0]) if differ.size else None
            self._tokens[committed:end] = tokens
            if rollback_at is not None:
                current += 1
                self._stamps[rollback_at:end] = current
                h[_VERSION], h[_LENGTH] = current, end
            else:
                if end > length:
                    self._stamps[length:end] = current
                h[_LENGTH] = max(length, end)
            h[_COMMITTED] = end
            self._bump()
            result = CommitResult(current, end, int(h[_LENGTH]), rollback_at)
        self._wake()
        return result

    def discard_drafts(self) -> int:
        """Drop every draft (a rollback without a commit) and return the new version."""
        with self._lock:
            h = self._header
            h[_VERSION] += 1
            h[_LENGTH] = h[_COMMITTED]
            version = int(h[_VERSION])
            self._bump()
        self._wake()
        return version

    def stop(self, reason: str = "stopped") -> None:
        """Wake every waiter with ChannelStopped(reason); publish/commit refuse until reset()."""
        self._stop(reason)

    # -- waits: block in the kernel; return None on timeout; raise ChannelStopped once stopped ---------------
    def wait_until(
        self, predicate: Callable[[ChannelState], bool], timeout: float | None = None
    ) -> ChannelState | None:
        """Block until predicate(state) holds (checked under the lock at every change); return that state."""

        def check():
            state = self._state()
            return state if predicate(state) else None

        return self._wait(check, timeout)

    def wait_for_draft(
        self,
        min_length: int,
        *,
        version: int | None = None,
        start: int | None = None,
        max_length: int | None = None,
        timeout: float | None = None,
    ) -> DraftSnapshot | None:
        """Block until the channel holds `min_length` tokens (committed + drafted), or, with `version`,
        until the version moves past it; return a snapshot of [start (default committed), max_length).
        Check `snapshot.version`: when it differs from `version`, the drafts you were waiting for are gone."""

        def check():
            h = self._header
            if h[_LENGTH] >= min_length or (version is not None and h[_VERSION] != version):
                return self._snapshot(start, max_length)
            return None

        return self._wait(check, timeout)

    def wait_for_version_change(self, version: int, timeout: float | None = None) -> int | None:
        """Block until the version differs from `version`; return the new version."""

        def check():
            current = int(self._header[_VERSION])
            return current if current != version else None

        return self._wait(check, timeout)

    def wait_for_commit(self, min_committed: int, timeout: float | None = None) -> ChannelState | None:
        """Block until at least `min_committed` tokens are committed (a stopped channel still returns a
        state that satisfies it, so the last tokens of a finished request are never lost)."""
        return self.wait_until(lambda s: s.committed >= min_committed, timeout)

    def wait_for_room(self, end: int, *, version: int, timeout: float | None = None) -> ChannelState | None:
        """Block until drafts up to position `end` (exclusive) fit: inside the capacity and, with q, inside
        the q window (end <= committed + q_window); or until the version moves past `version` (then the
        drafter must resync instead of publishing)."""
        capacity, window = self.capacity, self.q_window
        return self.wait_until(
            lambda s: s.version != version or end <= (min(capacity, s.committed + window) if window else capacity),
            timeout,
        )

    # -- for a remote proxy (net_channel.py), whose predicates run on its own side ------------------------------
    def geometry(self) -> tuple[int, int | None, int]:
        return self.capacity, self.vocab_size, self.q_window

    def change_count_and_state(self) -> tuple[int, ChannelState]:
        """The change counter and the state, read together."""
        with self._lock:
            return int(self._change_count[0]), self._state()

    def wait_for_change(self, seen: int, timeout: float | None = None) -> bool:
        """Block until the change counter moves past `seen` (any write, a stop included); False on timeout."""
        try:
            return self._wait(lambda: True if int(self._change_count[0]) != seen else None, timeout) is not None
        except ChannelStopped:
            return True
