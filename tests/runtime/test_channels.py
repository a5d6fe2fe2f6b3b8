"""TokenChannel and StopSignal semantics, in one process (threads stand in for the other side)."""

import os
import pickle
import resource
import threading
import time

import numpy as np
import pytest

from paraspec.runtime.channels import ChannelFull, ChannelStopped, StaleVersion, StopSignal, TokenChannel
from paraspec.runtime.net_channel import ChannelServer, RemoteChannel, RemoteStopSignal
from tests.runtime.conftest import segments_of


@pytest.fixture(params=["shm", "tcp"])
def channel(request):
    """The channel as a local worker sees it (shared memory) and as a worker on another host does (net_channel:
    every call over TCP to the owner's channel): every test below holds for both."""
    ch = TokenChannel(32, vocab_size=8, q_window=4, tag="test")
    if request.param == "shm":
        yield ch
    else:
        stop = StopSignal("test-stop")
        server = ChannelServer({"test": ch}, stop)
        remote = RemoteChannel(server.address, "test")
        yield remote
        remote.close()
        server.close()
        stop.close()
    ch.close()


def test_segment_name_and_unlink():
    ch = TokenChannel(8, tag="named")
    assert ch.name.startswith(f"paraspec_{os.getpid()}_") and ch.name.endswith("_named")
    assert f"/dev/shm/{ch.name}" in segments_of(os.getpid())
    ch.close()
    assert f"/dev/shm/{ch.name}" not in segments_of(os.getpid())


def test_segments_of_a_killed_owner_are_reaped():
    """A SIGKILLed owner whose resource tracker died with it unlinks nothing: the next process to create a
    segment removes this user's paraspec segments whose owner pid is gone, and only those."""
    import subprocess

    from paraspec.runtime import shm

    dead = subprocess.Popen(["true"])
    dead.wait()  # an exited, reaped pid
    names = {
        "stale": f"paraspec_{dead.pid}_3_stop",
        "live": f"paraspec_{os.getpid()}_9999_stop",
        "other": "someone_else_1_x",
        "odd": "paraspec_notapid_1_x",
    }
    fds = [shm._posixshmem.shm_open("/" + n, os.O_CREAT | os.O_RDWR, mode=0o600) for n in names.values()]
    try:
        removed = shm.reap_stale()  # (other dead owners' leftovers may go too)
        assert names["stale"] in removed and not os.path.exists(f"/dev/shm/{names['stale']}")
        kept = {n for k, n in names.items() if k != "stale"}
        assert kept <= set(os.listdir("/dev/shm")) and not kept & set(removed)
    finally:
        for fd, n in zip(fds, names.values()):
            os.close(fd)
            if os.path.exists(f"/dev/shm/{n}"):
                os.unlink(f"/dev/shm/{n}")


def test_reset_publish_commit_accept_all(channel):
    v = channel.reset([5, 6, 7])
    assert channel.state() == (v, 3, 3, False)
    assert channel.publish_draft(3, [10, 11], version=v)
    snap = channel.snapshot()
    assert (snap.version, snap.committed, snap.length, snap.start) == (v, 3, 5, 3)
    assert snap.tokens.tolist() == [10, 11] and snap.stamps.tolist() == [v, v]
    # both drafts right, plus a bonus token beyond them: no rollback, version unchanged
    result = channel.commit([10, 11, 12])
    assert result == (v, 6, 6, None)
    assert channel.tokens().tolist() == [5, 6, 7, 10, 11, 12]


def test_mismatch_bumps_version_and_drops_later_drafts(channel):
    v = channel.reset([1])
    assert channel.publish_draft(1, [2, 3, 4], version=v)
    result = channel.commit([2, 9])  # first draft accepted, second replaced by a correction
    assert result.rollback_at == 2 and result.version == v + 1
    assert channel.state() == (v + 1, 3, 3, False)
    assert channel.tokens().tolist() == [1, 2, 9]
    # the drafter, still at version v, can no longer publish anywhere
    assert not channel.publish_draft(3, [4], version=v)
    assert channel.length == 3


