"""The llamacpp backend (models/llamacpp/model.py) on tiny GGUF files written by tests/tiny_gguf.py.

- its logits are the native decoder's on the same weights (f32 file; Q8_0 file vs its dequantized weights);
- a forward of w tokens gives logits bitwise equal to w one-token forwards, for w = 1..16, at contexts the probe
  did not use, with 1 and 2 threads: what makes every strategy on it return ar's tokens exactly;
- greedy sd / amusd / dsi equal ar on the backend, and sd's sampling follows the target's distribution;
- bad files and a missing llama-cpp-python give errors that name the fix.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paraspec import Engine, SamplingParams
from paraspec.models.llamacpp import model as llamacpp
from paraspec.models.llamacpp.model import LlamaCppModel, measure_exact_width
from paraspec.models.loader import load_model
from paraspec.runtime.devices import available_cores, current_pinning, lend_cores, set_pinning
from tests.llamacpp_checks import assert_forwards_are_one_token_forwards, one_at_a_time
from tests.tiny_gguf import tiny_hf_model, tiny_vocab, write_gguf


def assert_close_to_native(a: torch.Tensor, b: torch.Tensor, atol: float) -> None:
    diff = float((a - b).abs().max())
    assert diff <= atol, f"llamacpp vs native: max |diff| {diff:.4g} > {atol} (logits' std {float(b.std()):.3g})"
    for x, y in zip(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])):
        assert torch.corrcoef(torch.stack([x, y]))[0, 1] > 0.995


# Tolerances: with K/V kept in f32, llama.cpp's f32 file computes what the fp32 native decoder computes to ~3e-5
# (logits' std ~3); with its f16 K/V (what the engine runs) to ~0.05. The Q8_0 file (std ~0.8) is compared with
# the native decoder on its dequantized weights: llama.cpp also rounds the activations to 8 bits there (~0.06).
# A tensor mapped wrongly moves the logits by about their std, and breaks the correlation.
@pytest.mark.parametrize(
    "kind,kv_f32,atol",
    [("target", True, 2e-4), ("target", False, 0.15), ("target_q8", True, 0.15), ("target_q8", False, 0.15)],
)
def test_logits_match_the_native_decoder(gguf_pair, kind, kv_f32, atol):
    lc = LlamaCppModel(gguf_pair[kind], 2048, (), n_threads=1, kv_f32=kv_f32)
    native = load_model(
        gguf_pair[kind] if kind == "target_q8" else gguf_pair["target_hf"],
        dtype="float32",
        backend="native",
        max_context=2048,
    )
    prompt = list(range(10, 60))
    assert_close_to_native(lc.prefill(prompt), native.prefill(prompt), atol)
    for t in (5, 77, 130):  # decoding one token at a time
        assert_close_to_native(lc.forward([t]), native.forward([t]), atol)
    assert_close_to_native(lc.forward([1, 2, 3, 4]), native.forward([1, 2, 3, 4]), atol)  # a chunk
    for m in (lc, native):  # a rollback, then other tokens
        m.rollback(len(prompt) + 2)
    assert lc.length == native.length == len(prompt) + 2
    assert_close_to_native(lc.forward([200, 201, 9]), native.forward([200, 201, 9]), atol)
    assert lc.vocab_size == native.vocab_size == len(tiny_vocab()[0])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("context", [100, 700])
def test_forward_is_bitwise_one_token_forwards(gguf_pair, threads, context):
    """The guarantee the engine relies on, at contexts the start-up probe did not use (it uses 32 and 600)."""
    model = LlamaCppModel(gguf_pair["target_q8"], 2048, (), n_threads=threads)
    rng = np.random.default_rng(context)
    assert_forwards_are_one_token_forwards(
        model, rng.integers(0, model.vocab_size, size=context + 16).tolist(), context
    )


@pytest.mark.parametrize("prompt", [30, 700])
def test_one_thread_equals_two_threads(gguf_pair, prompt):
    """amusd's target runs on one core, ar's on two: their logits must agree bitwise too. 700: a prompt on flash
    attention's tiled pass (64+ rows), then one-token rows over 512+ KV cells, which unpatched llama.cpp splits
    across threads."""
    ids = [3 + i % 250 for i in range(prompt + 8)]
    one = one_at_a_time(LlamaCppModel(gguf_pair["target_q8"], 2048, (), n_threads=1), ids[:prompt], ids[prompt:])
    two = one_at_a_time(LlamaCppModel(gguf_pair["target_q8"], 2048, (), n_threads=2), ids[:prompt], ids[prompt:])
    assert torch.equal(one, two)


@pytest.mark.skipif(len(available_cores()) < 2, reason="needs two cores")
def test_a_prompt_on_lent_cores_runs_on_their_threads_and_everything_else_on_its_own(gguf_pair, monkeypatch):
    """amusd lends a worker the other worker's core for its prompt (runtime/devices.py lend_cores): the prompt's
    forwards run on both threads, with the logits and KV cache of a prompt on its own thread, and every other
    forward -- verification, another sequence's between two prompt steps -- on its own, which its probe measured."""
    threads = []  # the context's thread count at each llama_decode
    decode = llamacpp._llama_decode_many
    monkeypatch.setattr(
        llamacpp,
        "_llama_decode_many",
        lambda ctx, *a: (threads.append(llamacpp._lib.llama_n_threads(ctx)), decode(ctx, *a))[1],
    )
    before = current_pinning()
    ids = [3 + i % 250 for i in range(150)]
    try:
        set_pinning({available_cores()[0]}, 1)
        model = LlamaCppModel(gguf_pair["target_q8"], 2048, (), n_seqs=2)  # follows torch's thread count: 1
        alone = [model.prefill(ids[:140])[None], model.forward(ids[140:])]
        threads.clear()
        with lend_cores(tuple(available_cores()[:2])):
            lent = [model.prefill(ids[:140])[None]]
        prompt_threads, threads[:] = list(threads), []
        lent.append(model.forward(ids[140:]))
        assert torch.equal(torch.cat(alone), torch.cat(lent))
        assert model.n_threads == 1 and set(prompt_threads) == {2} and set(threads) == {1}
        # a Scheduler's prompt steps: only those stepped on lent cores run on them
        threads.clear()
        with lend_cores(tuple(available_cores()[:2])):
            steps = model.prompt_steps(ids[:140], sequence_id=1)
            next(steps)
        model.forward([7], sequence_id=0)  # another request's step between two prompt steps, on its own thread
        for _ in steps:
            pass
        assert threads[0] == 2 and set(threads[1:]) == {1}
    finally:
        set_pinning(*before)


