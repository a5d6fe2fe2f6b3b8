"""One losslessness suite for every registered strategy: a strategy gets all of it by registering.

Greedy: exactly `ar`'s tokens for a draft equal to the target, an unrelated draft and a partially agreeing one,
at several lookahead-like shapes (whatever options the strategy takes: lookahead, tree depth, max_ahead); a
stop token inside a drafted chunk; max_new_tokens inside a chunk; streaming equals generate; several requests on
one engine. Sampling: the joint distribution of the first two tokens equals the target's (chi-square).

Strategies that use several devices use two here: dsi verifies on two target servers, easyspec drafts on two
ranks (DEVICES). Workers run as threads (runtime_kind="inprocess": the same protocol, channels and orchestration as
processes, without spawning N processes per case), and once, greedy and sampling, as processes
(test_worker_processes); the per-strategy modules test faults and cleanup. A toy strategy registered from this
module shows that nothing else needs an edit.
"""

import numpy as np
import pytest

from paraspec import Engine, SamplingParams
from paraspec.strategies import OPTIONS, STRATEGIES, register, unregister
from paraspec.strategies.base import Capabilities, LocalStrategy
from tests.conftest import PROMPT, VOCAB, assert_matches, exact_joint, inject_flat_costs, on_device

SPECULATIVE = [name for name, cls in STRATEGIES.items() if cls.caps.needs_draft]


def shapes(name: str) -> list[dict]:
    """Option sets that move where chunks end: the strategy's own lookahead-like options, at small and large; fixed
    lengths (sd's default, the adaptive rule, may draft nothing on these tiny models: its cases are below)."""
    options = STRATEGIES[name].option_names
    if "adaptive" in options:
        return [dict(shape, adaptive=False) for shape in _shapes(name)]
    return _shapes(name)


def _shapes(name: str) -> list[dict]:
    options = STRATEGIES[name].option_names
    if "lookahead" in options:
        return [
            dict(lookahead=k, max_ahead=max(OPTIONS["max_ahead"].default, 2 * k))
            if "max_ahead" in options
            else dict(lookahead=k)
            for k in (1, 3, 8)
        ]
    if "tree_depth" in options:
        return [
            dict(tree_width=1, tree_depth=4),
            dict(tree_width=3, tree_depth=3, tree_budget=10),
            dict(tree_width=2, tree_depth=6),
        ]
    if "max_ahead" in options:
        return [dict(max_ahead=1, verify_chunk=1), dict(max_ahead=4, verify_chunk=2), dict(max_ahead=16)]
    return [{}]


def long_chunks(name: str) -> dict:
    """The shape with the longest chunks (a stop token or the token budget falls inside one)."""
    return shapes(name)[-1]


# several devices where a strategy spreads over them (CPU core sets; one core each would do as well)
DEVICES = {"dsi": dict(target_devices=["cpu:0", "cpu:1"]), "easyspec": dict(draft_devices=["cpu:0", "cpu:1"])}


# one request at a time (max_num_seqs=1): this suite proves the strategies; many requests sharing forwards are
# tests/strategies/test_batched.py's
def engine(name: str, target, draft, runtime_kind: str | None = None, **options) -> Engine:
    runtime_kind = runtime_kind or ("inprocess" if "inprocess" in STRATEGIES[name].caps.runtime_kinds else "process")
    return Engine(
        target,
        draft,
        strategy=name,
        dtype="float32",
        runtime_kind=runtime_kind,
        **on_device(**DEVICES.get(name, {})),
        **{"max_num_seqs": 1, **options},
    )


def ar(target, **options) -> Engine:
    return Engine(target, strategy="ar", dtype="float32", **on_device(), **{"max_num_seqs": 1, **options})


@pytest.fixture(scope="module")
def ar_engine(qwen2_target):
    with ar(qwen2_target) as e:
        yield e


@pytest.fixture(scope="module")
def drafts(qwen2_target, qwen2_unrelated, qwen2_partial):
    return {"same": qwen2_target, "unrelated": qwen2_unrelated, "partial": qwen2_partial}


