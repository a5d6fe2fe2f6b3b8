"""Structured outputs (paraspec/structured.py, SamplingParams.structured): the grammar masks the target's rows at every
verified position, so constrained sd (a draft model, suffix), tree, easyspec, amusd and dsi (a draft model, suffix)
return constrained ar's tokens, every output matches its constraint, and constrained sampling through each follows the
target's constrained joint distribution. amusd's verifier masks its rows in the target worker; the draft workers of
amusd and dsi mask their q on the output their cache holds, rolled back with it (GrammarMatcher.follow)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from paraspec import Engine, SamplingParams
from paraspec.models.loader import load_tokenizer_if_any
from paraspec.request_state import RequestState
from paraspec.sampling import logits_to_probs, make_generator
from paraspec.structured import GrammarMatcher, check_structured
from tests.conftest import PROMPT
from tests.tiny import EOS_ID, make_checkpoint

REGEX = r"[a-z][a-z ]{10,30}\."
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "kind": {"enum": ["cat", "dog"]}, "tags": {"type": "array"}},
    "required": ["id", "kind"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},  # llguidance: no free whitespace (a random model loops in it)
}
CONSTRAINTS = {"regex": ("regex", REGEX), "json_schema": ("json_schema", json.dumps(SCHEMA))}


def follows(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    value = json.loads(text)
    return set(value) <= set(SCHEMA["properties"]) and isinstance(value["id"], int) and value["kind"] in ("cat", "dog")


@pytest.fixture(scope="module")
def ar_engine(deep_pair):
    with Engine(deep_pair[0], strategy="ar", dtype="float32", max_num_seqs=1) as engine:
        yield engine


@pytest.fixture(scope="module")
def references(ar_engine) -> dict:
    """Constrained ar's answer for each constraint, checked: complete (an end token where the grammar accepts), and
    other than the unconstrained answer."""
    plain = ar_engine.generate(PROMPT, SamplingParams(max_new_tokens=80)).token_ids
    out = {}
    for kind, structured in CONSTRAINTS.items():
        result = ar_engine.generate(PROMPT, SamplingParams(max_new_tokens=80, structured=structured))
        assert result.finish_reason == "stop" and result.token_ids[-1] == EOS_ID, result.text
        assert follows(kind, result.text) and result.token_ids != plain
        out[kind] = result.token_ids
    return out


STRATEGIES = [
    ("sd", "model", dict(lookahead=3, adaptive=False)),
    ("sd", "suffix", dict(lookahead=3, adaptive=False)),
    ("tree", "model", dict(tree_width=3, tree_depth=3, tree_budget=10)),
    ("easyspec", "model", dict(tree_width=2, tree_depth=4, layer_parallel_size=2)),
    ("amusd", "model", dict(max_ahead=4, verify_chunk=2, runtime_kind="inprocess")),
    ("dsi", "model", dict(lookahead=3, runtime_kind="inprocess", target_devices=["cpu:0", "cpu:1"])),
    ("dsi", "suffix", dict(lookahead=3, runtime_kind="inprocess")),
]


@pytest.mark.parametrize("kind", CONSTRAINTS)
@pytest.mark.parametrize("name,draft,options", STRATEGIES, ids=[f"{n}-{d}" for n, d, _ in STRATEGIES])
def test_greedy_constrained_equals_constrained_ar(deep_pair, references, kind, name, draft, options):
    target, draft_model = deep_pair
    params = SamplingParams(max_new_tokens=80, structured=CONSTRAINTS[kind])
    with Engine(target, draft_model if draft == "model" else draft, strategy=name, dtype="float32", **options) as e:
        first = e.generate(PROMPT, params)
        again = e.generate(PROMPT, params)  # the compiled grammar reused; a fresh state per request
    assert first.token_ids == references[kind] == again.token_ids
    assert follows(kind, first.text)
    if draft == "model":  # the draft is masked too: many of its drafts stand (a quarter to three quarters here;
        # unmasked, it proposes what the grammar forbids, and 0 to 10 % stand)
        assert first.stats.drafted > 0 and first.stats.accepted > first.stats.drafted / 6


def test_the_budget_ends_a_constrained_answer_as_length(ar_engine, references):
    """max_new_tokens inside the constrained answer: its prefix, finish_reason "length" (the user's budget)."""
    result = ar_engine.generate(PROMPT, SamplingParams(max_new_tokens=5, structured=CONSTRAINTS["json_schema"]))
    assert result.finish_reason == "length" and result.token_ids == references["json_schema"][:5]


def test_a_lark_grammar(ar_engine):
    lark = 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]{1,3}/'
    result = ar_engine.generate(PROMPT, SamplingParams(max_new_tokens=20, structured=("grammar", lark)))
    assert result.finish_reason == "stop" and re.fullmatch(r"yes|no|maybe [0-9]{1,3}", result.text), result.text