def test_flash_attention_is_on_only_in_a_patched_build(gguf_pair, monkeypatch):
    """On in a build with paraspec's flash-attention patch (unless PARASPEC_LLAMACPP_FLASH_ATTN=0), refused when
    asked for in one without it, and exact either way."""
    lib = llamacpp._llama_cpp()
    patched = bool(getattr(lib, "__paraspec_flash_attn__", False))
    on = LlamaCppModel(gguf_pair["target_q8"], 2048, (), n_threads=2, probe=False)
    assert on.flash_attention is patched
    assert (
        LlamaCppModel(gguf_pair["target_q8"], 2048, (), n_threads=2, probe=False, kv_f32=True).flash_attention is False
    )  # flash attention would cast f32 K/V to f16
    monkeypatch.setenv("PARASPEC_LLAMACPP_FLASH_ATTN", "0")
    off = LlamaCppModel(gguf_pair["target_q8"], 2048, (), n_threads=2, probe=False)
    assert off.flash_attention is False
    if patched:  # one exactness verdict per setting: the probe's cache keeps them apart
        assert llamacpp._probe_cache(on) != llamacpp._probe_cache(off)
    ids = [3 + i % 250 for i in range(600 + 8)]
    assert_forwards_are_one_token_forwards(off, ids, 600)
    monkeypatch.setenv("PARASPEC_LLAMACPP_FLASH_ATTN", "sometimes")
    with pytest.raises(ValueError, match="use auto, 0 or 1"):
        llamacpp.flash_attention()
    monkeypatch.setenv("PARASPEC_LLAMACPP_FLASH_ATTN", "1")
    monkeypatch.delattr(lib, "__paraspec_flash_attn__", raising=False)
    with pytest.raises(ValueError, match="lacks paraspec's flash-attention patch.*build_llamacpp.py wheel"):
        LlamaCppModel(gguf_pair["target_q8"], 2048, (), n_threads=2, probe=False)


