"""Run by tests/runtime/test_workers.py in a fresh interpreter (a fresh fork server): the server starts while this
process is pinned to one core; a worker on `cpu` started after the pinning is undone must get every core."""

import json
import os

from paraspec.runtime import Runtime
from tests.runtime.toy_model import make_toy

if __name__ == "__main__":
    everything = sorted(os.sched_getaffinity(0))
    with Runtime("process") as rt:
        os.sched_setaffinity(0, {everything[0]})
        rt.add_worker("pinned", "cpu", make_toy).wait_ready(timeout=60)
        os.sched_setaffinity(0, set(everything))
        worker = rt.add_worker("free", "cpu", make_toy)
        worker.wait_ready(timeout=60)
        print(json.dumps({"caller": everything, "pinned": rt["pinned"].info.cores, "free": worker.info.cores}))
