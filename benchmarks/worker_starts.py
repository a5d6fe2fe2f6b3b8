"""How much of a test run (or any pytest run) is spent starting worker processes: a pytest plugin.

    PYTHONPATH=benchmarks .venv/bin/python -m pytest -q -p worker_starts tests/strategies/test_sd.py

At the end it prints how many process workers started in the pytest process (the Engine's `runtime_kind="process"`,
the default: each a fresh `spawn` interpreter that imports torch and paraspec, then loads its model) and the sum
of their start-ups (spawn to "ready", the `startup_s` each worker reports), with `--worker-starts-json PATH` to keep
them. Workers started by other processes (the CLI and server tests' subprocesses) are not counted. Two workers of one
Engine start side by side, so the sum is an upper bound on the wall time that starting them cost.
"""

from __future__ import annotations

import json
import statistics

import pytest

STARTS: list[dict] = []
CURRENT = {"test": None}  # the test running now, for the JSON


def pytest_addoption(parser):
    parser.addoption("--worker-starts-json", default=None, help="write every process worker's start-up here")


def pytest_configure(config):
    from paraspec.runtime import workers

    dispatch = workers.Worker._dispatch

    def recording(self, envelope, load_body):
        dispatch(self, envelope, load_body)
        if envelope[0] == "ready" and isinstance(self, workers.ProcessWorker):
            STARTS.append(
                {
                    "worker": self.name,
                    "device": str(self.device),
                    "startup_s": self.info.startup_s,
                    "test": CURRENT["test"],
                }
            )

    workers.Worker._dispatch = recording


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    CURRENT["test"] = item.nodeid
    yield


def pytest_terminal_summary(terminalreporter, config):
    seconds = [s["startup_s"] for s in STARTS]
    line = f"process workers started: {len(seconds)}, start-up sum {sum(seconds):.1f} s" + (
        f", median {statistics.median(seconds):.2f} s, max {max(seconds):.2f} s" if seconds else ""
    )
    terminalreporter.write_line(line)
    if config.getoption("--worker-starts-json"):
        with open(config.getoption("--worker-starts-json"), "w") as f:
            json.dump(STARTS, f, indent=1)
