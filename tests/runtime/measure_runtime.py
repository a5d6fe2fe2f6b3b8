"""Measure the runtime's costs on this machine (not a test): python -m tests.runtime.measure_runtime

spawn-to-ready time, call round trip, a [8, 151936] float32 logits return, TokenChannel publish/read of q,
and the wake-up latency of a blocking channel wait across processes. Prints medians.
"""

import statistics
import time

import numpy as np

from paraspec.runtime import Runtime
from tests.runtime import loops
from tests.runtime.toy_model import make_toy


def median_ms(fn, n):
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples), min(samples)


def main():
    with Runtime("process") as rt:
        t = time.perf_counter()
        rt.add_worker("w0", "cpu:0", make_toy)
        rt.add_worker("w1", "cpu:1", make_toy)
        infos = rt.wait_ready()
        print(
            f"spawn 2 workers in parallel, to ready: {time.perf_counter() - t:.2f} s "
            f"(per worker: {', '.join(f'{i.startup_s:.2f}' for i in infos.values())} s)"
        )
        w = rt["w1"]
        med, low = median_ms(lambda: w.call("length"), 500)
        print(f"call round trip (length): median {med:.3f} ms, min {low:.3f} ms")
        med, low = median_ms(lambda: w.call("echo", [1], [5], None), 500)
        print(f"call round trip (echo of a small list): median {med:.3f} ms, min {low:.3f} ms")
        med, low = median_ms(lambda: w.call("big_logits", 8, 151_936), 30)
        print(f"logits [8, 151936] float32 back through the socket: median {med:.2f} ms, min {low:.2f} ms")
        channel = rt.channel("q", capacity=4096, vocab_size=151_936, q_window=64)
        v = channel.reset([1])
        q = np.random.rand(8, 151_936).astype(np.float32)
        state = {"pos": 1}

        def publish():
            channel.publish_draft(state["pos"], list(range(8)), q, version=v)
            state["pos"] += 8
            channel.commit(list(range(8)))

        med, low = median_ms(publish, 30)
        print(f"channel publish_draft of 8 tokens + q [8, 151936] (+ commit): median {med:.2f} ms, min {low:.2f} ms")
        channel.publish_draft(state["pos"], list(range(8)), q, version=v)
        med, low = median_ms(lambda: channel.read_q(state["pos"], state["pos"] + 8), 30)
        print(f"channel read_q [8, 151936]: median {med:.2f} ms, min {low:.2f} ms")
        wake = rt.channel("wake", capacity=64)
        latencies = []
        for _ in range(20):
            wake.reset([1])
            handle = w.start_loop(loops.timed_commit_wait, channel=wake, min_committed=2)
            time.sleep(0.05)
            committed_at = time.perf_counter()
            wake.commit([5])
            woke, *_ = handle.result(timeout=10)
            latencies.append((woke - committed_at) * 1e3)
        print(
            f"cross-process wake-up after commit: median {statistics.median(latencies):.3f} ms, "
            f"max {max(latencies):.3f} ms"
        )


if __name__ == "__main__":
    main()