# -- the matcher: masks on the committed state, rolled back; end tokens only where the grammar accepts ------------


@pytest.fixture(scope="module")
def tokenizer(deep_pair):
    return load_tokenizer_if_any(deep_pair[0])


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_rows_are_masked_on_the_drafts_before_them_and_the_state_is_kept(tokenizer):
    vocab = 267
    matcher = GrammarMatcher.for_request(tokenizer, ("regex", "[ab]{2}c?"), vocab, {EOS_ID})
    a, b, c, x = (ids(tokenizer, ch)[0] for ch in "abcx")
    rows = matcher.mask_rows(torch.zeros(5, vocab), [a, b, c, a])
    allowed = [set(torch.nonzero(row == 0).flatten().tolist()) for row in rows]
    assert allowed[:4] == [{a, b}, {a, b}, {c, EOS_ID}, {EOS_ID}]  # the EOS once "ab" is complete, and after "abc"
    assert allowed[4] == set(range(vocab))  # after "abca", which the grammar forbids: unreachable, left alone
    # a forbidden draft: its own row masked, the rows after it left alone; the state is still the committed one
    rows = matcher.mask_rows(torch.zeros(3, vocab), [x, a])
    assert set(torch.nonzero(rows[0] == 0).flatten().tolist()) == {a, b} and bool((rows[1:] == 0).all())
    matcher.consume(a)
    tree = matcher.mask_tree(torch.zeros(4, vocab), [b, x, c], [-1, -1, 0])  # b, x under the root; c under b
    assert [set(torch.nonzero(row == 0).flatten().tolist()) for row in tree] == [
        {a, b},
        {c, EOS_ID},
        set(range(vocab)),
        {EOS_ID},
    ]
    assert set(torch.nonzero(matcher.mask_rows(torch.zeros(vocab)) == 0).flatten().tolist()) == {a, b}


def test_json_object_allows_an_object_and_ends_after_it(tokenizer):
    """("json_object", ""): any JSON object, with free whitespace (llguidance's default; the tiny random model loops in
    it, so this is checked on the matcher, not on a generation)."""
    vocab = 267
    matcher = GrammarMatcher.for_request(tokenizer, ("json_object", ""), vocab, {EOS_ID})
    text = ids(tokenizer, '{"a": [1, {"b": null}], "c": "d"}')
    rows = matcher.mask_rows(torch.zeros(len(text) + 1, vocab), text)
    assert all(row[token] == 0 for row, token in zip(rows, text))
    assert rows[-1][EOS_ID] == 0 and all(row[EOS_ID] == float("-inf") for row in rows[:-1])
    assert rows[0][ids(tokenizer, "[")[0]] == float("-inf")  # an array is JSON, not an object


def test_a_commit_the_grammar_forbids_is_an_error(tokenizer):
    """RequestState.commit moves the grammar's state; a strategy that committed past its mask is caught, not ignored."""
    params = SamplingParams(structured=("regex", "[ab]+"))
    grammar = GrammarMatcher.for_request(tokenizer, params.structured, 267, {EOS_ID})
    run = RequestState([5], params, frozenset({EOS_ID}), make_generator(0), 100, grammar=grammar)
    run.commit(ids(tokenizer, "ab"))
    with pytest.raises(RuntimeError, match="token .* was committed where the regex constraint forbids it"):
        run.commit(ids(tokenizer, "x"))


def test_a_constraint_is_checked_when_built():
    assert check_structured(["json_schema", {"type": "integer"}]) == ("json_schema", '{"type": "integer"}')
    with pytest.raises(ValueError, match=r"structured regex '\[ab' does not compile"):
        SamplingParams(structured=("regex", "[ab"))
    with pytest.raises(ValueError, match='structured json_schema \'{"type": "foo"}\' does not compile'):
        SamplingParams(structured=("json_schema", '{"type": "foo"}'))
    with pytest.raises(ValueError, match="structured grammar 'start: nothing' does not compile"):
        SamplingParams(structured=("grammar", "start: nothing"))
    with pytest.raises(ValueError, match="kind one of json_object, json_schema, regex, grammar"):
        SamplingParams(structured=("yaml", "a: 1"))
    with pytest.raises(ValueError, match="json_object: the spec must be the empty string"):
        SamplingParams(structured=("json_object", "{}"))
    assert hash(SamplingParams(structured=("regex", "a+"))) == hash(SamplingParams(structured=["regex", "a+"]))