def test_wide_forwards_are_split_to_the_exact_width(gguf_pair, monkeypatch):
    """Where the probe finds width 3 exact, a 8-token forward runs as 3 + 3 + 2, with the same logits."""
    model = LlamaCppModel(gguf_pair["target"], 2048, (), n_threads=1)
    ids = list(range(20, 48))
    reference = one_at_a_time(model, ids[:20], ids[20:])
    model.exact_width, model.forward_widths = 3, {}
    model.rollback(20)
    assert torch.equal(model.forward(ids[20:]), reference)
    assert model.forward_widths == {3: 2, 2: 1}
    model.rollback(20)
    assert torch.equal(model.forward(ids[20:], last_n=4), reference[-4:])


def test_a_first_forward_decodes_its_prompt_as_prefill_does(gguf_pair):
    """A first forward of prompt + more tokens into the empty cache (what a strategy drafting in its prompt round
    asks): the prompt goes in its chunks exactly as ar's prefill (not exact-width pieces), the tokens after it as ar
    decodes them: the same logits bitwise."""
    model = LlamaCppModel(gguf_pair["target"], 2048, (), n_threads=1)
    prompt, drafts = list(range(3, 40)), [50, 51, 52]
    reference = torch.cat([model.prefill(prompt)[None]] + [model.forward([t]) for t in drafts])
    model.rollback(0)
    model.forward_widths = {}
    assert torch.equal(model.forward(prompt + drafts, last_n=4), reference)
    assert model.forward_widths == {3: 1}  # only the drafts went through the exact-width split


@pytest.mark.parametrize("prompt", [40, 100, 600])
def test_a_prompts_last_token_refed_alone_gets_the_prefills_logits(gguf_pair, prompt):
    """dsi's servers roll back to a prompt's last token and feed it again: its logits and what follows must be the
    prefill's. With flash attention on, a prompt chunk of 64+ tokens goes through its tiled pass, whose rows differ
    from one-token rows, so prefill decodes the last token alone there (100, 600); a shorter chunk is exact as is."""
    model = LlamaCppModel(gguf_pair["target_q8"], 2048, (), n_threads=2)
    ids = [3 + (7 * i) % 250 for i in range(prompt + 4)]
    first = torch.cat([model.prefill(ids[:prompt])[None], model.forward(ids[prompt:])])
    model.rollback(prompt - 1)
    again = model.forward(ids[prompt - 1 :])
    assert torch.equal(first, again), f"max |diff| {float((first - again).abs().max()):.3g}"


