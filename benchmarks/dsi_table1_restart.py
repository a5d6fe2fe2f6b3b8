"""What one window costs the authors' thread-pool simulation besides its sleeps: their mechanism (dsi/online/run/
simulation_core.py at 91ab8b9, lines 215-238 and 14-25) forks a drafter process per window, sends it its pid
through a Pipe, touches a Manager dict, builds a ThreadPoolExecutor and kills itself with SIGTERM. The authors
subtract only the 0.1 s `wait_for_pipe` sleep, so this cost is inside their Table 1 times. Reproduced here (our
code, the same calls, no sleeps) to put a measured figure on `paraspec simulate table1 --restart-ms`.

    .venv/bin/python benchmarks/dsi_table1_restart.py --windows 40
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import signal
import statistics
import time
from concurrent.futures import ThreadPoolExecutor


def _window(shared, pipe) -> None:
    pool = ThreadPoolExecutor(max_workers=7)
    pool._work_queue = queue.LifoQueue()  # as the authors' (simulation_core.py:162-165)
    shared["correct"] = 3
    pool.submit(lambda: shared["correct"]).result()
    shared["total_tokens"] = shared["total_tokens"] + shared["correct"]
    pool.shutdown(wait=False, cancel_futures=True)
    os.kill(pipe[0].recv(), signal.SIGTERM)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--windows", type=int, default=40)
    args = p.parse_args()
    multiprocessing.set_start_method("fork")  # Linux's default in the authors' Python 3.10
    shared = multiprocessing.Manager().dict(total_tokens=100, prompt_tokens=100)
    times = []
    for _ in range(args.windows):
        start = time.perf_counter()
        pipe = multiprocessing.Pipe()
        process = multiprocessing.Process(target=_window, kwargs=dict(shared=shared, pipe=pipe))
        process.start()
        pipe[0].send(process.pid)
        pipe[1].send(process.pid)
        process.join()
        times.append(1000 * (time.perf_counter() - start))
    q = statistics.quantiles(times, n=10)
    print(
        f"restart per window: median {statistics.median(times):.1f} ms (p10 {q[0]:.1f}, p90 {q[-1]:.1f}), "
        f"{args.windows} windows, {os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    main()
