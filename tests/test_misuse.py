"""Misuse and faults a server or a notebook meets first: two callers on one Engine, streams left open or dropped,
parameters changed after they were checked, options a strategy does not take, interrupted and repeated shutdown,
signals, stopped workers, and a draft with fewer embedding rows than the target. Every case ends either in ar's
exact tokens or in a named error, with no process and no shared-memory segment left behind."""

import dataclasses
import gc
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from paraspec import Engine, SamplingParams
from paraspec.engine import EngineBusy, EngineClosed, StreamCancelled
from paraspec.runtime import WorkerDied, WorkerTimeout
from tests.conftest import PROMPT, children_of, gone, spawned_workers, wait_for

PROCESS = dict(target_devices=["cpu:1"], draft_devices=["cpu:0"])
PARAMS = SamplingParams(max_new_tokens=12)


def own_segments():
    """Shared-memory segments this test process created (other test runs on the machine create their own)."""
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(f"paraspec_{os.getpid()}_")}


@pytest.fixture(scope="module")
def expected(qwen2_target):
    """ar's tokens for PROMPT: what every request below must return."""
    with Engine(qwen2_target, strategy="ar", dtype="float32") as engine:
        return engine.generate(PROMPT, PARAMS).token_ids


@pytest.fixture(scope="module")
def sd(qwen2_target, qwen2_partial):
    # one sequence: these tests are about requests that wait for the Engine (tests/strategies/test_batched.py has
    # the Engine of several sequences full)
    with Engine(qwen2_target, qwen2_partial, strategy="sd", dtype="float32", max_num_seqs=1) as engine:
        yield engine


@pytest.fixture(scope="module")
def amusd(qwen2_target, qwen2_partial):
    with Engine(qwen2_target, qwen2_partial, strategy="amusd", dtype="float32", **PROCESS) as engine:
        yield engine


@pytest.fixture(scope="module")
def dsi(qwen2_target, qwen2_partial):
    with Engine(
        qwen2_target,
        qwen2_partial,
        strategy="dsi",
        dtype="float32",
        runtime_kind="inprocess",
        target_devices=["cpu"] * 2,
    ) as engine:
        yield engine


def in_threads(fn, n: int = 2) -> list:
    """Run fn() in n threads at once; their results (or the exceptions they raised)."""
    results = [None] * n
    barrier = threading.Barrier(n)

    def call(i):
        barrier.wait()
        try:
            results[i] = fn()
        except Exception as e:  # noqa: BLE001 -- the test looks at it
            results[i] = e

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a call hung"
    return results


# -- one generation at a time --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sd", "amusd"])
def test_two_threads_wait_their_turn(request, name, expected):
    engine = request.getfixturevalue(name)
    params = SamplingParams(max_new_tokens=40)
    long = engine.generate(PROMPT, params).token_ids
    results = in_threads(lambda: engine.generate(PROMPT, params).token_ids, 3)
    assert results == [long] * 3
    assert engine.generate(PROMPT, PARAMS).token_ids == expected


@pytest.mark.parametrize("name", ["sd", "amusd"])
def test_a_second_caller_gets_engine_busy_in_error_mode(request, name, qwen2_target, qwen2_partial, expected):
    kwargs = PROCESS if name == "amusd" else dict(max_num_seqs=1)
    with Engine(qwen2_target, qwen2_partial, strategy=name, dtype="float32", on_busy="error", **kwargs) as engine:
        first = engine.stream(PROMPT, SamplingParams(max_new_tokens=200))
        next(first)  # a generation in progress, consumed by the main thread
        results = in_threads(lambda: engine.generate(PROMPT, PARAMS).token_ids, 2)
        assert all(isinstance(r, EngineBusy) for r in results), results
        first.close()
        assert engine.generate(PROMPT, PARAMS).token_ids == expected


def test_on_busy_is_checked(qwen2_target):
    with pytest.raises(ValueError, match="on_busy must be 'wait'"):
        Engine(qwen2_target, strategy="ar", on_busy="queue")