CASES = [(name, i) for name in SPECULATIVE for i in range(len(shapes(name)))]


@pytest.mark.parametrize("draft_kind", ["same", "unrelated", "partial"])
@pytest.mark.parametrize("name,shape", CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_greedy_equals_ar(ar_engine, qwen2_target, drafts, name, shape, draft_kind):
    params = SamplingParams(max_new_tokens=40)
    with engine(name, qwen2_target, drafts[draft_kind], **shapes(name)[shape]) as e:
        result = e.generate(PROMPT, params)
    assert result.token_ids == ar_engine.generate(PROMPT, params).token_ids
    assert result.finish_reason == "length"
    s = result.stats
    assert s.drafted > 0 and s.rounds > 0
    if draft_kind == "unrelated":
        assert s.accepted < s.drafted  # rejections really happened and were repaired


@pytest.mark.parametrize("name", SPECULATIVE)
def test_stop_token_inside_a_chunk(ar_engine, qwen2_target, name):
    """A stop id that first appears mid-chunk ends generation exactly there, stop token included."""
    reference = ar_engine.generate(PROMPT, SamplingParams(max_new_tokens=40)).token_ids
    position = next(i for i in range(5, 40) if reference[i] not in reference[:i])
    params = SamplingParams(max_new_tokens=40, stop_token_ids=[reference[position]])
    with engine(name, qwen2_target, qwen2_target, **long_chunks(name)) as e:
        result = e.generate(PROMPT, params)
    assert result.token_ids == reference[: position + 1] and result.finish_reason == "stop"
    assert result.stats.drafted > 0


@pytest.mark.parametrize("name", SPECULATIVE)
def test_max_new_tokens_inside_a_chunk(ar_engine, qwen2_target, qwen2_partial, name):
    with engine(name, qwen2_target, qwen2_partial, **long_chunks(name)) as e:
        for max_new_tokens in (1, 2, 7, 13):
            params = SamplingParams(max_new_tokens=max_new_tokens)
            result = e.generate(PROMPT, params)
            assert result.token_ids == ar_engine.generate(PROMPT, params).token_ids
            assert len(result.token_ids) == max_new_tokens and result.finish_reason == "length"


@pytest.mark.parametrize("name", SPECULATIVE)
def test_streams_equal_generate_over_several_requests(ar_engine, qwen2_target, qwen2_partial, name):
    with engine(name, qwen2_target, qwen2_partial, **shapes(name)[0]) as e:
        for prompt in ["a", "def g(y):", "xyz" * 5]:
            params = SamplingParams(max_new_tokens=20)
            stream = e.stream(prompt, params)
            text = "".join(stream)
            streamed = stream.result
            assert streamed.token_ids == ar_engine.generate(prompt, params).token_ids
            assert text == streamed.text == e.generate(prompt, params).text


# -- the padded forward (models/native/padded.py): every forward padded to W rows, as on GPUs -------------------

PADDED_WIDTH = 4  # narrower than most verifications here: they run in several padded steps


@pytest.fixture(scope="module")
def padded_ar_engine(qwen2_target):
    with ar(qwen2_target, padded_width=PADDED_WIDTH) as e:
        assert e.target.padded_width == PADDED_WIDTH
        yield e


@pytest.mark.parametrize("name", SPECULATIVE)
def test_padded_width_greedy_equals_ar(padded_ar_engine, qwen2_target, qwen2_partial, name):
    """Every forward of every model padded to W rows, the way a GPU runs them (graph-captured there, eager here):
    exactly ar's tokens, with rejections repaired, at the strategy's longest chunks (several steps of W)."""
    params = SamplingParams(max_new_tokens=40)
    reference = padded_ar_engine.generate(PROMPT, params).token_ids
    with engine(name, qwen2_target, qwen2_partial, padded_width=PADDED_WIDTH, **long_chunks(name)) as e:
        result = e.generate(PROMPT, params)
        assert result.token_ids == reference
        assert e.generate("xyz" * 5, params).token_ids == padded_ar_engine.generate("xyz" * 5, params).token_ids
    assert 0 < result.stats.accepted < result.stats.drafted


@pytest.mark.parametrize("name", ["sd", "tree"])
def test_compiled_step_greedy_equals_ar(qwen2_target, qwen2_partial, name):
    """The padded step through torch.compile (compile_step): chains and trees give exactly the tokens of ar on
    the same compiled step, rejections included."""
    params = SamplingParams(max_new_tokens=40)
    with ar(qwen2_target, padded_width=8, compile_step=True) as reference:
        assert reference.target.padded.compiled
        expected = reference.generate(PROMPT, params).token_ids
    with engine(name, qwen2_target, qwen2_partial, padded_width=8, compile_step=True, **long_chunks(name)) as e:
        result = e.generate(PROMPT, params)
    assert result.token_ids == expected
    assert 0 < result.stats.accepted < result.stats.drafted


@pytest.mark.parametrize("name", ["sd", "tree"])
def test_padded_width_sampling_matches_target_distribution(slow_target_pair, name):
    """Sampling through padded forwards (chains, and trees whose mask spans several steps of W): the first two
    tokens follow the target's exact joint distribution."""
    target, draft = slow_target_pair
    prompt = [1, 2, 3]
    with engine(name, target, draft, padded_width=2, **shapes(name)[1]) as e, ar(target) as reference:
        joint = exact_joint(reference, prompt, SamplingParams(**SAMPLING))
        counts, drafted, accepted = sample_first_two(e, prompt)
    assert drafted > N_SAMPLES / 2 and 0.05 * drafted < accepted < 0.95 * drafted
    assert_matches(counts, joint)


# -- sampling ---------------------------------------------------------------------------------------------------

N_SAMPLES = 1_200
SAMPLING = dict(temperature=0.9, top_k=4)  # top-k: q has zeros, as real samplers make


def sample_first_two(e: Engine, prompt, n: int = N_SAMPLES, sampling=SAMPLING) -> tuple[np.ndarray, int, int]:
    """Counts of the first two sampled tokens over n seeds, and the drafts made and accepted."""
    counts, drafted, accepted = np.zeros((VOCAB, VOCAB)), 0, 0
    for seed in range(n):
        result = e.generate(prompt, SamplingParams(max_new_tokens=3, seed=seed, **sampling))
        counts[result.token_ids[0], result.token_ids[1]] += 1
        drafted += result.stats.drafted
        accepted += result.stats.accepted
    return counts, drafted, accepted


# dsi's sampling is checked by tests/strategies/test_dsi.py (two drafters in-process, 1,200 samples),
# test_worker_processes below (processes, 400) and tests/test_multinode.py (Ray nodes over TCP, 1,000): not here too,
# for CI time (it was 103 s of it)
@pytest.mark.parametrize("name", [name for name in SPECULATIVE if name != "dsi"])
def test_sampling_matches_target_distribution(slow_target_pair, name):
    """A draft much faster than its target (so worker strategies judge drafts rather than sampling the target
    alone); the first two tokens follow the target's exact joint distribution, and drafts were really judged."""
    target, draft = slow_target_pair
    prompt = [1, 2, 3]
    with engine(name, target, draft, **shapes(name)[1]) as e, ar(target) as reference:
        joint = exact_joint(reference, prompt, SamplingParams(**SAMPLING))
        counts, drafted, accepted = sample_first_two(e, prompt)
    assert drafted > N_SAMPLES / 2 and 0.05 * drafted < accepted < 0.95 * drafted  # both branches ran
    assert_matches(counts, joint)


# -- a request's logit bias and penalties (sampling.adjust_logits): one chain for the target and the draft -------

PROCESSORS = dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.5, logit_bias={3: 2.0, 5: -100.0})
WITH_PROCESSORS = [name for name in SPECULATIVE if STRATEGIES[name].caps.processors]


