"""Many callers on one `paraspec serve` (--max-num-seqs, llama.cpp's kernels): the official `openai` client from
several threads at once, each answer the token ids of the same request run alone through the Python API (greedy,
and sampling with a seed); one client leaving mid-stream ends its own generation and no other; /metrics shows the
requests running together and the rows their shared forwards carried."""

import threading

import pytest
import torch

from paraspec import Engine, SamplingParams
from tests.conftest import wait_for
from tests.server.conftest import KEY, MODEL, Server

pytest.importorskip("llama_cpp")

PROMPTS = ["def fib(n):\n    return", "class A:\n", "print(", "x = [1, 2, 3]\n", "return the", "# the"]


@pytest.fixture(scope="module")
def long_gguf(tiny_dir):
    """A tiny GGUF whose special tokens never win (their tied embedding rows are zero): generations run long."""
    from tests.tiny_gguf import tiny_hf_model, tiny_vocab, write_gguf

    tokens = tiny_vocab()[0]
    model = tiny_hf_model("qwen2", len(tokens), tied=True, seed=11, scale=20, max_position_embeddings=4096)
    with torch.no_grad():
        for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
            model.model.embed_tokens.weight[tokens.index(special)] = 0
    path = tiny_dir / "long-target.gguf"
    write_gguf(path, model)
    return path


@pytest.fixture(scope="module")
def server(long_gguf):
    server = Server(
        (long_gguf, None),
        "ar",
        "--strategy",
        "sd",
        "--draft",
        "ngram",
        "--backend",
        "llamacpp",
        "--max-num-seqs",
        "4",
        "--api-key",
        KEY,
        dtype=None,
    )
    yield server
    code, err = server.stop()
    assert code == 0, err


def request(i: int) -> dict:
    sampling = dict(temperature=0.8, seed=7 + i) if i % 3 == 2 else dict(temperature=0)
    return dict(prompt=PROMPTS[i], max_tokens=20 + 7 * i, **sampling)


@pytest.fixture(scope="module")
def alone(long_gguf):
    with Engine(long_gguf, "ngram", strategy="sd", backend="llamacpp", max_num_seqs=1) as engine:
        out = []
        for i in range(len(PROMPTS)):
            r = request(i)
            params = SamplingParams(max_new_tokens=r["max_tokens"], temperature=r["temperature"], seed=r.get("seed"))
            out.append(engine.generate(r["prompt"], params).token_ids)
        return out


def test_concurrent_clients_each_get_the_answer_they_get_alone(server, alone):
    client = server.client()
    results = [None] * len(PROMPTS)

    def ask(i):
        reply = client.completions.create(
            model=MODEL, stream=i % 2 == 1, extra_body={"return_token_ids": True}, **request(i)
        )
        results[i] = list(reply)[-1] if i % 2 else reply

    running = server.at_once(len(PROMPTS), ask, "paraspec:num_requests_running")
    assert [r.choices[0].model_extra["token_ids"] for r in results] == alone
    assert max(running) >= 2  # they ran together, and /metrics said so
    assert server.metric("paraspec:batch_mean_rows") > 1  # their forwards were shared


def test_a_client_leaving_mid_stream_ends_only_its_own_generation(server, alone):
    client = server.client()
    before = server.metric("paraspec:request_success_total", finished_reason="disconnect")
    stream = client.completions.create(model=MODEL, prompt="leave", temperature=0, max_tokens=3000, stream=True)
    results = [None] * 3

    def ask(i):
        results[i] = client.completions.create(model=MODEL, extra_body={"return_token_ids": True}, **request(i))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()  # this client leaves; the others go on
    for t in threads:
        t.join(120)
    assert [r.choices[0].model_extra["token_ids"] for r in results] == alone[:3]
    wait_for(lambda: server.metric("paraspec:request_success_total", finished_reason="disconnect") == before + 1, 60)
    wait_for(lambda: server.metric("paraspec:num_requests_running") == 0, 60)