@pytest.mark.parametrize("name", ["sd", "amusd", "dsi"])
def test_interleaved_streams_the_older_one_says_it_was_cancelled(request, name, expected):
    engine = request.getfixturevalue(name)
    a, b = engine.stream(PROMPT, SamplingParams(max_new_tokens=200)), engine.stream(PROMPT, PARAMS)
    first_a = next(a)
    text_b = next(b)  # b starts while a is open (same thread): a is cancelled
    with pytest.raises(
        StreamCancelled,
        match=r"was cancelled: stream #\d+ \(opened by thread 'MainThread' at "
        r".* was started on the same thread",
    ) as raised:
        next(a)  # ... and says so instead of ending short
    with pytest.raises(StreamCancelled):
        next(a)  # every time it is read
    assert a.result.finish_reason == "cancelled" and a.result.text.startswith(first_a)
    text_b += "".join(b)
    assert b.result.token_ids == expected and text_b == b.result.text
    # it names itself, then the request that took over
    assert re.findall(r"stream #(\d+)", str(raised.value)) == [str(a._request.number), str(b._request.number)]
    assert engine.generate(PROMPT, PARAMS).token_ids == expected


@pytest.mark.parametrize("name", ["sd", "amusd", "dsi"])
def test_streams_read_in_turns_raise_at_the_first_overtaken_read(request, name, expected):
    engine = request.getfixturevalue(name)
    a, b = engine.stream(PROMPT, SamplingParams(max_new_tokens=200)), engine.stream(PROMPT, PARAMS)
    with pytest.raises(StreamCancelled, match="started on the same thread"):
        for _ in zip(a, b):  # a, b, a: the second read of a raises
            pass
    assert b.result is None or b.result.finish_reason != "cancelled"
    assert "".join(b) and b.result.token_ids == expected


def test_closing_the_engine_under_an_open_stream_says_so(qwen2_target, qwen2_partial):
    engine = Engine(qwen2_target, qwen2_partial, strategy="sd", dtype="float32")
    stream = engine.stream(PROMPT, SamplingParams(max_new_tokens=200))
    next(stream)
    engine.close()
    with pytest.raises(StreamCancelled, match=r"was cancelled: the Engine was closed"):
        next(stream)
    assert stream.result.finish_reason == "cancelled"


@pytest.mark.parametrize("name", ["sd", "amusd"])
def test_a_caller_waits_for_an_open_stream_until_it_is_closed(request, name, expected):
    engine = request.getfixturevalue(name)  # wait_timeout None: waits as long as it takes
    stream = engine.stream(PROMPT, SamplingParams(max_new_tokens=200))
    next(stream)
    results = []
    waiter = threading.Thread(target=lambda: results.append(engine.generate(PROMPT, PARAMS).token_ids))
    waiter.start()
    waiter.join(1.0)
    assert waiter.is_alive() and not results  # still waiting: the stream holds the Engine
    stream.close()
    waiter.join(120)
    assert not waiter.is_alive() and results == [expected]


@pytest.mark.parametrize("strategy,kwargs", [("sd", dict(max_num_seqs=1)), ("amusd", dict(runtime_kind="inprocess"))])
def test_wait_timeout_names_the_open_stream(qwen2_target, qwen2_partial, expected, strategy, kwargs):
    with Engine(qwen2_target, qwen2_partial, strategy=strategy, dtype="float32", wait_timeout=1.5, **kwargs) as engine:
        stream = engine.stream(PROMPT, SamplingParams(max_new_tokens=200))
        next(stream)
        start = time.monotonic()
        [error] = in_threads(lambda: engine.generate(PROMPT, PARAMS), 1)
        waited = time.monotonic() - start
        assert isinstance(error, EngineBusy), error
        assert 1.5 <= waited < 60
        message = str(error)
        assert message.startswith("waited 1.5 s (wait_timeout) for stream #")
        assert "opened by thread 'MainThread' at " in message
        assert "stream.close()" in message and "engine.cancel()" in message
        stream.close()
        assert engine.generate(PROMPT, PARAMS).token_ids == expected