@pytest.mark.parametrize(
    "name,draft", [(name, "model") for name in WITH_PROCESSORS] + [("sd", "suffix"), ("dsi", "suffix")]
)
def test_greedy_with_bias_and_penalties_equals_ar(ar_engine, qwen2_target, qwen2_partial, name, draft):
    params = SamplingParams(max_new_tokens=40, **PROCESSORS)
    reference = ar_engine.generate(PROMPT, params).token_ids
    plain = ar_engine.generate(PROMPT, SamplingParams(max_new_tokens=40)).token_ids
    assert reference != plain and 5 not in reference  # the processors change ar's answer; -100 bans token 5
    with engine(name, qwen2_target, qwen2_partial if draft == "model" else "suffix", **shapes(name)[0]) as e:
        result = e.generate(PROMPT, params)
    assert result.token_ids == reference
    assert result.stats.drafted > 0


# ar is the reference the others are held to: its own sampling is checked against the exact joint too
@pytest.mark.parametrize("name", ["ar", "sd", "amusd", "tree", "dsi"])
def test_sampling_with_bias_and_penalties_matches_target_distribution(slow_target_pair, name):
    """Penalties make the second token's distribution depend on the first (x1 is penalised at x2): the target's
    rows and the draft's q are adjusted on their own contexts, and the joint still follows the target's."""
    target, draft = slow_target_pair
    prompt = [1, 2, 3]
    sampling = dict(SAMPLING, top_k=0, min_p=0.02, **{**PROCESSORS, "logit_bias": {0: 1.5, 4: -1.0}})
    build = ar(target) if name == "ar" else engine(name, target, draft, **shapes(name)[1])
    with build as e, ar(target) as reference:
        joint = exact_joint(reference, prompt, SamplingParams(**sampling))
        counts, drafted, accepted = sample_first_two(e, prompt, sampling=sampling)
    if name != "ar":
        assert drafted > N_SAMPLES / 2 and 0.05 * drafted < accepted < 0.95 * drafted  # both branches ran
    assert_matches(counts, joint)


