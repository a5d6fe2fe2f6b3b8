"""Many callers at once (Engine max_num_seqs, scheduler.py): requests share each forward, and every answer is
bit-identical to the same request run alone -- on an Engine of one sequence, one request at a time.

N concurrent requests (different prompts, lengths, stop strings and max tokens; N = 1..8 on 4 sequences, so
requests join and leave mid-run and some wait their turn) on `ar` and `sd` (model-free drafters and a draft
model) on the llamacpp backend; greedy and seeded sampling; one request cancelled mid-batch while the others
finish unchanged; the inexact verdict decoding one sequence per forward, still exact.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from paraspec import Engine, SamplingParams
from paraspec.drafters.adaptive import Load
from paraspec.models.loader import load_model
from paraspec.scheduler import packs

pytest.importorskip("llama_cpp")

PROMPTS = [
    [5, 17, 33, 90, 12, 7],
    list(range(20, 60)),
    [3, 3, 3, 9],
    list(range(200, 150, -1)),
    [40, 41, 40, 41, 40, 41, 42],
    [7] * 12,
    list(range(100, 130)),
    [1, 2, 3, 4, 5, 6, 7, 8, 9],
]
LIMITS = [40, 25, 33, 12, 48, 20, 30, 17]
CONFIGS = {
    "ar": dict(strategy="ar"),
    "sd-ngram": dict(strategy="sd", adaptive=False, draft="ngram", lookahead=4),
    "sd-model": dict(strategy="sd", adaptive=False, draft="model", lookahead=3),
    "sd-ngram+model": dict(strategy="sd", adaptive=False, draft=["ngram", "model"], lookahead=5),
}


def params(i: int, sampling: bool) -> SamplingParams:
    extra = dict(temperature=0.9, top_p=0.95, seed=100 + i) if sampling else {}
    return SamplingParams(max_new_tokens=LIMITS[i], stop=["re"] if i == 2 else None, **extra)


def engine(gguf_pair, name: str, seqs: int, backend: str = "llamacpp", **kwargs) -> Engine:
    config = dict(CONFIGS[name])
    draft = config.pop("draft", None)
    draft = (
        [gguf_pair["draft"] if d == "model" else d for d in draft]
        if isinstance(draft, list)
        else (gguf_pair["draft"] if draft == "model" else draft)
    )
    target = gguf_pair["sample_target" if kwargs.pop("sampling", False) else "target"]
    if draft == gguf_pair["draft"] and target == gguf_pair["sample_target"]:
        draft = gguf_pair["sample_draft"]
    native = dict(dtype="float32", padded_width=None) if backend == "native" else {}
    return Engine(target, draft, backend=backend, max_num_seqs=seqs, **native, **config, **kwargs)


def alone(gguf_pair, name: str, n: int, sampling: bool, backend: str = "llamacpp") -> list:
    with engine(gguf_pair, name, 1, backend, sampling=sampling) as one:
        return [one.generate(PROMPTS[i], params(i, sampling)) for i in range(n)]


def together(e: Engine, n: int, sampling: bool, stream: bool = False) -> list:
    results, errors = [None] * n, []

    def call(i):
        try:
            if stream and i % 2:
                s = e.stream(PROMPTS[i], params(i, sampling))
                text = "".join(s)
                results[i] = s.result
                assert text == s.result.text
            else:
                results[i] = e.generate(PROMPTS[i], params(i, sampling))
        except BaseException as exc:  # noqa: BLE001 -- raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


def assert_same(got, want) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w.token_ids, f"request {i}: batched tokens differ from the request run alone"
        assert (g.text, g.finish_reason) == (w.text, w.finish_reason)


@pytest.mark.parametrize("backend", ["llamacpp", "native"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_concurrent_requests_are_each_bit_identical_to_alone(gguf_pair, name, sampling, backend):
    """On the native decoder (models/native/sequences.py) too: its probe decides which asks share a forward (on many
    CPUs a one-row product is another kernel, so one-token steps stay alone and verifications share)."""
    want = alone(gguf_pair, name, 8, sampling, backend)
    with engine(gguf_pair, name, 4, backend, sampling=sampling) as e:
        assert e.max_num_seqs == 4 and e.target.n_seqs == 4
        # where one-token steps stay alone only verifications share, and only when two requests verify in one step:
        # sd-model's requests draft k tokens every round and stay in phase; ngram+model's drift apart as the
        # n-gram drafts or not (a full run saw none shared): it is held to its answers = alone
        exact = e.target.batch_exact
        shares = exact and (e.target.min_shared_width == 1 or name == "sd-model")
        for n in (1, 2, 5, 8):
            assert_same(together(e, n, sampling, stream=n == 5), want[:n])
        widths, moves = e.batch_stats.widths, e.batch_stats.moves
    if shares:
        assert max(widths) >= 2, f"no forward was shared: {widths}"  # the requests really were batched
    elif not exact:
        assert widths == {}, f"shared forwards the probe found inexact: {widths}"
    assert moves > 0  # requests that outlived others moved down to keep the sequences contiguous
    if name != "ar" and not sampling:
        assert any(r.stats.drafted for r in want)


def test_packs_split_a_step_only_where_the_timed_forwards_are_clearly_cheaper():
    """Eight one-row asks: one forward of eight until it is timed, then two of four once (to time them); two of
    four where they cost less than one of eight (Zen 4's kernels: 224.5 against 2 x 105.7 ms, 2026-12-06); one of
    eight where the split saves under 5%; never a pack wider than the probed width; the asks keep their order."""
    rows = lambda item: 1  # noqa: E731
    items = list(range(8))
    assert packs(items, rows, 32, 512, {}) == [items]
    assert packs(items, rows, 32, 512, {(8, 8): 0.2245}) == [items[:4], items[4:]]  # the halves, to time them
    timed = {(8, 8): 0.2245, (4, 4): 0.1057, (2, 2): 0.0618, (1, 1): 0.032}
    assert packs(items, rows, 32, 512, timed) == [items[:4], items[4:]]
    assert packs(items, rows, 32, 512, {**timed, (4, 4): 0.116}) == [items]  # 0.232 s: not 5% cheaper
    assert packs(items, rows, 4, 512, {(4, 4): 0.107, (2, 2): 0.06, (1, 1): 0.010}) == [[i] for i in items]
    assert packs(items, rows, 4, 512, {(4, 4): 0.107, (2, 2): 0.06, (1, 1): 0.030}) == [items[:4], items[4:]]
    assert packs([3], rows, 32, 512, timed) == [[3]]


class FixedCosts(dict):
    """A step cost table the Scheduler reads but does not update (its timings would move it)."""

    def __setitem__(self, key, value) -> None:
        pass


def test_a_step_split_into_cheaper_forwards_keeps_every_answer(gguf_pair):
    """Where the timed costs make two forwards of two requests cheaper than one of four, the Scheduler runs them
    so, and every answer is still the request's answer alone (each pack within the probed width)."""
    want = alone(gguf_pair, "ar", 8, False)
    with engine(gguf_pair, "ar", 4) as e:
        if not e.target.batch_exact or e.target.min_shared_width > 1:
            pytest.skip("the probe keeps one-token steps alone on this CPU: nothing is shared to split")
        e.scheduler.step_costs[id(e.target)] = FixedCosts({(1, 1): 1.0, (2, 2): 1.0, (3, 3): 3.0, (4, 4): 4.0})
        for n in (4, 8):
            assert_same(together(e, n, False), want[:n])
        widths = dict(e.batch_stats.widths)
    assert widths.get(2) and not widths.get(3) and not widths.get(4), widths


def test_a_request_cancelled_mid_batch_leaves_the_others_unchanged(gguf_pair):
    want = alone(gguf_pair, "sd-ngram", 4, False)
    with engine(gguf_pair, "sd-ngram", 4) as e:
        results = [None] * 4

        def call(i):
            results[i] = e.generate(PROMPTS[i], params(i, False))

        threads = [threading.Thread(target=call, args=(i,)) for i in (1, 2, 3)]
        stream = e.stream(PROMPTS[0], SamplingParams(max_new_tokens=200))  # alone: 200 tokens, no stop
        next(stream)
        for t in threads:
            t.start()
        next(stream)
        stream.close()  # cancelled while the others decode beside it
        for t in threads:
            t.join(120)
        assert stream.result.finish_reason == "cancelled" and len(stream.result.token_ids) < 200
        assert_same(results[1:], want[1:])
        assert e.running == 0


def test_an_inexact_batch_verdict_decodes_one_sequence_per_forward(gguf_pair):
    want = alone(gguf_pair, "ar", 4, False)
    with engine(gguf_pair, "ar", 4) as e:
        e.target.batch_exact = False  # as if the probe had found rows differ in a batch
        assert_same(together(e, 4, False), want)
        assert e.batch_stats.widths == {}  # nothing shared a forward


def test_open_streams_are_idle_and_the_engine_full_says_who_holds_it(gguf_pair):
    """A stream left open does not hold the others' steps up; a request beyond max_num_seqs waits, or with
    on_busy="error" is refused naming the requests that hold the Engine."""
    from paraspec import EngineBusy

    want = alone(gguf_pair, "ar", 2, False)
    with engine(gguf_pair, "ar", 2, on_busy="error") as e:
        opened, release = threading.Event(), threading.Event()

        def hold():  # a stream opened in its thread, read once, left open
            held = e.stream(PROMPTS[3], SamplingParams(max_new_tokens=100))  # alone: no stop before 200
            next(held)
            opened.set()
            release.wait(60)
            held.close()

        holder = threading.Thread(target=hold)
        holder.start()
        assert opened.wait(60)
        got = []
        t = threading.Thread(target=lambda: got.append(e.generate(PROMPTS[0], params(0, False))))
        t.start()
        t.join(60)
        assert got and got[0].token_ids == want[0].token_ids  # it finished while the stream stayed open
        other = e.stream(PROMPTS[1], params(1, False))
        next(other)
        with pytest.raises(EngineBusy, match=r"stream #\d+ .*; stream #\d+ .* are running on this Engine"):
            threading_result = []
            t = threading.Thread(target=lambda: threading_result.append(_call(e.generate, PROMPTS[2])))
            t.start()
            t.join(60)
            raise threading_result[0]
        rest = "".join(other)
        assert other.result.token_ids == want[1].token_ids and rest
        release.set()
        holder.join(60)
        assert e.running == 0


def _call(fn, *args):
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 -- handed to the test's thread
        return exc
    return AssertionError("it did not raise")


def test_max_num_seqs_is_checked_and_applies_where_requests_can_batch(gguf_pair, qwen2_target):
    for bad in (0, -1, 1.5, True, 65):
        with pytest.raises(ValueError, match="max_num_seqs must be an integer from 1 to 64"):
            Engine(gguf_pair["target"], strategy="ar", max_num_seqs=bad)
    with Engine(qwen2_target, strategy="ar", dtype="float32", max_num_seqs=4) as native:
        assert native.max_num_seqs == 4 and native.target.n_seqs == 4  # the dynamic native forward batches
    for options in (dict(padded_width=2), dict(strategy="tree", draft=qwen2_target)):
        with Engine(qwen2_target, **{"strategy": "ar", **options}, dtype="float32", max_num_seqs=4) as one:
            assert one.max_num_seqs == 1 and one.batch_stats is None  # padded forwards, trees: one at a time
    with pytest.raises(ValueError, match="several sequences run the native decoder's dynamic forward"):
        load_model(qwen2_target, "float32", padded_width=2, n_seqs=2)
    with pytest.raises(ValueError, match="llamacpp and native backends', not 'hf'"):
        load_model(qwen2_target, "float32", backend="hf", n_seqs=2)


@pytest.mark.parametrize("backend", ["llamacpp", "native"])
def test_adaptive_drafts_priced_by_the_step_keep_every_answer(gguf_pair, backend):
    """The adaptive rule prices a busy step by the rows the other requests bring (drafters/adaptive.py): the draft
    lengths change with the load, the greedy answers do not."""
    native = dict(dtype="float32", padded_width=None) if backend == "native" else {}
    options = dict(strategy="sd", draft="ngram", lookahead=8, adaptive=True, backend=backend, **native)
    with Engine(gguf_pair["target"], max_num_seqs=1, **options) as one:
        want = [one.generate(PROMPTS[i], params(i, False)) for i in range(4)]
    with Engine(gguf_pair["target"], max_num_seqs=4, **options) as e:
        assert_same(together(e, 4, False), want)
        seats = [seat for seat in e.scheduler.seats if seat in e.strategy.policies]
        assert seats  # each seat's rule asks its own sequence's step for the load
        for seat in seats:
            policy = e.strategy.policies[seat]
            assert policy.load == seat.target.shared_load and isinstance(policy.load(), Load)
            assert policy.split == seat.target.step_forwards
        assert_same(together(e, 4, False), want)


def test_sequences_share_the_costs_timed_at_start_up(gguf_pair, monkeypatch):
    """The adaptive rule's forward costs are timed once per model, when the Engine starts (covering the rows a
    shared step can carry): four concurrent first requests time nothing, so none waits on another's timing."""
    from paraspec.drafters.adaptive import ForwardCost

    timed, threads, measure = [], set(), ForwardCost.measure.__func__

    def counted(cls, model, widths, **kwargs):
        timed.append(max(widths))
        threads.add(threading.current_thread().name)
        return measure(cls, model, widths, **kwargs)

    monkeypatch.setattr(ForwardCost, "measure", classmethod(counted))
    options = dict(strategy="sd", draft=["ngram", gguf_pair["draft"]], lookahead=5, adaptive=True, backend="llamacpp")
    with Engine(gguf_pair["target"], max_num_seqs=4, **options) as e:
        at_start = list(timed)
        together(e, 4, False)
        seats = [seat for seat in e.scheduler.seats if seat in e.strategy.policies]
        tables = [e.strategy.policies[seat].cost for seat in seats] + [e.strategy.policy.cost]
        widest_step = e.target.exact_width
    assert len(at_start) == 2 and timed == at_start  # the target's and the draft model's, at start-up only
    assert threads == {"paraspec-scheduler"}  # where the steps run: no second OpenMP pool beside theirs
    assert at_start[0] >= widest_step - 1  # the target's table reaches the widest shared step
    assert len(seats) >= 2 and len({id(t) for t in tables}) == len(tables)  # a copy each: refined apart


def test_one_request_at_a_time_times_the_costs_on_the_callers_thread(gguf_pair, monkeypatch):
    """Without a Scheduler a request's forwards run on its caller's thread; the costs are timed there too: timed on
    another thread (a second OpenMP pool beside the caller's) every forward was priced too high (the AMX Xeon's
    draft step at twice its cost: results/2026-12-03-xeon-amx-fast-drafts.md)."""
    from paraspec.drafters.adaptive import ForwardCost

    threads, measure = set(), ForwardCost.measure.__func__

    def counted(cls, model, widths, **kwargs):
        threads.add(threading.current_thread())
        return measure(cls, model, widths, **kwargs)

    monkeypatch.setattr(ForwardCost, "measure", classmethod(counted))
    with Engine(gguf_pair["target"], gguf_pair["draft"], strategy="sd", backend="llamacpp", max_num_seqs=1) as e:
        assert e.scheduler is None and e.strategy.policy is not None
    assert threads == {threading.current_thread()}


def test_set_up_work_runs_on_the_scheduler_thread_between_steps(gguf_pair):
    """Scheduler.call runs a function on the thread that runs the steps: its result comes back, its error is raised
    in the caller, and once the Engine is closed a call is refused."""
    with Engine(gguf_pair["target"], strategy="ar", backend="llamacpp", max_num_seqs=2) as e:
        scheduler = e.scheduler
        assert scheduler.call(lambda: threading.current_thread().name) == "paraspec-scheduler"

        def fails():
            raise ValueError("inside")

        with pytest.raises(ValueError, match="inside"):
            scheduler.call(fails)
        assert e.generate("ab", SamplingParams(max_new_tokens=4)).token_ids  # the steps still run
    with pytest.raises(RuntimeError, match="closed"):
        scheduler.call(lambda: None)


def test_the_seats_share_the_acceptance_estimates(gguf_pair, monkeypatch):
    """The adaptive rule's acceptance estimates are the pair's: every seat's policy reads and adds to one set, so a
    draft model nobody has judged is tried (its catch-up paid) by the first request only, not once per seat. (The
    tiny pair's forwards cost what their overheads do, so a draft never pays by the costs: its trial is let run.)"""
    from paraspec.drafters.policy import DraftPolicy

    monkeypatch.setattr(DraftPolicy, "_could_pay", lambda self, *args: True)
    options = dict(strategy="sd", draft=gguf_pair["draft"], lookahead=4, adaptive=True, backend="llamacpp")
    with Engine(gguf_pair["target"], max_num_seqs=4, **options) as e:
        together(e, 4, False)
        seats = [seat for seat in e.scheduler.seats if seat in e.strategy.policies]
        estimates = [e.strategy.policies[seat].acceptance for seat in seats]
        own = e.strategy.policy.acceptance
        judged = {key: a.judged for key, a in own.items()}
    assert len(seats) >= 2 and all(a is own for a in estimates)
    assert judged and all(j > 0 for j in judged.values())  # the requests' rounds were recorded there


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "seeded"])
def test_a_fast_drafts_rows_are_shared_unless_the_answer_must_repeat(gguf_pair, sampling):
    """A draft on llama.cpp's fastest kernels is not batch-invariant: greedy requests share its forwards (their
    answers are the target's whatever it proposes), a seeded sampled request's run alone (its draft, so its answer,
    must be what it is alone). The target's rows are kept alone here, so every shared forward is the draft's."""
    want = alone(gguf_pair, "sd-model", 4, sampling)
    with engine(gguf_pair, "sd-model", 4, sampling=sampling) as e:
        assert not e.strategy.draft_models[0].batch_exact and not e.strategy.draft_models[0].exact
        e.target.batch_exact = False
        assert_same(together(e, 4, sampling), want)
        widths = dict(e.batch_stats.widths)
    assert (max(widths, default=0) >= 2) == (not sampling), widths