@pytest.mark.parametrize("value", [0, -1, "5", True])
def test_wait_timeout_is_checked(qwen2_target, value):
    with pytest.raises(ValueError, match="wait_timeout must be a number of seconds > 0, or None"):
        Engine(qwen2_target, strategy="ar", wait_timeout=value)


def test_set_options_is_checked_and_waits_for_no_request(qwen2_target, qwen2_partial, expected):
    with Engine(qwen2_target, qwen2_partial, strategy="sd", dtype="float32") as engine:
        with pytest.raises(ValueError, match="lookahead must be >= 1"):
            engine.set_options(lookahead=0)
        with pytest.raises(ValueError, match="does not take option\\(s\\) max_ahead"):
            engine.set_options(max_ahead=4)
        assert engine.options["lookahead"] is None and engine.config.options == {}  # auto: 32 under the rule, 5 fixed
        stream = engine.stream(PROMPT, SamplingParams(max_new_tokens=200))
        next(stream)
        with pytest.raises(EngineBusy, match="options cannot change while stream #"):
            engine.set_options(lookahead=2)
        stream.close()
        engine.set_options(lookahead=2)
        assert engine.options["lookahead"] == 2 and engine.config.options == {"lookahead": 2}
        result = engine.generate(PROMPT, PARAMS)
        assert result.token_ids == expected and result.stats.drafted <= 2 * result.stats.rounds


@pytest.mark.parametrize("name", ["sd", "amusd"])
def test_stream_closed_or_dropped_early_leaves_the_engine_exact(request, name, expected, capfd):
    engine = request.getfixturevalue(name)
    stream = engine.stream(PROMPT, SamplingParams(max_new_tokens=2000))
    first = next(stream)
    stream.close()  # closed by its reader: it just ends
    assert list(stream) == [] and stream.result.finish_reason == "cancelled"
    assert stream.result.text.startswith(first)
    assert engine.generate(PROMPT, PARAMS).token_ids == expected
    stream = engine.stream(PROMPT, SamplingParams(max_new_tokens=2000))
    next(stream)
    del stream  # garbage collection cancels it too
    gc.collect()
    assert engine.generate(PROMPT, PARAMS).token_ids == expected
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.parametrize("name", ["sd", "amusd"])
def test_cancel_from_another_thread(request, name, expected):
    engine = request.getfixturevalue(name)
    assert engine.cancel() is False  # nothing running
    started, outcome = threading.Event(), {}

    def slow_consumer():
        deltas = []
        stream = engine.stream(PROMPT, SamplingParams(max_new_tokens=2000))
        for delta in stream:  # engine.cancel() ends it: no error, the result says so
            deltas.append(delta)
            started.set()
            time.sleep(0.05)
        outcome["deltas"], outcome["result"] = deltas, stream.result

    thread = threading.Thread(target=slow_consumer)
    thread.start()
    assert started.wait(60)
    start = time.monotonic()
    assert engine.cancel() is True
    thread.join(30)
    assert not thread.is_alive() and time.monotonic() - start < 5
    result = outcome["result"]
    assert result.finish_reason == "cancelled" and 0 < len(result.token_ids) < 40
    assert "".join(outcome["deltas"]) == result.text
    assert engine.generate(PROMPT, PARAMS).token_ids == expected


# -- validated where used ------------------------------------------------------------------------------------


def test_sampling_params_cannot_be_changed_unchecked():
    params = SamplingParams(temperature=0.5)
    for field, value in [("temperature", -1), ("top_p", 0), ("max_new_tokens", 0)]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(params, field, value)
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(params, **{field: value})
    assert dataclasses.replace(params, temperature=0.7).temperature == 0.7


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True])
def test_seed_must_fit_64_bits(seed):
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)


def test_largest_seed_samples(sd):
    result = sd.generate(PROMPT, SamplingParams(temperature=1.0, max_new_tokens=4, seed=2**64 - 1))
    assert len(result.token_ids) == 4