class Plain(LocalStrategy):
    """A toy strategy that declares none of a request's processors, logprobs or grammar (every registered strategy
    applies them): the Engine refuses them by name before decoding."""

    name = "toy-plain"
    summary = "test-only"
    caps = Capabilities(drafts="none", processors=False, logprobs=False, structured=False)

    def decode(self, run, seat=None):
        raise AssertionError("a refused request never reaches decode")


EVERY = "ar, sd, amusd, dsi, tree, easyspec"  # the registered strategies, each applying all of them


def test_a_strategy_without_a_capability_refuses_its_parameters(qwen2_target):
    register(Plain)
    try:
        with Engine(qwen2_target, strategy=Plain.name, dtype="float32") as e:
            for asked, words in [
                (dict(presence_penalty=1.0), "does not apply logit_bias or penalties; drop them"),
                (dict(logprobs=1), "does not report logprobs; drop logprobs"),
                (dict(prompt_logprobs=1), "does not report logprobs; drop logprobs"),
                (dict(structured=("regex", "[ab]+")), "does not apply structured outputs; drop structured"),
            ]:
                with pytest.raises(ValueError, match=f"'toy-plain' {words} or use one of {EVERY}"):
                    e.generate(PROMPT, SamplingParams(max_new_tokens=4, **asked))
    finally:
        unregister(Plain.name)


def test_a_bias_beyond_the_vocabulary_is_refused(ar_engine):
    with pytest.raises(ValueError, match="logit_bias names token 100000, but the target's vocabulary has"):
        ar_engine.generate(PROMPT, SamplingParams(max_new_tokens=4, logit_bias={100000: 1.0}))


PROCESS_SAMPLES = 400  # a request costs a few round trips between processes: fewer samples here