def test_probe_measures_and_is_cached(gguf_pair, monkeypatch, tmp_path):
    monkeypatch.setenv("PARASPEC_CACHE", str(tmp_path))
    first = LlamaCppModel(gguf_pair["target"], 2048, (), n_threads=2)
    width, rows = measure_exact_width(first)
    assert first.exact_width == width and {r["width"] for r in rows} == set(range(2, llamacpp.PROBE_WIDTH + 1))
    assert len(list((tmp_path / "llamacpp" / "exactness").glob("*.json"))) == 1

    def fail(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(llamacpp, "run_probe", fail)
    assert LlamaCppModel(gguf_pair["target"], 2048, (), n_threads=2).exact_width == width  # from the cache
    with pytest.raises(AssertionError, match="measured again"):  # another thread count is another key
        LlamaCppModel(gguf_pair["target"], 2048, (), n_threads=1)


# -- strategies on the backend ------------------------------------------------------------------------------

PROMPT = [5, 17, 33, 90, 12, 7]
PARAMS = SamplingParams(max_new_tokens=40)


@pytest.fixture(scope="module")
def ar_tokens(gguf_pair):
    with Engine(gguf_pair["target"], strategy="ar", backend="llamacpp") as ar:
        assert ar.backend == "llamacpp"
        return ar.generate(PROMPT, PARAMS).token_ids


@pytest.mark.parametrize(
    "config",
    [
        # fixed lengths: sd's default (the adaptive rule) may rightly draft nothing on the tiny pair
        *(dict(strategy="sd", adaptive=False, lookahead=k) for k in (1, 3, 8)),
        # the prompts at once: on lent cores a tiny target decodes most of the answer alone before its draft has read
        # the prompt, and both acceptance paths are what this checks
        dict(strategy="amusd", target_devices=["cpu:1"], draft_devices=["cpu:0"], lend_cores=False),
        dict(strategy="dsi", lookahead=3, target_devices=["cpu:1", "cpu:1"], draft_devices=["cpu:0"]),
    ],
    ids=["sd1", "sd3", "sd8", "amusd", "dsi"],
)
def test_greedy_strategies_equal_ar(gguf_pair, ar_tokens, config):
    with Engine(gguf_pair["target"], gguf_pair["draft"], backend="llamacpp", **config) as engine:
        result = engine.generate(PROMPT, PARAMS)
        again = engine.generate(PROMPT, PARAMS)  # a second request on the same engine
    assert result.token_ids == ar_tokens and again.token_ids == ar_tokens
    assert 0 < result.stats.accepted < result.stats.drafted  # the draft partly agrees: both paths ran


def test_sd_drafts_nothing_in_the_prompt_round(gguf_pair, ar_tokens):
    """llama.cpp runs the tokens after a prompt in forwards of their own, so sd's prompt round drafts nothing (the
    same drafts cost the same verification a round later): its prefill carries the prompt alone and the first
    token comes before the draft model reads the prompt; the next round verifies the first token and 4 drafts."""
    with Engine(
        gguf_pair["target"], gguf_pair["draft"], strategy="sd", adaptive=False, lookahead=4, backend="llamacpp"
    ) as sd:
        result = sd.generate(PROMPT, PARAMS)
    target = [e for e in result.trace.events if e.device == "target"]
    assert (target[0].kind, target[0].tokens) == ("prefill", len(PROMPT))
    assert (target[1].kind, target[1].tokens) == ("verify", 1 + 4)
    first_draft = next(e for e in result.trace.events if e.kind == "draft" and e.tokens)
    assert first_draft.start_s >= target[0].end_s
    assert result.token_ids == ar_tokens


def test_sd_stops_on_a_stop_token_inside_a_chunk(gguf_pair, ar_tokens):
    stop = ar_tokens[9]
    first = ar_tokens.index(stop)
    params = SamplingParams(max_new_tokens=40, stop_token_ids=[stop])
    with Engine(
        gguf_pair["target"], gguf_pair["draft"], strategy="sd", adaptive=False, lookahead=8, backend="llamacpp"
    ) as sd:
        result = sd.generate(PROMPT, params)
    assert result.token_ids == ar_tokens[: first + 1] and result.finish_reason == "stop"


N_SAMPLES = 4_000


@pytest.mark.parametrize("sampling", [dict(temperature=1.0, top_k=4), dict(temperature=0.8, top_p=0.6)])
def test_sd_sampling_follows_the_target(gguf_pair, sampling):
    """Joint distribution of the first two tokens: sd on llama.cpp vs the target's exact distribution (the second
    one drafted and verified)."""
    from scipy.stats import chisquare

    from paraspec.sampling import logits_to_probs

    params = SamplingParams(**sampling)
    with Engine(
        gguf_pair["sample_target"],
        gguf_pair["sample_draft"],
        strategy="sd",
        adaptive=False,
        lookahead=3,
        backend="llamacpp",
    ) as sd:
        p1 = logits_to_probs(sd.target.prefill(PROMPT), params).double()
        support = torch.nonzero(p1).flatten().tolist()
        joint = {}
        for x1 in support:
            p2 = logits_to_probs(sd.target.prefill(PROMPT + [x1]), params).double()
            for x2 in torch.nonzero(p2).flatten().tolist():
                joint[(x1, x2)] = float(p1[x1] * p2[x2])
        counts, accepted = {}, 0
        for seed in range(N_SAMPLES):
            # three tokens: the first comes from the prefill (no drafts in llama.cpp's prompt round), the second
            # from a verified draft
            result = sd.generate(PROMPT, SamplingParams(max_new_tokens=3, seed=seed, **sampling))
            key = tuple(result.token_ids[:2])
            counts[key] = counts.get(key, 0) + 1
            accepted += result.stats.accepted
    assert set(counts) <= set(joint), f"sampled pairs outside the target's support: {set(counts) - set(joint)}"
    assert 0.05 * N_SAMPLES < accepted < 0.95 * N_SAMPLES  # kept drafts and resampled rejections both ran
    keys = sorted(joint)
    expected = np.array([joint[k] for k in keys])
    observed = np.array([counts.get(k, 0) for k in keys], dtype=float)
    big = expected * N_SAMPLES >= 5  # pool the rare pairs into one cell
    exp, obs = expected[big] * N_SAMPLES, observed[big]
    if (~big).any():
        exp, obs = np.append(exp, expected[~big].sum() * N_SAMPLES), np.append(obs, observed[~big].sum())
    assert chisquare(obs, exp / exp.sum() * obs.sum()).pvalue > 1e-3


# -- backend choice and bad input ---------------------------------------------------------------------------


def test_auto_backend_choice(gguf_pair):
    with Engine(gguf_pair["target"], strategy="ar") as engine:  # a GGUF on CPU: llama.cpp
        assert engine.backend == "llamacpp" and isinstance(engine.target, LlamaCppModel)
    with Engine(gguf_pair["target"], strategy="ar", dtype="float32") as engine:  # a dtype asks for torch
        assert engine.backend == "native"
    with Engine(gguf_pair["target_hf"], strategy="ar") as engine:  # no GGUF source
        assert engine.backend == "native"


def test_tree_strategies_are_refused_on_llamacpp(gguf_pair):
    for strategy in ("tree", "easyspec"):
        with pytest.raises(ValueError, match="backend='native'"):
            Engine(gguf_pair["target"], gguf_pair["draft"], strategy=strategy, backend="llamacpp")
    with Engine(gguf_pair["target"], gguf_pair["draft"], strategy="tree") as tree:  # auto: native
        assert tree.backend == "native"


def test_dtype_is_refused_on_llamacpp(gguf_pair):
    with pytest.raises(ValueError, match="quantized weights"):
        Engine(gguf_pair["target"], strategy="ar", backend="llamacpp", dtype="float32")


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "odd.gguf"
    write_gguf(path, tiny_hf_model("qwen2", len(tiny_vocab()[0]), tied=True), arch="notanarch")
    with pytest.raises(ValueError, match="architecture 'notanarch'.*convert the model"):
        load_model(path, backend="llamacpp")


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "not_gguf"])
def test_damaged_files(gguf_pair, tmp_path, damage):
    data = gguf_pair["target"].read_bytes()
    path = tmp_path / "bad.gguf"
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "corrupt":
        path.write_bytes(data[:64] + bytes(len(data) - 64))  # header start kept, the rest zeroed
    else:
        path.write_bytes(b"PK\x03\x04" + data[4:])
    from paraspec.models.llamacpp.model import load_llamacpp

    expected = "is not a GGUF file" if damage == "not_gguf" else "corrupt or truncated.*re-download the file"
    with pytest.raises(ValueError, match=expected):
        load_llamacpp(path, None)