def test_read_since_gives_the_whole_sequence_after_a_version_change(channel):
    """A drafter's one read per step: its tail while the version holds, everything once it moved (so it finds
    what its cache still holds), and publish_and_read brings that read along with the publish."""
    v = channel.reset([1, 2])
    ok, snap = channel.publish_and_read(2, [3], version=v)
    assert ok and (snap.version, snap.start, snap.tokens.tolist()) == (v, 2, [3])
    assert channel.read_since(3, v).tokens.tolist() == []
    channel.commit([7])  # rejects the draft 3: version v + 1
    snap = channel.read_since(3, v)
    assert (snap.version, snap.start, snap.tokens.tolist()) == (v + 1, 0, [1, 2, 7])
    ok, snap = channel.publish_and_read(3, [4], version=v)  # stale: nothing published, the whole sequence read
    assert not ok and (snap.version, snap.start, snap.tokens.tolist()) == (v + 1, 0, [1, 2, 7])
    assert channel.read_since(0, None).start == 0  # a drafter that has seen no version yet


def test_wait_below_ahead_returns_the_next_read(channel):
    v = channel.reset([1])
    assert channel.publish_draft(1, [2, 3], version=v)
    assert channel.wait_below_ahead(2, 3, v, timeout=0.05) is None  # two drafts ahead: it waits
    threading.Timer(0.05, lambda: channel.commit([2])).start()  # the verifier accepts one
    snap = channel.wait_below_ahead(2, 3, v, timeout=5)
    assert (snap.version, snap.committed, snap.start, snap.tokens.tolist()) == (v, 2, 3, [])
    channel.commit([9])  # rejects 3: the version moves
    snap = channel.wait_below_ahead(5, 3, v, timeout=5)
    assert (snap.version, snap.start, snap.tokens.tolist()) == (v + 1, 0, [1, 2, 9])


def test_stale_version_never_passes_as_current(channel):
    v = channel.reset([1, 2, 3])
    assert channel.publish_draft(3, [10, 11], version=v)
    got = {}

    def reader():  # waits for a 6th token at version v; a rollback happens instead
        got["snap"] = channel.wait_for_draft(6, version=v, timeout=5)

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.05)
    channel.commit([99])  # reject the drafts: version v+1, length 4
    t.join()
    snap = got["snap"]
    assert snap.version == v + 1
    assert snap.tokens.tolist() == [] and 10 not in snap.tokens and 11 not in snap.tokens
    # a stale drafter cannot refill the range; the next reader at v+1 sees only v+1 drafts
    assert not channel.publish_draft(4, [12], version=v)
    assert channel.wait_for_draft(5, version=v + 1, timeout=0.05) is None
    assert channel.publish_draft(4, [20], version=v + 1)
    snap = channel.wait_for_draft(5, version=v + 1, timeout=1)
    assert snap.tokens.tolist() == [20] and snap.stamps.tolist() == [v + 1]


def test_publish_over_committed_tokens_compares(channel):
    v = channel.reset([1])
    channel.commit([2, 3])  # the verifier ran ahead of the drafter (no drafts there)
    assert channel.version == v
    assert channel.publish_draft(1, [2, 3, 4], version=v)  # agrees with what is there: appends 4
    assert channel.tokens().tolist() == [1, 2, 3, 4]
    assert not channel.publish_draft(2, [7, 8], version=v)  # contradicts a committed token
    assert channel.tokens().tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="gap"):
        channel.publish_draft(6, [1], version=v)


def test_commit_order_and_expected_version(channel):
    v = channel.reset([1, 2])
    with pytest.raises(ValueError, match="in order"):
        channel.commit([3], start=5)
    assert channel.commit([3], version=v + 7) is None  # stale expectation: nothing happens
    assert channel.committed == 2
    assert channel.commit([3], start=2, version=v).committed == 3