def test_worker_processes(ar_engine, qwen2_target, qwen2_partial, slow_target_pair):
    """dsi's two target servers and its drafter as processes: ar's tokens greedily, the target's joint
    distribution under sampling."""
    params = SamplingParams(max_new_tokens=40)
    with engine("dsi", qwen2_target, qwen2_partial, runtime_kind="process", **shapes("dsi")[1]) as e:
        assert len(e.strategy.runtime.workers) == 3 and e.strategy.runtime.kind == "process"
        result = e.generate(PROMPT, params)
    assert result.token_ids == ar_engine.generate(PROMPT, params).token_ids
    assert 0 < result.stats.accepted < result.stats.drafted
    target, draft = slow_target_pair
    prompt = [1, 2, 3]
    with engine("dsi", target, draft, runtime_kind="process", **shapes("dsi")[1]) as e, ar(target) as reference:
        joint = exact_joint(reference, prompt, SamplingParams(**SAMPLING))
        counts, drafted, accepted = sample_first_two(e, prompt, PROCESS_SAMPLES)
    assert drafted > PROCESS_SAMPLES / 2 and 0.05 * drafted < accepted < 0.95 * drafted
    assert_matches(counts, joint)


# -- a new strategy needs no edit elsewhere --------------------------------------------------------------------


class Echo(LocalStrategy):
    """A toy strategy: drafts nothing, the target decodes one token per round through verify_chain."""

    name = "toy-echo"
    summary = "test-only"
    caps = Capabilities(drafts="none")

    def decode(self, run, seat=None):
        from paraspec.verify import verify_chain

        self.target.rollback(0)
        while not run.done:
            pending = run.sequence[self.target.length :]
            logits = self.target.forward(pending, last_n=1)
            _, token = verify_chain([], None, logits, run.params, run.generator)
            yield run.commit([token])


@pytest.fixture
def toy_registered():
    register(Echo)
    yield Echo.name
    unregister(Echo.name)


def test_a_registered_toy_strategy_runs_through_engine_and_cli(toy_registered, ar_engine, qwen2_target):
    from paraspec.cli.main import build_parser, engine_config

    params = SamplingParams(max_new_tokens=12)
    with Engine(qwen2_target, strategy=toy_registered, dtype="float32") as e:
        result = e.generate(PROMPT, params)
        assert result.token_ids == ar_engine.generate(PROMPT, params).token_ids
        assert e.strategy.name == toy_registered and result.stats.strategy == toy_registered
    args = build_parser().parse_args(["generate", "--target", "t", "--strategy", toy_registered, "--prompt", "x"])
    assert engine_config(args).strategy_class is Echo
    with pytest.raises(ValueError, match="does not apply"):
        Engine(qwen2_target, strategy=toy_registered, runtime_kind="ray")


# -- model-free drafters (ngram, suffix) and the hybrid, with and without the adaptive length ------------------

FREE_TAKERS = [name for name, cls in STRATEGIES.items() if cls.caps.model_free]
FREE_DRAFTS = {
    "ngram": lambda model: "ngram",
    "suffix": lambda model: "suffix",
    "ngram+model": lambda model: ["ngram", model],
    "suffix+model": lambda model: ["suffix", model],
}
# how a model-free drafter sizes its proposals: the defaults (suffix: at most the match length, paths of empirical
# probability >= 0.1; memory per pattern where the strategy takes it), none of it, and strict settings
FREE_RULES = {
    "defaults": {},
    "uncapped": dict(suffix_factor=0.0, suffix_min_prob=0.0, draft_memory=False),
    "strict": dict(suffix_factor=3.0, suffix_min_prob=0.5, draft_memory=True),
}
FREE_CASES = [
    (name, kind, adaptive, "defaults")
    for name in FREE_TAKERS
    for kind in FREE_DRAFTS
    for adaptive in ((False, True) if "adaptive" in STRATEGIES[name].option_names else (False,))
]
FREE_CASES += [
    (name, kind, adaptive, rules)
    for name in FREE_TAKERS
    for kind in ("ngram", "suffix")
    for adaptive in ((False, True) if "adaptive" in STRATEGIES[name].option_names else (False,))
    for rules in ("uncapped", "strict")
]
SMALL_PROMPT = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2]  # repeats: the n-gram and suffix drafters find matches
SAMPLED_PROMPT = [1, 2, 3, 5, 5, 1, 5, 5, 5, 5]  # the target often samples what the drafters propose
FREE_OPTIONS = dict(ngram_min=1)