@pytest.mark.parametrize(
    "strategy,option,takers",
    [
        ("ar", dict(lookahead=3), "sd, dsi"),
        ("sd", dict(max_ahead=4), "amusd, dsi"),
        ("amusd", dict(lookahead=3), "sd, dsi"),
        ("tree", dict(verify_chunk=2), "amusd"),
    ],
)
def test_options_the_strategy_does_not_take_are_refused(qwen2_target, qwen2_partial, strategy, option, takers):
    draft = None if strategy == "ar" else qwen2_partial
    name = next(iter(option))
    with pytest.raises(ValueError, match=f"does not take option\\(s\\) {name} \\({name} is taken by {takers}\\)"):
        Engine(qwen2_target, draft, strategy=strategy, **option)


def test_runtime_kind_is_checked_for_every_strategy(qwen2_target, qwen2_partial):
    for strategy in ("ar", "sd", "amusd"):
        draft = None if strategy == "ar" else qwen2_partial
        with pytest.raises(ValueError, match="unknown runtime kind 'threads'"):
            Engine(qwen2_target, draft, strategy=strategy, runtime_kind="threads")


@pytest.mark.parametrize("draft", ["exists", "missing"])
def test_ar_refuses_a_draft(qwen2_target, qwen2_partial, tmp_path, draft):
    path = qwen2_partial if draft == "exists" else tmp_path / "missing"
    with pytest.raises(ValueError, match="strategy 'ar' decodes the target alone and takes no draft"):
        Engine(qwen2_target, path, strategy="ar")


def test_cli_passes_only_the_options_given(qwen2_target):
    from paraspec.cli.main import build_parser, engine_config

    parser = build_parser()
    base = ["generate", "--target", str(qwen2_target), "--prompt", "x"]
    assert engine_config(parser.parse_args(base + ["--strategy", "ar"])).options == {}
    assert engine_config(
        parser.parse_args(base + ["--strategy", "sd", "--draft", "d", "--lookahead", "3"])
    ).options == {"lookahead": 3}
    with pytest.raises(ValueError, match="does not take option"):
        engine_config(parser.parse_args(base + ["--strategy", "ar", "--lookahead", "3"]))


def test_bench_gives_each_strategy_its_own_options(qwen2_target, qwen2_partial):
    from paraspec.config import EngineConfig

    base = EngineConfig(qwen2_target, qwen2_partial, strategy="sd")
    options = {"lookahead": 3, "max_ahead": 8, "verify_chunk": 2}
    assert base.for_strategy("ar", options).options == {} and base.for_strategy("ar", options).draft is None
    assert base.for_strategy("sd", options).options == {"lookahead": 3}
    assert base.for_strategy("amusd", options).options == {"max_ahead": 8, "verify_chunk": 2}


def test_bench_refuses_an_option_no_strategy_takes(tmp_path, qwen2_target):
    from paraspec.cli.main import main

    assert (
        main(["bench", "--target", str(qwen2_target), "--strategies", "ar", "--lookahead", "3", "--out", str(tmp_path)])
        == 2
    )


# -- shutdown ----------------------------------------------------------------------------------------------------


def test_generate_after_close_names_the_fix(qwen2_target, qwen2_partial):
    engine = Engine(qwen2_target, qwen2_partial, strategy="sd", dtype="float32")
    engine.close()
    engine.close()
    for call in (lambda: engine.generate(PROMPT, PARAMS), lambda: engine.stream(PROMPT, PARAMS)):
        with pytest.raises(EngineClosed, match="create a new Engine"):
            call()


