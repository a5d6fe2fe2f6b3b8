import gc
import glob
import multiprocessing
import os

import pytest

from paraspec.runtime import Runtime
from tests.runtime.toy_model import make_toy


def segments_of(pid: int) -> list[str]:
    """Shared-memory segments owned by process `pid` (paraspec names them paraspec_<pid>_...)."""
    return sorted(glob.glob(f"/dev/shm/paraspec_{pid}_*"))


def process_running(pid: int) -> bool:
    """True if `pid` exists and is not a zombie (a reaped or exited process counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


@pytest.fixture(scope="session", autouse=True)
def nothing_left_at_the_end():
    """After every runtime test (and the shared runtime) is done: no worker process, no segment of ours."""
    yield
    gc.collect()
    assert segments_of(os.getpid()) == []
    assert [p for p in multiprocessing.active_children() if p.name.startswith("paraspec-")] == []


@pytest.fixture(scope="session")
def pair():
    """One process runtime for the session: worker w0 on core 0, w1 on core 1 (spawning costs ~2 s). Like an
    Engine's, it lives on across requests: a test adds its own channels (never reused), and a test that stops the
    runtime leaves its stop signal set (no loop of the other tests reads it)."""
    rt = Runtime("process")
    rt.add_worker("w0", "cpu:0", make_toy, {"vocab_size": 64})
    rt.add_worker("w1", "cpu:1", make_toy, {"vocab_size": 64})
    rt.wait_ready(timeout=60)
    yield rt
    rt.close()