def test_a_draft_workers_state_follows_its_cache(tokenizer):
    """follow(output): the state after the longest allowed prefix of what the draft's cache holds; a rollback of the
    cache rolls the state back, an end token or a forbidden one stops it there."""
    vocab = 267
    matcher = GrammarMatcher.for_request(tokenizer, ("regex", "a[bc]+"), vocab, {EOS_ID})
    a, b, c, x = (ids(tokenizer, ch)[0] for ch in "abcx")

    def allowed():
        return set(torch.nonzero(matcher.mask_after(torch.zeros(vocab), []) == 0).flatten().tolist())

    assert allowed() == {a}
    matcher.follow([a, b])
    assert allowed() == {b, c, EOS_ID}
    matcher.follow([a, b, b, c])  # the cache grew
    assert matcher._followed == [a, b, b, c]
    matcher.follow([a, c])  # the verifier disagreed at the second token: rolled back, then the correction
    assert matcher._followed == [a, c] and allowed() == {b, c, EOS_ID}
    matcher.follow([a, c, EOS_ID, b])  # past an end token: the state stays before it
    assert matcher._followed == [a, c]
    matcher.follow([x])  # a forbidden token: the state of the empty output
    assert matcher._followed == [] and allowed() == {a}


def test_a_checkpoint_without_a_tokenizer_refuses(small_vocab_pair):
    with Engine(small_vocab_pair[0], strategy="ar", dtype="float32") as e:
        with pytest.raises(ValueError, match="structured outputs need the target's tokenizer"):
            e.generate([1, 2], SamplingParams(max_new_tokens=4, structured=("regex", "[ab]+")))


# -- sampling: the first two tokens follow the target's constrained joint distribution ---------------------------

N_SAMPLES = 1_200
SAMPLING = dict(temperature=0.9)
FIRST, SECOND = "ab", "abc"  # what "[ab][abc]+" allows at the first two positions (no end token before the third)


@pytest.fixture(scope="module")
def sampling_pair(tmp_path_factory):
    """Milder logits than deep_pair's (the constrained distribution is not a point mass), a draft that differs."""
    d = tmp_path_factory.mktemp("structured-sampling")
    return make_checkpoint(d / "t", "qwen2", seed=31, scale=3), make_checkpoint(d / "d", "qwen2", seed=32, scale=3)


def constrained_joint(engine, prompt: list[int]) -> tuple[np.ndarray, list[int], list[int]]:
    """P(x1, x2) of sampling the target with x1 in FIRST and x2 in SECOND, from its logits and the two id sets
    (written here, not the matcher's masks)."""
    tok = engine.tokenizer
    first, second = [ids(tok, ch)[0] for ch in FIRST], [ids(tok, ch)[0] for ch in SECOND]
    params = SamplingParams(**SAMPLING)

    def probs(logits, allowed):
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        return logits_to_probs(masked, params).double()

    p1 = probs(engine.target.prefill(prompt), first)
    joint = np.zeros((len(first), len(second)))
    for i, x1 in enumerate(first):
        joint[i] = p1[x1].item() * probs(engine.target.prefill(prompt + [x1]), second)[second].numpy()
    return joint, first, second


SAMPLED = {
    "ar": {},
    "sd": dict(lookahead=3, adaptive=False),
    "tree": dict(tree_width=2, tree_depth=3),
    "amusd": dict(max_ahead=4, verify_chunk=2, runtime_kind="inprocess"),
    "dsi": dict(lookahead=2, runtime_kind="inprocess", target_devices=["cpu:0", "cpu:1"]),
}


@pytest.mark.parametrize("name", SAMPLED)
def test_constrained_sampling_matches_the_targets_constrained_joint(sampling_pair, name):
    target, draft = sampling_pair
    prompt = [10, 11, 12]
    options = SAMPLED[name]
    with Engine(target, strategy="ar", dtype="float32") as reference:
        joint, first, second = constrained_joint(reference, prompt)
    assert joint.min() > 0.01 and joint.max() < 0.7  # not a point mass: the test can tell distributions apart
    drafts = [] if name == "ar" else [draft]
    counts = np.zeros_like(joint)
    drafted = accepted = 0
    with Engine(target, *drafts, strategy=name, dtype="float32", **options) as e:
        for seed in range(N_SAMPLES):
            params = SamplingParams(max_new_tokens=3, seed=seed, structured=("regex", "[ab][abc]+"), **SAMPLING)
            result = e.generate(prompt, params)
            x1, x2 = result.token_ids[:2]
            assert x1 in first and x2 in second  # every output follows the constraint
            counts[first.index(x1), second.index(x2)] += 1
            drafted += result.stats.drafted
            accepted += result.stats.accepted
    if name != "ar":
        assert drafted > N_SAMPLES / 2 and 0.05 * drafted < accepted < 0.95 * drafted  # both branches ran
    expected = joint.ravel() / joint.sum() * N_SAMPLES
    assert chisquare(counts.ravel(), expected).pvalue > 1e-3