def test_keyboard_interrupt_inside_close_is_finished_by_the_next_close(qwen2_target, qwen2_partial, monkeypatch):
    import _thread

    from paraspec.runtime.workers import ProcessWorker

    before = own_segments()
    engine = Engine(qwen2_target, qwen2_partial, strategy="amusd", dtype="float32", **PROCESS)
    pids = [w.pid for w in engine.runtime.workers.values()]
    stop_worker = ProcessWorker._stop_worker

    def interrupted_stop(self, deadline):  # Ctrl-C lands while close() waits for the first worker
        monkeypatch.setattr(ProcessWorker, "_stop_worker", stop_worker)
        _thread.interrupt_main()
        time.sleep(0.5)  # the interrupt is raised here, in the main thread

    monkeypatch.setattr(ProcessWorker, "_stop_worker", interrupted_stop)
    with pytest.raises(KeyboardInterrupt):
        engine.close()
    assert own_segments() - before  # the interrupted close left segments behind ...
    engine.close()  # ... and the second one finishes the job
    time.sleep(0.2)
    assert all(gone(pid) for pid in pids)
    assert own_segments() <= before
    with pytest.raises(EngineClosed):
        engine.generate(PROMPT, PARAMS)


def test_an_unclosed_engine_is_closed_by_garbage_collection(qwen2_target, qwen2_partial):
    before = own_segments()
    engine = Engine(qwen2_target, qwen2_partial, strategy="amusd", dtype="float32", **PROCESS)
    pids = [w.pid for w in engine.runtime.workers.values()]
    del engine
    gc.collect()
    time.sleep(0.2)
    assert all(gone(pid) for pid in pids)
    assert own_segments() <= before


def test_restart_workers_after_a_worker_died(qwen2_target, qwen2_partial, expected):
    with Engine(qwen2_target, qwen2_partial, strategy="amusd", dtype="float32", **PROCESS) as engine:
        old = engine.runtime["draft"].pid
        os.kill(old, signal.SIGKILL)
        time.sleep(0.2)
        with pytest.raises(WorkerDied, match="restart_workers"):
            engine.generate(PROMPT, PARAMS)
        with pytest.raises(WorkerDied, match="restart_workers"):  # refused until restarted
            engine.generate(PROMPT, PARAMS)
        engine.restart_workers()
        assert engine.runtime["draft"].pid != old
        assert engine.generate(PROMPT, PARAMS).token_ids == expected


def test_a_stopped_worker_times_out(qwen2_target, qwen2_partial):
    before = own_segments()
    engine = Engine(qwen2_target, qwen2_partial, strategy="amusd", dtype="float32", worker_timeout=2.0, **PROCESS)
    pids = [w.pid for w in engine.runtime.workers.values()]
    target = engine.runtime["target"]
    try:
        os.kill(target.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerTimeout, match=f"worker 'target' \\(cpu:1, pid {target.pid}\\)"):
            engine.generate(PROMPT, SamplingParams(max_new_tokens=2000))
        assert time.monotonic() - start < 10
    finally:
        engine.close()
    time.sleep(0.2)
    assert all(gone(pid) for pid in pids)
    assert own_segments() <= before


def test_worker_timeout_is_checked(qwen2_target):
    with pytest.raises(ValueError, match="worker_timeout must be"):
        Engine(qwen2_target, strategy="ar", worker_timeout=0)


# -- signals to the command line -------------------------------------------------------------------------------


