"""Streamed text: decoded a window at a time (linear in the output), and always a prefix of the final text."""

import pytest

from paraspec import Engine, SamplingParams
from paraspec.text_stream import IncrementalText
from tests.tiny import make_checkpoint


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    """A tiny model that holds 4,200 tokens, never emits EOS and writes printable ASCII only: its 98 output rows
    are the tokenizer's 4 special tokens and the 94 printable characters other than whitespace (tests/tiny.py
    orders the bytes so)."""
    return make_checkpoint(
        tmp_path_factory.mktemp("long") / "m",
        "qwen2",
        seed=7,
        scale=20,
        vocab_size=98,
        max_position_embeddings=4200,
        eos_token_id=None,
    )


def test_a_window_at_a_time_gives_the_whole_decode(qwen2_target):
    """Multi-byte characters split over byte tokens: every intermediate text is the decode of the tokens so far,
    or (a half character at the end) a prefix of it, and the last is the text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(qwen2_target))
    text = "héllo wörld — 世界 🙂 def f(x):\n    return x  # ünïcode"
    tokens = tokenizer.encode(text)
    assert len(tokens) > len(text)  # several tokens per character somewhere
    decoder = IncrementalText(tokenizer)
    for n in range(1, len(tokens) + 1):
        partial, whole = decoder.of(tokens[:n]), tokenizer.decode(tokens[:n], skip_special_tokens=True)
        assert whole.startswith(partial) and (partial == whole or whole.endswith("\ufffd"))
    assert partial == text == tokenizer.decode(tokens)
    assert decoder.decoded < 8 * len(tokens)


def test_invalid_bytes_decode_as_a_whole_decode_does(qwen2_target):
    """Random byte tokens (orphan continuation bytes, cut sequences): each call's text is the whole list's decode,
    or a prefix of it while the end is a half character, so the deltas of a stream add up to the final text
    however broken the bytes are."""
    import random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(qwen2_target))
    rng = random.Random(0)
    tokens = tokenizer.encode("ok ") + [rng.randrange(4, len(tokenizer)) for _ in range(300)]
    decoder = IncrementalText(tokenizer)
    for n in range(1, len(tokens) + 1, 3):
        partial, whole = decoder.of(tokens[:n]), tokenizer.decode(tokens[:n], skip_special_tokens=True)
        assert whole.startswith(partial) and (partial == whole or whole.endswith("\ufffd"))


def test_streaming_4000_tokens_decodes_each_token_a_few_times(long_context_model):
    """The counter of tokens handed to the tokenizer grows linearly: decoding the whole output after every
    token (what streams did) would hand it n(n+1)/2 = 8 million tokens."""
    n = 4000
    with Engine(long_context_model, strategy="ar", dtype="float32", max_context=4200) as engine:
        decoded = []
        decode = engine.tokenizer.decode
        engine.tokenizer.decode = lambda ids, **kw: decoded.append(len(ids)) or decode(ids, **kw)
        stream = engine.stream("def:f(x)", SamplingParams(max_new_tokens=n))
        text = "".join(stream)
    result = stream.result
    assert len(result.token_ids) == n and text == result.text
    assert sum(decoded) < 8 * n  # 6.4 n measured: two small windows a token, one final decode
