"""`paraspec serve` in a subprocess for the benchmarks that talk to it over HTTP (serve_concurrency.py,
lm_eval_check.py): a free loopback port, stdout and stderr drained into a log file (a full pipe would stall the
server), the URL taken from its first line, stopped with SIGTERM to its process group (SIGKILL after a timeout)."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class ServeProcess:
    def __init__(self, flags: list[str], threads: int, log: Path, name: str = "bench", start_timeout: float = 900):
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))
        self.command = [sys.executable, "-m", "paraspec", "serve", "--port", "0", "--served-model-name", name, *flags]
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log, "w")  # closed in stop()
        self.process = subprocess.Popen(
            self.command,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=True,
        )
        lines: queue.Queue[str] = queue.Queue()

        def drain() -> None:
            for line in self.process.stdout:
                lines.put(line)
                self.log.write(line)
                self.log.flush()
            lines.put("")

        threading.Thread(target=drain, daemon=True).start()
        try:
            first = lines.get(timeout=start_timeout)
        except queue.Empty:
            first = ""
        match = re.search(r"at (http://\S+)/v1", first)
        if not match:
            self.stop()
            raise RuntimeError(f"paraspec serve did not start: {first!r}; see {log}")
        self.url = match.group(1)  # without /v1

    def stop(self, timeout: float = 60) -> int | None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()
        return self.process.returncode