def test_the_scheduler_thread_runs_every_forward_and_each_seat_keeps_its_own_drafters(gguf_pair, monkeypatch):
    """One owner of the steps: every forward of the target and the draft runs in the Scheduler's thread, never in
    a request's; each seat's kept drafters draft on that seat's view of the draft model, and no strategy is copied."""
    want = alone(gguf_pair, "sd-model", 4, False)
    threads: set[str] = set()
    with engine(gguf_pair, "sd-model", 4) as e:
        for model in (e.target, *e.draft_models):
            for name in ("forward_batch", "forward", "prefill"):
                monkeypatch.setattr(model, name, spied(getattr(model, name), threads))
        assert_same(together(e, 4, False), want)
        seats = [seat for seat in e.scheduler.seats if seat in e.strategy.policies]
        assert len(seats) >= 2
        for seat in seats:
            (drafter,) = e.strategy.policies[seat].drafters
            assert drafter.model is seat.draft_models[0] and seat.draft_models[0].model is e.draft_models[0]
    assert threads == {"paraspec-scheduler"}, threads


def spied(method, threads: set[str]):
    """`method`, noting the name of each thread that calls it."""

    def spy(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return method(*args, **kwargs)

    return spy


def test_a_long_prompt_runs_in_chunks_between_the_other_requests_steps(gguf_pair, monkeypatch):
    """A newcomer's prompt (several PROMPT_CHUNKs) does not stall the running requests: the Scheduler runs one of its
    forwards per step, the others' steps between them; its KV cache is the one the same forwards give alone, so
    every answer is the answer alone (an Engine of one sequence)."""
    from paraspec.models.llamacpp.model import PROMPT_CHUNK

    long_prompts = [[(7 * i + 3 * j) % 190 + 5 for j in range(3 * PROMPT_CHUNK + 9)] for i in range(3)]
    short = PROMPTS[0]
    prompts = [short] + long_prompts
    limits = [SamplingParams(max_new_tokens=40)] + [SamplingParams(max_new_tokens=8)] * 3
    with engine(gguf_pair, "sd-ngram", 1) as one:
        want = [one.generate(p, s) for p, s in zip(prompts, limits)]
    with engine(gguf_pair, "sd-ngram", 4) as e:
        events: list[int | None] = []  # in order: a prompt forward's sequence, or None for any other target forward
        target = e.target
        for name in ("forward_batch", "forward"):
            monkeypatch.setattr(target, name, noted(getattr(target, name), events))
        original_steps = target.prompt_steps

        def counted_steps(tokens, sequence_id=0):
            steps = original_steps(tokens, sequence_id)
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    return done.value
                events.append(sequence_id)  # one of the prompt's forwards has run
                yield

        monkeypatch.setattr(target, "prompt_steps", counted_steps)
        results = [None] * 4

        def call(i):
            results[i] = e.generate(prompts[i], limits[i])

        first = threading.Thread(target=call, args=(0,))
        first.start()
        while not e.target.length_of(0):  # the short request is decoding before the long ones arrive
            time.sleep(0.001)
        others = [threading.Thread(target=call, args=(i,)) for i in (1, 2, 3)]
        for t in others:
            t.start()
        for t in [first, *others]:
            t.join(120)
        assert_same(results, want)
        assert e.batch_stats.prompt_steps >= 3 * 4  # each long prompt took several steps
    # between two forwards of one long prompt, another request's forward ran (its prompt did not hold the step)
    spans = {s: (events.index(s), len(events) - 1 - events[::-1].index(s)) for s in set(events) - {None}}
    assert any(any(e != s for e in events[a + 1 : b]) for s, (a, b) in spans.items()), events


def noted(method, events: list):
    """`method`, noting each call in `events` (None: not a prompt's forward)."""

    def note(*args, **kwargs):
        events.append(None)
        return method(*args, **kwargs)

    return note


@pytest.mark.parametrize("backend", ["llamacpp", "native"])
def test_the_load_a_request_sees_counts_a_waiting_prompt_and_the_models_micro_batches(gguf_pair, backend):
    """What the adaptive rule prices a busy step by (Scheduler.shared_load, step_forwards): another request's
    prompt waiting for the step is a forward run apart (it commits no token), and a step of unequal widths costs
    the forwards the model really runs (llama.cpp: the same tokens of each sequence per micro-batch; the native
    decoder: one forward of all rows)."""
    from paraspec.scheduler import Scheduler

    native = dict(dtype="float32", padded_width=None) if backend == "native" else {}
    target = gguf_pair["target_hf" if backend == "native" else "target"]
    model = load_model(target, backend=backend, n_seqs=2, **native)
    scheduler = Scheduler(model, [])
    try:
        a, b = scheduler.seats
        assert b.load() == Load() and b.split([1, 1]) == [2]  # nobody else asks; one token each: one forward
        wide = [1, min(3, model.exact_width)]
        assert b.split(wide) == ([2, wide[1] - 1] if backend == "llamacpp" else [sum(wide)])
        with scheduler.seated(a), scheduler.seated(b):
            prompt = threading.Thread(target=a.target.prefill, args=(list(range(5, 45)),))
            prompt.start()  # its step waits for b's ask: b is computing
            deadline = time.monotonic() + 30
            while b.load() == Load() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert b.load() == Load(rows=(), apart=(40,))
            b.target.prefill([7, 8, 9])  # b asks: the step runs both prompts
            prompt.join(30)
            assert not prompt.is_alive() and a.target.length == 40
            # an ask of b's waiting for a's: a's load holds its rows where it shares forwards (the probe's verdict:
            # the native decoder's one-token rows may run alone on some CPUs)
            tokens = [11, 12][: model.min_shared_width]
            step = threading.Thread(target=b.target.forward, args=(tokens,))
            step.start()
            while b.target.member.ask.tokens != tokens and time.monotonic() < deadline:
                time.sleep(0.01)
            assert a.load() == Load(rows=(len(tokens),) if model.batch_exact else ())
            a.target.forward([12])
            step.join(30)
            assert not step.is_alive() and (a.target.length, b.target.length) == (41, 3 + len(tokens))
    finally:
        scheduler.close()
        if backend == "llamacpp":
            model.close()


def test_a_request_leaving_never_moves_another_in_the_middle_of_its_prompt(gguf_pair):
    """When a request leaves, the running request on the highest sequence moves into its sequences -- but not
    once its prompt's forwards have started (they are bound to its sequence). The choice and the move are one
    hold between steps: here a step is let run between them if it can (the Scheduler's `order`, which the choice
    calls, waits up to a second for one) while a third request keeps stepping, and the moved request's prompt must
    still leave the cache it gets alone."""
    from paraspec.scheduler import Scheduler

    stepped, leaving = threading.Event(), []

    class Probing(Scheduler):
        def order(self, seat):
            if seat in leaving:  # the choice compares the top request's place with the leaver's
                stepped.wait(1.0)  # a step that runs now starts the top request's prompt
            return Scheduler.order(seat)

        def _step(self, asks):
            super()._step(asks)
            stepped.set()

    prompt = [(7 * i) % 200 + 3 for i in range(150)]  # three of llama.cpp's prompt chunks
    model = load_model(gguf_pair["target"], backend="llamacpp", n_seqs=3)
    try:
        want = model.prefill(prompt, 0)
        model.rollback(0, 0)
        scheduler = Probing(model, [])
        first, mid, top = scheduler.seats
        leaver, got, finished = scheduler.join(first), {}, threading.Event()

        def run_prompt(member):
            try:
                got["logits"] = top.target.prefill(prompt)
            except Exception as e:  # noqa: BLE001 -- asserted below
                got["error"] = e
            with scheduler.idle(member):  # done: the steps go on without it
                finished.wait(60)

        with scheduler.idle(leaver), scheduler.seated(mid), scheduler.seated(top) as member:
            prefill = threading.Thread(target=run_prompt, args=(member,))
            prefill.start()  # waits for the middle request's ask
            leaving.append(first)
            leave = threading.Thread(target=scheduler.leave, args=(leaver,))
            leave.start()
            mid.target.prefill([1, 2, 3])
            for t in range(40):  # the middle request steps on (between its steps a move may come in)
                if got:
                    break
                mid.target.forward([t + 5])
            leave.join(60)
            finished.set()
            prefill.join(60)
            assert "error" not in got, got.get("error")
            assert not prefill.is_alive() and not leave.is_alive() and scheduler.stats.moves == 1
            assert torch.equal(got["logits"], want) and top.target.sequence_id == 0
            assert model.length_of(0) == top.target.length == len(prompt)
        scheduler.close()
    finally:
        model.close()


def test_requests_draft_in_a_step_of_their_own_and_verify_together(gguf_pair):
    """The draft model's asks run first, in a step of their own: a target ask waits while another request
    drafts, then both requests' target rows run in one forward -- the requests draft in the same steps and verify
    together, as the adaptive rule prices a draft model's rounds under load (drafters/adaptive.best_length)."""
    from paraspec.scheduler import Scheduler

    target = load_model(gguf_pair["target"], backend="llamacpp", n_seqs=2)
    draft = load_model(gguf_pair["draft"], backend="llamacpp", n_seqs=2, draft=True)
    events: list[tuple[str, tuple[int, ...]]] = []  # (model, its sequences) per forward, in order
    for name, model in (("target", target), ("draft", draft)):
        for method in ("forward_batch", "forward", "prompt_steps"):
            setattr(model, method, logged(getattr(model, method), name, method, events))
    scheduler = Scheduler(target, [draft])
    try:
        a, b = scheduler.seats
        with scheduler.seated(a), scheduler.seated(b):
            prompts = [threading.Thread(target=s.target.prefill, args=([5, 6, 7, 8],)) for s in (a, b)]
            for t in prompts:
                t.start()
            for t in prompts:
                t.join(60)
            events.clear()
            verify = threading.Thread(target=a.target.forward, args=([9],), daemon=True)
            verify.start()  # a's target ask: it waits while b drafts

            def drafts():
                b.draft_models[0].prefill([5, 6, 7, 8])
                b.draft_models[0].forward([9])

            drafting = threading.Thread(target=drafts, daemon=True)
            drafting.start()
            drafting.join(30)  # (had a's ask run beside b's first draft ask, b's next would wait for a's next)
            assert not drafting.is_alive() and verify.is_alive(), events
            b.target.forward([9, 10])
            verify.join(60)
            assert not verify.is_alive()
            # what each request's forward cost, for the adaptive rule: the whole forward its rows rode in (both
            # requests' 3 rows), not the time it waited; a prompt's forwards aside
            (rode,) = b.target.take_timings()
            assert a.target.take_timings() == [rode] and rode[0] == 3 and b.target.take_timings() == []
            assert [rows for rows, _ in b.draft_models[0].take_timings()] == [1]
    finally:
        scheduler.close()
        target.close()
        draft.close()
    models = [m for m, _ in events]
    first_target = models.index("target")  # every draft forward ran before it, none after
    assert set(models[:first_target]) == {"draft"} and "draft" not in models[first_target:], events
    assert events[-1] == ("target", (0, 1)), events  # one forward of both requests' target rows


def test_a_step_waits_briefly_for_a_request_whose_reader_holds_its_token(gguf_pair):
    """A request whose reader holds its last commit (a server's thread emitting the token) is idle, but comes back
    within milliseconds: a step run without it would cost it a whole step and run with a row less. So a step
    waits for it -- up to its grace (READER_GRACE of the last step; injected here), and no longer: a stream left
    unread does not hold the others' steps up."""
    from paraspec.scheduler import READER_GRACE, Scheduler

    class Graced(Scheduler):
        grace, asks = 0.0, []  # the asks of each step

        def grace_s(self):
            return self.grace

        def _step(self, asks):
            self.asks.append(len(asks))
            super()._step(asks)

    model = load_model(gguf_pair["target"], backend="llamacpp", n_seqs=2)
    scheduler = Graced(model, [])
    try:
        a, b = scheduler.seats
        with scheduler.seated(a) as reader_a, scheduler.seated(b) as reader_b:
            prompts = [threading.Thread(target=s.target.prefill, args=([5, 6, 7, 8],)) for s in (a, b)]
            for t in prompts:
                t.start()
            for t in prompts:
                t.join(60)

            def decode(seat, member, n: int, read) -> None:
                for t in range(n):
                    seat.target.forward([t + 9])
                    with scheduler.idle(member):
                        read()

            # within the grace: a's reader takes 50 ms a token, b's none; every step still carries both requests
            scheduler.grace = 30.0
            scheduler.asks.clear()
            slow = threading.Thread(target=decode, args=(a, reader_a, 6, lambda: time.sleep(0.05)))
            slow.start()
            decode(b, reader_b, 6, lambda: None)
            slow.join(60)
            assert scheduler.asks == [2] * 6
            # past the grace: a's reader holds its token until b has decoded six more -- b's steps run without it
            scheduler.grace, b_done = 0.01, threading.Event()
            held = threading.Thread(target=decode, args=(a, reader_a, 1, lambda: b_done.wait(60)), daemon=True)
            held.start()
            other = threading.Thread(target=decode, args=(b, reader_b, 6, lambda: None), daemon=True)
            other.start()
            other.join(60)
            assert not other.is_alive(), "a step waited for a reader past its grace"
            b_done.set()
            held.join(60)
            assert not held.is_alive()
        assert Scheduler.grace_s(scheduler) == READER_GRACE * scheduler.last_step_s > 0
        scheduler.close()
    finally:
        model.close()


def logged(method, name: str, kind: str, events: list):
    """`method`, noting each call's model and sequences in `events`."""

    def log(*args, **kwargs):
        if kind == "forward_batch":
            sequences = tuple(sorted(item[0] for item in args[0]))
        elif kind == "prompt_steps":
            sequences = (kwargs.get("sequence_id", args[1] if len(args) > 1 else 0),)
        else:
            sequences = (kwargs.get("sequence_id", 0),)
        events.append((name, sequences))
        return method(*args, **kwargs)

    return log