def test_discard_drafts(channel):
    v = channel.reset([1])
    channel.publish_draft(1, [2, 3], version=v)
    assert channel.discard_drafts() == v + 1
    assert channel.state() == (v + 1, 1, 1, False)


def test_q_ring(channel):
    v = channel.reset([0])
    q = np.arange(3 * 8, dtype=np.float32).reshape(3, 8)
    assert channel.publish_draft(1, [4, 5, 6], q, version=v)
    assert np.array_equal(channel.read_q(1, 4, version=v), q)
    assert np.array_equal(channel.read_q(2, 3), q[1:2])
    with pytest.raises(StaleVersion):
        channel.read_q(1, 4, version=v - 1)
    # window 4: committed 1, so positions up to 4 fit and position 5 does not
    assert channel.wait_for_room(5, version=v, timeout=0) is not None
    with pytest.raises(ChannelFull, match="q_window"):
        channel.publish_draft(4, [7, 8], np.zeros((2, 8)), version=v)
    assert channel.wait_for_room(6, version=v, timeout=0.01) is None
    channel.commit([4, 5])  # committed 3: positions up to 7 fit; ring slots get reused
    assert channel.publish_draft(4, [7, 8], np.ones((2, 8)), version=v)
    assert np.array_equal(channel.read_q(3, 6), np.concatenate([q[2:], np.ones((2, 8))]))
    with pytest.raises(KeyError):  # position 5 took position 1's slot
        channel.read_q(1, 2)


def test_q_errors(channel):
    v = channel.reset([0])
    channel.publish_draft(1, [3], version=v)  # drafted without q
    with pytest.raises(KeyError):
        channel.read_q(1, 2)
    with pytest.raises(ValueError, match="columns"):
        channel.publish_draft(2, [3], np.zeros((1, 5)), version=v)
    plain = TokenChannel(4)
    try:
        with pytest.raises(ValueError, match="no q"):
            plain.publish_draft(0, [1], np.zeros((1, 4)), version=0)
    finally:
        plain.close()


def test_capacity(channel):
    with pytest.raises(ChannelFull):
        channel.reset(list(range(33)))
    channel.reset(list(range(30)))
    with pytest.raises(ChannelFull, match="capacity"):
        channel.commit([1, 2, 3])


def test_stop_wakes_waiters_and_refuses_writes(channel):
    v = channel.reset([1])
    errors = []

    def waiter():
        try:
            channel.wait_for_draft(10)
        except ChannelStopped as e:
            errors.append((e.reason, time.perf_counter()))

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.1)
    stopped_at = time.perf_counter()
    channel.stop("request finished")
    t.join(2)
    assert not t.is_alive()
    assert errors and errors[0][0] == "request finished" and errors[0][1] - stopped_at < 0.1
    with pytest.raises(ChannelStopped):
        channel.publish_draft(1, [2], version=v)
    with pytest.raises(ChannelStopped):
        channel.commit([2])
    channel.reset([1])  # reset clears the stop
    assert not channel.stopped and channel.publish_draft(1, [2], version=v + 1)


def test_satisfied_wait_wins_over_stop(channel):
    channel.reset([1])
    channel.commit([2, 3])
    channel.stop("done")
    assert channel.wait_for_commit(3, timeout=0).committed == 3  # the last tokens are not lost
    with pytest.raises(ChannelStopped):
        channel.wait_for_commit(4, timeout=0)


def test_wait_blocks_without_polling_and_wakes_promptly(channel):
    """The waiter sleeps in the kernel: a couple of context switches in 0.5 s, not hundreds."""
    v = channel.reset([1])
    seen = {}

    def waiter():
        before = resource.getrusage(resource.RUSAGE_THREAD)
        snap = channel.wait_for_draft(2, version=v, timeout=10)
        seen["woke"] = time.perf_counter()
        after = resource.getrusage(resource.RUSAGE_THREAD)
        seen["switches"] = after.ru_nvcsw - before.ru_nvcsw
        seen["tokens"] = snap.tokens.tolist()

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.5)
    published = time.perf_counter()
    channel.publish_draft(1, [42], version=v)
    t.join(5)
    assert seen["tokens"] == [42]
    assert seen["woke"] - published < 0.25  # typically ~0.1 ms; generous for a loaded machine
    assert seen["switches"] < 20, seen


