"""Run by test_faults: a process that owns a runtime with a worker blocked in a loop, until a signal.

    python -m tests.runtime.sigint_child with|atexit|sigkill     (sigkill: the test kills it; no cleanup runs)
prints one JSON line {"pid", "workers", "segments"} once everything is up, then blocks.
"""

import glob
import json
import os
import signal
import sys

from paraspec.runtime import Runtime
from tests.runtime import loops
from tests.runtime.toy_model import make_toy

if __name__ == "__main__":
    # a shell that runs the suite in the background (nohup ... &) starts us with SIGINT ignored, and Python
    # then installs no KeyboardInterrupt handler: restore it, Ctrl-C is what this process is here to receive
    signal.signal(signal.SIGINT, signal.default_int_handler)
    mode = sys.argv[1]
    rt = Runtime("process")
    worker = rt.add_worker("w", "cpu:0", make_toy)
    channel = rt.channel("tokens", capacity=64, vocab_size=32, q_window=4)
    channel.reset([1, 2, 3])
    worker.wait_ready(timeout=60)
    handle = worker.start_loop(loops.wait_until_stopped, channel=channel)
    print(
        json.dumps(
            {
                "pid": os.getpid(),
                "workers": [worker.pid],
                "segments": sorted(glob.glob(f"/dev/shm/paraspec_{os.getpid()}_*")),
            }
        ),
        flush=True,
    )
    if mode == "with":
        with rt:
            handle.result()  # Ctrl-C lands here; leaving the with-block closes the runtime
    else:
        handle.result()  # no with: the runtime's atexit finalizer has to clean up