def free_engine(name, target, draft_model, kind, adaptive, rules="defaults"):
    options = dict(long_chunks(name), **FREE_OPTIONS)
    options.update({k: v for k, v in FREE_RULES[rules].items() if k in STRATEGIES[name].option_names})
    if adaptive:
        options["adaptive"] = True
    e = engine(name, target, FREE_DRAFTS[kind](draft_model), **options)
    if adaptive:
        inject_flat_costs(e)
    return e


def free_id(case) -> str:
    name, kind, adaptive, rules = case
    return f"{name}-{kind}-{'adaptive' if adaptive else 'fixed'}" + ("" if rules == "defaults" else f"-{rules}")


def test_amusd_and_easyspec_refuse_model_free_drafters(qwen2_target):
    for name in [n for n, cls in STRATEGIES.items() if cls.caps.needs_draft and not cls.caps.model_free]:
        with pytest.raises(ValueError, match="needs a draft model, not 'ngram'.*run with"):
            Engine(qwen2_target, "ngram", strategy=name)


@pytest.mark.parametrize("name,kind,adaptive,rules", FREE_CASES, ids=map(free_id, FREE_CASES))
def test_model_free_greedy_equals_ar(slow_target_pair, name, kind, adaptive, rules):
    """Small vocabulary: the text repeats, so proposals are often right and often wrong; exactly ar's tokens over
    several requests (the suffix cache and the pattern memory carry across rounds and requests)."""
    target, draft = slow_target_pair
    with free_engine(name, target, draft, kind, adaptive, rules) as e, ar(target) as reference:
        drafted = accepted = 0
        for prompt in (SMALL_PROMPT, SMALL_PROMPT[:7], [4, 4, 5, 4, 4]):
            params = SamplingParams(max_new_tokens=40)
            result = e.generate(prompt, params)
            assert result.token_ids == reference.generate(prompt, params).token_ids
            drafted += result.stats.drafted
            accepted += result.stats.accepted
    assert drafted > 0
    assert adaptive or 0 < accepted < drafted  # drafts were accepted and rejected (the rule may rightly
    # keep only the rejected ones: these texts are random)


# sampling: every drafter and every q path at least once per strategy (point-mass chains, deterministic tree
# siblings, dsi's drafters in the caller, the hybrids' mixed q), fixed and adaptive; greedy above covers them all.
# The drafters' length rules (uncapped, strict) change which tokens a point mass sits on, not how it is judged: one
# sampled case each for sd and dsi (dsi's in-caller point masses: with the suffix drafter only), for CI time
FREE_SAMPLED = [
    c
    for c in FREE_CASES
    if c
    in {
        ("sd", "ngram", False, "defaults"),
        ("sd", "suffix", True, "defaults"),
        ("sd", "ngram+model", True, "defaults"),
        ("tree", "suffix", False, "defaults"),
        ("tree", "ngram+model", True, "defaults"),
        ("dsi", "suffix+model", False, "defaults"),
        ("sd", "suffix", True, "strict"),
        ("dsi", "suffix", False, "strict"),
    }
]


@pytest.mark.parametrize("name,kind,adaptive,rules", FREE_SAMPLED, ids=map(free_id, FREE_SAMPLED))
def test_model_free_sampling_matches_target_distribution(slow_target_pair, name, kind, adaptive, rules):
    """Point-mass q (and, in the hybrids, the draft model's q where the model drafts): the first two tokens
    follow the target's exact joint distribution."""
    target, draft = slow_target_pair
    prompt = SAMPLED_PROMPT
    with free_engine(name, target, draft, kind, adaptive, rules) as e, ar(target) as reference:
        joint = exact_joint(reference, prompt, SamplingParams(**SAMPLING))
        counts, drafted, accepted = sample_first_two(e, prompt)
    assert drafted > (0 if adaptive else N_SAMPLES / 4)
    if not adaptive:  # both branches ran (the rule may learn to draft only where drafts are rarely right)
        assert 0.05 * drafted < accepted < 0.95 * drafted
    assert_matches(counts, joint)
