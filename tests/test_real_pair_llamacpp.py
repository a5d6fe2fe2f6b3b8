"""The reference pair on the llamacpp backend: every strategy returns ar's tokens, bitwise (llama.cpp's kernels
are exact by construction here, so no near-tie allowance), batched requests equal alone, and the kernels the probe
keeps are batch-invariant. Apart from tests/test_real_pair.py (the native backend) so that `make test`'s two
workers share the pair's tests (`--dist loadfile` gives a file to one worker). Needs `make models`."""

import pytest
import torch

from paraspec import Engine, SamplingParams
from tests.conftest import inject_flat_costs
from tests.real_pair import DRAFT, PARAMS, PROMPTS, REAL_PAIR_MARKS, TARGET, every_core  # noqa: F401 (autouse)

pytestmark = REAL_PAIR_MARKS

LLAMACPP_STRATEGIES = {
    "sd": dict(strategy="sd", lookahead=5),  # sd's default: the adaptive rule (costs injected)
    "sd-confidence": dict(strategy="sd", lookahead=16, draft_confidence=0.6, adaptive=False),  # make demo's
    "amusd": dict(strategy="amusd", target_devices=["cpu:1"], draft_devices=["cpu:0"]),
    "dsi": dict(strategy="dsi", lookahead=4, target_devices=["cpu:1", "cpu:1"], draft_devices=["cpu:0"]),
    # model-free drafters, the hybrid and the adaptive length (draft= replaces the draft model)
    "sd-ngram": dict(strategy="sd", draft="ngram", lookahead=8, adaptive=False),
    "sd-suffix": dict(strategy="sd", draft="suffix", lookahead=8, adaptive=False),
    "sd-ngram+model-adaptive": dict(strategy="sd", draft=["ngram", DRAFT], lookahead=8, adaptive=True),
    "sd-suffix-adaptive": dict(strategy="sd", draft="suffix", lookahead=32, adaptive=True),  # make demo's
    "dsi-ngram+model": dict(
        strategy="dsi", draft=["ngram", DRAFT], lookahead=4, target_devices=["cpu:1"], draft_devices=["cpu:0"]
    ),
}


LLAMACPP_PROMPTS = PROMPTS[:2]


@pytest.fixture(scope="module")
def llamacpp_reference() -> list:
    with Engine(TARGET, strategy="ar", backend="llamacpp", max_num_seqs=1) as ar:  # alone: one sequence
        return [ar.generate(p, PARAMS) for p in LLAMACPP_PROMPTS]


@pytest.mark.parametrize("name", list(LLAMACPP_STRATEGIES))
def test_llamacpp_strategy_equals_ar_exactly(llamacpp_reference, name):
    options = dict(LLAMACPP_STRATEGIES[name])
    draft = options.pop("draft", DRAFT)
    with Engine(TARGET, draft, backend="llamacpp", max_num_seqs=1, **options) as engine:
        adaptive = engine.options.get("adaptive", False) is not False  # True, or None: auto (greedy: the rule)
        if adaptive:
            inject_flat_costs(engine)  # the rule drafts wherever it has a chance, whatever the machine's load
        drafted = 0
        for prompt, expected in zip(LLAMACPP_PROMPTS, llamacpp_reference, strict=True):
            result = engine.generate(prompt, PARAMS)
            drafted += result.stats.drafted
            assert adaptive or result.stats.accepted > 0  # (adaptive: may rightly not draft)
            assert result.token_ids == expected.token_ids, (
                f"{name} on llamacpp differs from ar at output token "
                f"{next((i for i, (a, b) in enumerate(zip(expected.token_ids, result.token_ids)) if a != b), '(end)')}"
            )
    assert drafted > 0


BATCHED_TOKENS = (40, 16)  # two lengths per prompt: requests leave the batch while others go on (fewer than
# ar's 64: these forwards are what the test is about, and CI pays for each token)