def test_missing_llama_cpp_python_names_the_fix(monkeypatch):
    import sys

    monkeypatch.setattr(llamacpp, "_lib", None)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if it were not installed
    with pytest.raises(llamacpp.LlamaCppUnavailable, match="make setup|build_llamacpp.py wheel"):
        llamacpp._llama_cpp()


def test_gguf_file_gets_a_tokenizer_folder_without_weights(gguf_pair):
    from paraspec.models.loader import gguf_source, resolve_checkpoint

    folder = resolve_checkpoint(gguf_pair["target"], backend="llamacpp")
    assert not list(folder.glob("*.safetensors")) and (folder / "tokenizer.json").exists()
    assert gguf_source(folder) == gguf_pair["target"].resolve()


@pytest.mark.parametrize("kind", ["target", "target_q8"])
def test_fast_prefill_hands_its_kv_cache_to_the_exact_context(gguf_pair, kind):
    """On the plain kernels the prompt is decoded on a repacked copy of the weights and its KV cache copied into the
    exact context. On the f32 file repacking changes no kernel, so prompt logits and every token decoded after the
    copy must be bitwise those of the exact context alone: a cache copied to the wrong cells or positions would
    not be."""
    prompt, rest = list(range(3, 90)), [50, 51, 52, 7, 9]
    runs = {}
    for fast in (True, False):
        model = LlamaCppModel(gguf_pair[kind], 2048, (), n_threads=1, fast_prefill=fast, kernels="plain")
        runs[fast] = torch.cat(
            [model.prefill(prompt)[None]] + [model.forward([t]) for t in rest] + [model.forward(rest, last_n=len(rest))]
        )
        assert model.fast_prefills == (1 if fast else 0)
        assert model.length == len(prompt) + 2 * len(rest)
        model.close()
    if kind == "target":
        assert torch.equal(runs[True], runs[False])
    else:
        # Q8_0 may be repacked (CPU_REPACK, or AMX kernels on CPUs that have it): the prompt's KV cache comes from
        # other kernels, so the logits are close, and the greedy token is the same wherever the exact context's
        # top-2 margin is wider than the largest difference (a near tie may go either way)
        diff = float((runs[True] - runs[False]).abs().max())
        assert diff < 0.2
        top2 = runs[False].topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * diff
        assert clear.sum() >= len(clear) // 2, "too few clear choices for the check to mean anything"
        assert torch.equal(runs[True].argmax(-1)[clear], runs[False].argmax(-1)[clear])


def test_fast_prefill_is_one_and_the_same_for_every_strategy(gguf_pair, monkeypatch):
    """A prompt reaches the cache through prefill() (ar) or through a first forward (sd's prompt + drafts): both
    take the fast path, so both leave the same cache; and the environment switch turns it off."""
    model = LlamaCppModel(gguf_pair["target_q8"], 2048, (), n_threads=2, kernels="plain")
    prompt, drafts = list(range(3, 60)), [50, 51, 52]
    reference = torch.cat([model.prefill(prompt)[None]] + [model.forward([t]) for t in drafts])
    model.rollback(0)
    assert torch.equal(model.forward(prompt + drafts, last_n=4), reference)
    assert model.fast_prefills == 2
    monkeypatch.setenv("PARASPEC_LLAMACPP_FAST_PREFILL", "0")
    off = LlamaCppModel(gguf_pair["target_q8"], 2048, (), n_threads=2, kernels="plain")
    off.prefill(prompt)
    assert off.fast_prefills == 0 and off._fast is None