def start_cli(qwen2_target, qwen2_partial, max_new_tokens: int, merged: bool = False) -> subprocess.Popen:
    """`paraspec generate` with amusd workers, in a session of its own (a terminal's Ctrl-C signals the whole
    process group); `merged`: stderr into stdout, in the order written."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "paraspec",
            "generate",
            "--target",
            str(qwen2_target),
            "--draft",
            str(qwen2_partial),
            "--strategy",
            "amusd",
            "--dtype",
            "float32",
            "--target-devices",
            "cpu:1",
            "--draft-devices",
            "cpu:0",
            "--prompt",
            "hello",
            "--max-new-tokens",
            str(max_new_tokens),
            "--max-context",
            str(max(256, max_new_tokens + 64)),
        ],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merged else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_ctrl_c_while_workers_start_prints_one_line(qwen2_target, qwen2_partial):
    # 2,000 tokens: seconds of work even on a fast CPU, so the Ctrl-C cannot land after the run (a CI run's 50 tokens
    # were done within the 0.3 s, and the signal met the interpreter as it exited)
    cli = start_cli(qwen2_target, qwen2_partial, 2000)
    try:
        workers = wait_for(lambda: cli.poll() is None and spawned_workers(cli.pid, with_server=True))
        time.sleep(0.3)  # the workers are importing torch or loading now
        assert cli.poll() is None, "the run ended before the Ctrl-C: this case tests nothing"
        os.killpg(cli.pid, signal.SIGINT)  # Ctrl-C reaches the whole group
        _, err = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
    assert_interrupted(cli, err, workers)


def assert_interrupted(cli: subprocess.Popen, output: str, processes) -> None:
    """Exit 130 with `interrupted` as the last line and no traceback; no process and no segment left behind."""
    assert cli.returncode == 130, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert lines[-1] == "interrupted" and "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert "leaked" not in output and "Exception ignored" not in output, output
    wait_for(lambda: all(gone(pid) for pid in processes), 10)
    owners = {str(pid) for pid in (cli.pid, *processes)}
    assert not [
        p for p in Path("/dev/shm").iterdir() if p.name.startswith("paraspec_") and p.name.split("_")[1] in owners
    ]


def descendants(pid: int) -> set[int]:
    """Every process below `pid` now (children, their children, ...)."""
    found, todo = set(), [pid]
    while todo:
        children = set(children_of(todo.pop())) - found
        todo += children
        found |= children
    return found


# Ctrl-C a fixed time after the CLI starts (Python importing torch, parsing), or 0.3 s after the first process below
# it appears: the fork server importing torch while the caller waits seconds in start() for its first worker, or a
# spawned worker. A Ctrl-C another thread of the caller took there was once ignored process-wide: the run went on.
MOMENTS = [("0.2 s", "forkserver"), ("1.0 s", "forkserver")] + [("first process", m) for m in ("forkserver", "spawn")]


@pytest.mark.parametrize("moment,method", MOMENTS)
def test_ctrl_c_at_any_moment_of_start_up_prints_one_line(qwen2_target, qwen2_partial, monkeypatch, moment, method):
    """Ctrl-C while Python imports torch, parses, loads or starts workers: one line, exit 130, nothing left."""
    monkeypatch.setenv("PARASPEC_WORKER_START", method)
    cli = start_cli(qwen2_target, qwen2_partial, 2000, merged=True)
    try:
        if moment == "first process":
            wait_for(lambda: cli.poll() is not None or bool(descendants(cli.pid)))
            time.sleep(0.3)
        else:
            time.sleep(float(moment.removesuffix(" s")))
        assert cli.poll() is None, "the run ended before the Ctrl-C: this case tests nothing"
        seen = descendants(cli.pid)
        os.killpg(cli.pid, signal.SIGINT)  # Ctrl-C reaches the whole group
        deadline = time.monotonic() + 60
        while cli.poll() is None and time.monotonic() < deadline:
            seen |= descendants(cli.pid)
            time.sleep(0.02)
        out, _ = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
    assert_interrupted(cli, out, seen)


def raising_while_a_class_is_built(exception: str) -> str:
    return (
        "class Field:\n"
        f"        def __set_name__(self, owner, name): raise {exception}\n"
        "    class Owner:\n"
        "        field = Field()"
    )


SIGNALLED_COMMANDS = {
    # dataclasses, typing and enum build code with exec while a module imports: the interrupt inside it is caught,
    # yet CPython remembers it as unhandled and would end the process with SIGINT (returncode -2, not 130)
    "ctrl-c inside exec": ('exec("raise KeyboardInterrupt")', 130, "interrupted"),
    # Python 3.11 wraps an exception raised while a class is built ("Error calling __set_name__") in a RuntimeError
    "ctrl-c inside a class being built": (raising_while_a_class_is_built("KeyboardInterrupt"), 130, "interrupted"),
    "sigterm inside a class being built": (raising_while_a_class_is_built("cli.Terminated()"), 143, "terminated"),
}


@pytest.mark.parametrize("case", list(SIGNALLED_COMMANDS))
def test_a_signal_inside_an_import_of_the_command_exits_with_its_code(case, tmp_path):
    """Ctrl-C or SIGTERM while the command imports its libraries (the tokenizer's transformers, seconds on a slow
    machine) lands in such code: still one line and exit 130 / 143 (a CI run got -2, with the line printed). Run
    with `-m`, as `python -m paraspec` is: a `-c` script's SystemExit ends the process before CPython checks that
    flag."""
    body, code, line = SIGNALLED_COMMANDS[case]
    (tmp_path / "signalled_cli.py").write_text(
        "import sys\n"
        "from paraspec.cli import main as cli\n"
        "def command(args):\n"
        f"    {body}\n"
        "cli.cmd_generate = command\n"
        "sys.exit(cli.main(['generate', '--target', 'unused', '--prompt', "
        "'hello']))\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-m", "signalled_cli"],
        cwd=root,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(tmp_path)])),
        timeout=120,
    )
    assert (done.returncode, done.stderr.splitlines()) == (code, [line]), done.stderr


def test_sigterm_unlinks_every_segment(qwen2_target, qwen2_partial):
    cli = start_cli(qwen2_target, qwen2_partial, 50)
    try:
        workers = wait_for(lambda: cli.poll() is None and spawned_workers(cli.pid, with_server=True))
        assert [p for p in Path("/dev/shm").iterdir() if p.name.startswith(f"paraspec_{cli.pid}_")]
        os.kill(cli.pid, signal.SIGTERM)  # the workers are starting: segments exist, nothing is ready
        _, err = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
    assert cli.returncode == 143, err
    assert "Traceback" not in err and "leaked" not in err, err
    time.sleep(0.2)
    assert all(gone(pid) for pid in workers)
    assert not [p for p in Path("/dev/shm").iterdir() if p.name.startswith(f"paraspec_{cli.pid}_")]


# -- uneven vocabularies -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def narrow_draft(tmp_path_factory, qwen2_target):
    """The target with its embedding cut to 262 rows (the tokenizer has 260 tokens, the target 267 rows): the
    same tokenizer and a smaller embedding, like Qwen2.5-0.5B (151,936 rows) against 7B (152,064)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("narrow") / "draft"
    model = AutoModelForCausalLM.from_pretrained(str(qwen2_target), dtype=torch.float32)
    model.resize_token_embeddings(262)
    model.save_pretrained(str(folder))
    for f in Path(qwen2_target).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name in ("vocab.json", "merges.txt"):
            shutil.copy(f, folder / f.name)
    return folder