@pytest.mark.parametrize("name", ["ar", "sd", "sd-ngram"])
def test_llamacpp_batched_requests_equal_ar_alone(llamacpp_reference, name):
    """Four callers at once on one Engine (max_num_seqs=4: their forwards shared, scheduler.py), each prompt twice
    with different lengths: every answer is ar's alone, bitwise, where the probe found batched rows exact."""
    import threading

    options = {
        "ar": dict(strategy="ar"),
        "sd": dict(strategy="sd", lookahead=5, adaptive=False),
        "sd-ngram": dict(strategy="sd", draft="ngram", lookahead=8, adaptive=False),
    }[name]
    draft = options.pop("draft", None if name == "ar" else DRAFT)
    with Engine(TARGET, draft, backend="llamacpp", max_num_seqs=4, **options) as engine:
        if not engine.target.batch_exact:
            pytest.skip(
                "llama.cpp's rows are not batch-exact across sequences here (each request decodes alone; "
                "tests/strategies/test_batched.py covers that path)"
            )
        asks = [(p, n) for n in BATCHED_TOKENS for p in range(len(LLAMACPP_PROMPTS))]
        results = [None] * len(asks)

        def call(i):
            prompt, n = asks[i]
            results[i] = engine.generate(LLAMACPP_PROMPTS[prompt], SamplingParams(max_new_tokens=n))

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(asks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        shared = engine.batch_stats.widths
    for (prompt, n), result in zip(asks, results, strict=True):
        assert result.token_ids == llamacpp_reference[prompt].token_ids[:n], f"{name}: prompt {prompt}, {n} tokens"
    assert max(shared) >= 2  # forwards really were shared


def test_llamacpp_fast_prefill_and_the_re_fed_last_prompt_token():
    """On the plain kernels the prompt is decoded on repacked weights (other kernels: other logits), all but its
    last token; that one is decoded exactly, so a strategy that rolls back to it and feeds it again (dsi's servers
    do) gets ar's KV and logits bitwise. Decoding the whole prompt on the repacked copy broke dsi on this pair:
    this checks why not."""
    from paraspec.models.llamacpp.model import LlamaCppModel
    from paraspec.models.loader import gguf_source, resolve_checkpoint

    path = gguf_source(resolve_checkpoint(TARGET, backend="llamacpp"))
    prompt = list(range(1000, 1120))
    fast = LlamaCppModel(path, 1024, (), n_threads=2, probe=False, fast_prefill=True, kernels="plain")
    first = fast.prefill(prompt)
    assert fast.fast_prefills == 1
    after = fast.forward([17, 18])
    fast.rollback(len(prompt) - 1)
    assert torch.equal(fast.forward([prompt[-1], 17, 18]), torch.cat([first[None], after]))
    fast.close()
    exact = LlamaCppModel(path, 1024, (), n_threads=2, probe=False, fast_prefill=False, kernels="plain")
    assert not torch.equal(exact.prefill(prompt), first)  # the repacked kernels do differ on this model
    exact.close()


# every width up to one past llama.cpp's tiled matmul (8 rows on), then its edges: the probe itself checks all of
# 1..PROBE_WIDTH at load time, and every width cost this test 156 s of CI on Zen 3
SWEPT_WIDTHS = (*range(1, 10), 15, 16, 17, 31, 32)


@pytest.mark.parametrize("model", [TARGET, DRAFT])
def test_llamacpp_repacked_kernels_are_batch_invariant(model):
    """With paraspec's patched build, llama.cpp's repacked weights (Q4_K -> q4_K_8x8; on AVX512-VNNI builds also
    the tiled matmul of the Q6_K ones from 8 tokens on) give a forward of w tokens the logits of w one-token
    forwards, bitwise, for w in SWEPT_WIDTHS (up to PROBE_WIDTH) at a short and a long context, at 2 threads; and
    the backend, left to choose, keeps them (the probe finds every width exact)."""
    from paraspec.models.llamacpp.model import PROBE_WIDTH, LlamaCppModel
    from paraspec.models.loader import gguf_source, resolve_checkpoint
    from tests.llamacpp_checks import assert_forwards_are_one_token_forwards

    assert max(SWEPT_WIDTHS) == PROBE_WIDTH
    path = gguf_source(resolve_checkpoint(model, backend="llamacpp"))
    lc = LlamaCppModel(path, 1024, (), n_threads=2, probe=False, kernels="repacked")
    rng = torch.Generator().manual_seed(0)
    for context in (32, 600) if model == TARGET else (600,):
        ids = torch.randint(0, lc.vocab_size, (context + PROBE_WIDTH,), generator=rng).tolist()
        assert_forwards_are_one_token_forwards(lc, ids, context, model, SWEPT_WIDTHS)
    lc.close()
    chosen = LlamaCppModel(path, 1024, (), n_threads=2)
    assert chosen.kernels == "repacked" and chosen.exact_width == PROBE_WIDTH
    chosen.close()