def constrained_joint3(engine, prompt: list[int]) -> tuple[np.ndarray, list[list[int]]]:
    """P(x1, x2, x3) of sampling the target under "[ab][abc]+": x1 in FIRST, x2 in SECOND, x3 in SECOND or the end
    token (the grammar accepts after two characters), from its logits and the id sets written here."""
    tok = engine.tokenizer
    allowed = [[ids(tok, ch)[0] for ch in FIRST], [ids(tok, ch)[0] for ch in SECOND]]
    allowed.append(allowed[1] + [EOS_ID])
    params = SamplingParams(**SAMPLING)

    def probs(output):
        logits = engine.target.prefill(prompt + output)
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed[len(output)]] = logits[allowed[len(output)]]
        return logits_to_probs(masked, params).double()

    joint = np.zeros([len(a) for a in allowed])
    p1 = probs([])
    for i, x1 in enumerate(allowed[0]):
        p2 = probs([x1])
        for j, x2 in enumerate(allowed[1]):
            joint[i, j] = p1[x1].item() * p2[x2].item() * probs([x1, x2])[allowed[2]].numpy()
    return joint, allowed


WORKER_CHUNKS = {  # chunks of two drafts or more after the first token (judged from the prefill's row)
    "amusd": dict(max_ahead=4, verify_chunk=3, runtime_kind="inprocess"),
    "dsi": dict(lookahead=3, max_ahead=6, runtime_kind="inprocess", target_devices=["cpu:0", "cpu:1"]),
}


@pytest.mark.parametrize("name", WORKER_CHUNKS)
def test_constrained_sampling_of_three_tokens_matches_the_targets_joint(sampling_pair, name):
    """The first two tokens are judged on rows after the committed output only (amusd and dsi judge the first from
    the prefill's row in hand); the third follows a draft in the same chunk: its row is masked after that draft."""
    target, draft = sampling_pair
    prompt = [10, 11, 12]
    with Engine(target, strategy="ar", dtype="float32") as reference:
        joint, allowed = constrained_joint3(reference, prompt)
    assert joint.min() > 1e-3 and joint.max() < 0.3
    counts = np.zeros_like(joint)
    drafted = accepted = 0
    with Engine(target, draft, strategy=name, dtype="float32", **WORKER_CHUNKS[name]) as e:
        for seed in range(N_SAMPLES):
            params = SamplingParams(max_new_tokens=4, seed=seed, structured=("regex", "[ab][abc]+"), **SAMPLING)
            result = e.generate(prompt, params)
            cell = [a.index(x) for a, x in zip(allowed, result.token_ids)]  # ValueError: a token outside the grammar
            counts[tuple(cell)] += 1
            drafted += result.stats.drafted
            accepted += result.stats.accepted
    assert drafted > N_SAMPLES and 0.05 * drafted < accepted < 0.95 * drafted
    expected = joint.ravel() / joint.sum() * N_SAMPLES
    assert chisquare(counts.ravel(), expected).pvalue > 1e-3


# -- the reference pair: a JSON schema on Qwen2.5-Coder, sd (0.5B draft) == ar --------------------------------

TARGET, DRAFT = "Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "languages": {"type": "array", "maxItems": 2},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}


def reference_pair_missing() -> bool:
    from paraspec.models.cache import cache_dir

    return not all((cache_dir() / "models" / m.replace("/", "--") / "config.json").exists() for m in (TARGET, DRAFT))


@pytest.mark.real_pair
@pytest.mark.skipif(reference_pair_missing(), reason="reference pair missing: run `make models`")
def test_reference_pair_json_schema_sd_equals_ar():
    """llama.cpp's exact kernels (no near-tie allowance needed, tests/test_real_pair.py): the draft's chains are
    masked too, so most of them are accepted."""
    from paraspec.models.loader import llamacpp_installed

    load = dict(backend="llamacpp") if llamacpp_installed() else dict(backend="native", dtype="float32")
    messages = [{"role": "user", "content": "Describe Ada Lovelace as a JSON object: name, age at death, languages."}]
    params = SamplingParams(max_new_tokens=48, structured=("json_schema", json.dumps(PERSON)))
    with Engine(TARGET, strategy="ar", max_num_seqs=1, **load) as ar:
        reference = ar.generate(messages, params)
    with Engine(TARGET, DRAFT, strategy="sd", max_num_seqs=1, lookahead=4, adaptive=False, **load) as sd:
        result = sd.generate(messages, params)
    assert result.token_ids == reference.token_ids
    assert result.finish_reason == "stop", result.text
    person = json.loads(result.text)
    assert set(person) == set(PERSON["properties"]) and isinstance(person["age"], int), result.text
    assert len(person["languages"]) <= 2
    assert result.stats.accepted > result.stats.drafted / 2