@pytest.mark.parametrize(
    "strategy,kwargs",
    [
        ("sd", {}),
        ("amusd", dict(runtime_kind="inprocess")),
        ("dsi", dict(runtime_kind="inprocess", target_devices=["cpu"] * 2)),
    ],
)
def test_a_draft_with_fewer_embedding_rows_decodes_exactly(qwen2_target, narrow_draft, strategy, kwargs):
    params = SamplingParams(max_new_tokens=200)
    with Engine(qwen2_target, strategy="ar", dtype="float32") as ar:
        reference = ar.generate("def f(x):", params).token_ids
    assert [t for t in reference if t >= 262], "the target never emits an id the draft lacks: the test proves nothing"
    with Engine(qwen2_target, narrow_draft, strategy=strategy, dtype="float32", **kwargs) as engine:
        assert engine.draft.vocab_size == 262 and engine.target.vocab_size == 267
        assert engine.generate("def f(x):", params).token_ids == reference
        sampled = engine.generate("def f(x):", SamplingParams(temperature=1.0, max_new_tokens=100, seed=3))
        assert len(sampled.token_ids) > 0 and max(sampled.token_ids) < 267


def test_config_json_that_is_not_json_is_named(tmp_path, qwen2_target):
    import shutil

    from paraspec.models.loader import CheckpointError

    broken = tmp_path / "broken"
    shutil.copytree(qwen2_target, broken)
    (broken / "config.json").write_text('{"vocab_size": 267,')
    with pytest.raises(CheckpointError, match=f"{broken / 'config.json'} is not valid JSON"):
        Engine(broken, strategy="ar")
