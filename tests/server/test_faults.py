"""What a server meets besides well-formed requests: clients that leave mid-stream (every strategy, workers
included), generations past --request-timeout, a full queue, a worker killed mid-request, and SIGTERM."""

import os
import signal
import threading
import time
from pathlib import Path

import openai
import pytest

from paraspec import SamplingParams
from tests.conftest import gone, spawned_workers, wait_for
from tests.server.conftest import MODEL

LONG = dict(model=MODEL, prompt="def fib(n):\n    return", temperature=0, max_tokens=3000)


def check_next_request(server, ar_engine):
    want = ar_engine.generate("next", SamplingParams(max_new_tokens=12)).token_ids
    reply = server.client().completions.create(
        model=MODEL, prompt="next", temperature=0, max_tokens=12, extra_body={"return_token_ids": True}
    )
    assert reply.choices[0].model_extra["token_ids"] == want


@pytest.mark.parametrize("strategy", ["ar", "sd", "amusd", "dsi"])
def test_disconnect_mid_stream_stops_the_generation(start_server, ar_engine, strategy):
    server = start_server(strategy)
    stream = server.client().completions.create(stream=True, **LONG)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()  # the client leaves
    wait_for(lambda: server.metric("paraspec:request_success_total", finished_reason="disconnect") == 1, 60)
    generated = server.metric("paraspec:generation_tokens_total")
    assert 0 < generated < 3000  # stopped early, not run to max_tokens
    assert server.metric("paraspec:num_requests_running") == 0
    check_next_request(server, ar_engine)


def test_request_timeout_ends_the_generation_with_an_error(start_server, ar_engine):
    server = start_server("ar", "--request-timeout", "1")
    start = time.monotonic()
    with pytest.raises(openai.APIStatusError, match="request-timeout") as raised:
        server.client().completions.create(**LONG)
    assert raised.value.status_code == 504 and time.monotonic() - start < 20
    with pytest.raises(openai.APIError, match="request-timeout"):
        list(server.client().completions.create(stream=True, **LONG))
    assert server.metric("paraspec:request_success_total", finished_reason="timeout") == 2
    check_next_request(server, ar_engine)


def test_full_queue_gives_429_and_loses_no_request(start_server, ar_engine):
    server = start_server("ar", "--max-queue", "2")
    client = server.client()
    prompts = [f"queued {i}" for i in range(8)]
    want = [ar_engine.generate(p, SamplingParams(max_new_tokens=200)).token_ids for p in prompts]
    results = [None] * 8

    def ask(i):
        try:
            results[i] = client.completions.create(
                model=MODEL, prompt=prompts[i], temperature=0, max_tokens=200, extra_body={"return_token_ids": True}
            )
        except openai.RateLimitError as e:
            results[i] = e

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    served = [(i, r) for i, r in enumerate(results) if not isinstance(r, openai.RateLimitError)]
    assert refused and len(served) >= 3 and len(refused) + len(served) == 8
    assert all(r.choices[0].model_extra["token_ids"] == want[i] for i, r in served)
    assert all("queue is full" in e.message and e.body["code"] == "queue_full" for e in refused)
    assert server.metric("paraspec:num_requests_total", status="429") == len(refused)


def test_a_killed_worker_is_an_error_then_restarted(start_server, ar_engine):
    server = start_server("amusd")
    workers = spawned_workers(server.pid)
    assert len(workers) == 2 and server.get("/health")[0] == 200
    stream = server.client().completions.create(stream=True, **LONG)
    with pytest.raises(openai.APIError, match="worker fault: .*worker '(draft|target)'"):
        for i, _ in enumerate(stream):
            if i == 3:
                os.kill(workers[0], signal.SIGKILL)
    assert server.get("/health")[0] == 503  # restarting
    wait_for(lambda: server.get("/health")[0] == 200, 120)
    assert all(gone(pid) for pid in workers) and len(spawned_workers(server.pid)) == 2
    assert server.metric("paraspec:worker_restarts_total") == 1
    check_next_request(server, ar_engine)


def test_sigterm_ends_the_request_and_leaves_nothing(start_server):
    server = start_server("amusd")
    workers = spawned_workers(server.pid)
    assert [p for p in Path("/dev/shm").iterdir() if p.name.startswith(f"paraspec_{server.pid}_")]
    stream = server.client().completions.create(stream=True, **LONG)
    with pytest.raises(openai.APIError, match="shutting down"):
        for i, _ in enumerate(stream):
            if i == 3:
                server.process.send_signal(signal.SIGTERM)
    code, err = server.stop()
    assert code == 0 and "Traceback" not in err, err
    time.sleep(0.2)
    assert all(gone(pid) for pid in workers)
    assert not [p for p in Path("/dev/shm").iterdir() if p.name.startswith(f"paraspec_{server.pid}_")]