def test_timeout_returns_none_on_time(channel):
    channel.reset([1])
    start = time.perf_counter()
    assert channel.wait_for_version_change(channel.version, timeout=0.2) is None
    assert 0.19 <= time.perf_counter() - start < 1.5  # on time, not at once; the upper bound is for a loaded machine


def test_pickle_in_same_process_is_the_same_object(channel):
    if isinstance(channel, RemoteChannel):
        pytest.skip("a remote proxy pickles as its address: a copy that opens its own connection")
    assert pickle.loads(pickle.dumps(channel)) is channel


@pytest.mark.parametrize("where", ["shm", "tcp"])
def test_stop_signal(where):
    owned = StopSignal("t")
    server = ChannelServer({}, owned) if where == "tcp" else None
    stop = owned if server is None else RemoteStopSignal(server.address)
    try:
        assert not stop.is_set() and stop.wait(0.01) is False
        threading.Timer(0.05, stop.set, args=("bye",)).start()
        assert stop.wait(5) is True and stop.reason == "bye"
        owned.clear()
        assert not stop.is_set()
    finally:
        if server is not None:
            stop.close()
            server.close()
        owned.close()


class Served:
    """A channel of 8 tokens served over TCP as the caller's Runtime serves it, and the proxies and servers a test
    opens on it; close() closes them all."""

    def __init__(self):
        self.channel, self.stop = TokenChannel(8, tag="served"), StopSignal("served-stop")
        self.server = ChannelServer({"served": self.channel}, self.stop)
        self.opened = [self.server]

    def remote(self, server: ChannelServer | None = None, name: str = "served", latency_s: float = 0.0):
        self.opened.append(RemoteChannel((server or self.server).address, name, latency_s))
        return self.opened[-1]

    def another_server(self) -> ChannelServer:
        self.opened.append(ChannelServer({}, self.stop))
        return self.opened[-1]

    def close(self) -> None:
        for closable in self.opened + [self.channel, self.stop]:
            closable.close()


@pytest.fixture
def served():
    served = Served()
    yield served
    served.close()


def test_a_remote_channel_whose_server_is_gone_reads_as_stopped(served):
    """A worker on another host whose caller went away: its next call raises ChannelStopped, it never hangs."""
    remote = served.remote()
    v = remote.reset([1, 2])
    errors = []

    def waiter():
        try:
            remote.wait_for_draft(5, version=v)
        except ChannelStopped as e:
            errors.append(e.reason)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.2)
    served.server.close()  # the caller's end disappears while the worker waits
    t.join(5)
    assert not t.is_alive() and errors and "lost" in errors[0]
    with pytest.raises(ChannelStopped):
        remote.state()
    with pytest.raises(KeyError, match="no channel named"):
        served.remote(served.another_server(), "nope").state()


def test_link_latency_is_paid_per_message(served):
    fast, slow = served.remote(), served.remote(latency_s=0.05)
    fast.reset([1])
    slow.state()  # connected
    start = time.perf_counter()
    for _ in range(4):
        slow.state()
    assert time.perf_counter() - start >= 4 * 2 * 0.05  # a request and its reply: two messages per call


def test_the_drafter_says_when_it_has_read_the_prompt_and_a_new_request_forgets_it(channel):
    """amusd's verifier decodes on its own until the draft has read its prompt (draft_ready), on either transport."""
    channel.reset([1, 2, 3])
    assert channel.draft_ready() is False
    channel.mark_draft_ready()
    assert channel.draft_ready() is True
    channel.reset([4, 5])
    assert channel.draft_ready() is False
