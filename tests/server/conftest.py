"""`paraspec serve` in a subprocess on a free loopback port (--port 0: the server prints the port it got), the
official `openai` client against it, and the tiny pair with a long context (long generations to cancel)."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from paraspec import Engine
from tests.tiny import EOS_ID, make_checkpoint

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
KEY = "sk-paraspec-test"
WORKERS = {
    "ar": [],
    "sd": ["--draft", "{draft}"],
    "amusd": ["--draft", "{draft}", "--target-devices", "cpu:1", "--draft-devices", "cpu:0"],
    "dsi": ["--draft", "{draft}", "--target-devices", "cpu", "cpu", "--draft-devices", "cpu"],
}


@pytest.fixture(scope="session")
def long_pair(tiny_dir):
    """The tiny target and a noisy copy as draft, with a 4096-token context: a generation of thousands of tokens
    runs for seconds, long enough to disconnect from, time out or kill a worker under."""
    target = make_checkpoint(tiny_dir / "long-target", "qwen2", seed=1, scale=20, max_position_embeddings=4096)
    draft = make_checkpoint(tiny_dir / "long-draft", "qwen2", seed=3, base=target, noise=0.05)
    for folder in (target, draft):
        never_end(folder)
    return target, draft


def never_end(folder: Path) -> None:
    """Zero the EOS row of the (tied) embedding: its logit is 0 while the top logit of these peaked random models
    is far above, so greedy decoding never stops early and a long generation really runs long."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    weights = load_file(path)
    weights["model.embed_tokens.weight"][EOS_ID] = 0
    save_file(weights, path, metadata={"format": "pt"})


@pytest.fixture(scope="session")
def ar_engine(long_pair):
    """The reference: ar through the Python API."""
    with Engine(long_pair[0], strategy="ar", dtype="float32") as engine:
        yield engine


class Server:
    def __init__(self, pair, strategy: str, *extra: str, dtype: str | None = "float32"):
        target, draft = pair
        args = [a.format(draft=draft) for a in WORKERS[strategy]] + (["--dtype", dtype] if dtype else [])
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "paraspec",
                "serve",
                "--target",
                str(target),
                "--strategy",
                strategy,
                "--port",
                "0",
                "--served-model-name",
                MODEL,
                *args,
                *extra,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        line = self.process.stdout.readline()  # the server prints its URL once it listens
        match = re.search(r"at (http://\S+)/v1", line)
        if not match:
            self.kill()
            raise AssertionError(f"the server did not start: {line!r} {self.process.stderr.read()}")
        self.url = match.group(1)
        self.pid = self.process.pid

    def client(self, api_key: str = KEY, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120, **kwargs)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path: str, body, api_key: str | None = KEY) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if api_key is not None:
            headers["Authorization"] = f"Bearer {api_key}"
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def metric(self, name: str, **labels) -> float:
        """The sum of a metric's samples whose labels include `labels` (0 when none)."""
        _, text = self.get("/metrics")
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                if all(f'{k}="{v}"' in line for k, v in labels.items()):
                    total += float(line.rsplit(" ", 1)[1])
        return total

    def at_once(self, n: int, ask, metric: str) -> list[float]:
        """ask(0) .. ask(n - 1), each in a thread of its own, all at once; `metric` sampled until they end."""
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        samples = []
        while any(t.is_alive() for t in threads):
            samples.append(self.metric(metric))
        for t in threads:
            t.join(120)
        return samples

    def stop(self, timeout: float = 60) -> tuple[int, str]:
        self.process.send_signal(signal.SIGTERM)
        try:
            _, err = self.process.communicate(timeout=timeout)
        finally:
            self.kill()
        return self.process.returncode, err

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@pytest.fixture
def start_server(long_pair):
    """start_server(strategy, *flags) -> a running Server, stopped (SIGTERM, exit 0 asserted) at the end."""
    servers = []

    def start(strategy: str = "ar", *flags: str) -> Server:
        servers.append(Server(long_pair, strategy, "--api-key", KEY, *flags))
        return servers[-1]

    yield start
    for server in servers:
        if server.process.poll() is None:
            code, err = server.stop()
            assert code == 0, err


@pytest.fixture(scope="module")
def sd_server(long_pair):
    """An `sd` server with the draft model, fixed lookahead 4, for a test module."""
    server = Server(long_pair, "sd", "--api-key", KEY, "--lookahead", "4", "--no-adaptive")
    yield server
    code, err = server.stop()
    assert code == 0, err
