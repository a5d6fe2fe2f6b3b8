"""What a grammar engine costs per token for structured outputs (issue 50 item 4): llguidance vs outlines-core, on
the reference tokenizer (Qwen2.5-Coder, 151,936 rows).

For each engine and each constraint (a JSON schema, a regex) it prints:
- compile: building the grammar for the tokenizer once (outlines-core: its whole token index up front; llguidance:
  the grammar only, its lexer states built lazily), and the tokenizer's one-time conversion;
- mask: computing the allowed-token bitmask at each position of a valid output (its canonical tokenization), the
  mean, the median and the worst, over every position (the first included);
- consume: advancing the state by one token;
- rollback: undoing the last 4 tokens (a round whose drafts were rejected); fork: copying a state (llguidance's
  deep_copy; outlines-core's Guide has none, so a tree is walked with rollbacks).

Why paraspec uses llguidance (sampling layer, paraspec/structured.py): it compiles a request's grammar in
milliseconds, where outlines-core builds an index of every (state, token) pair up front, a cost that grows with the
schema and is paid on each new schema before the first token; it takes all four kinds of the API (JSON object, JSON
schema with recursion and references, regex, Lark grammars), where outlines-core takes regexes (a schema becomes a
regex, with no recursion); it rolls back any number of consumed tokens and forks a state; and both wheels are plain
manylinux x86_64 builds that pick their SIMD paths at run time (cpuid), so neither needs a CPU feature. Per token
neither is cheaper everywhere (outlines-core looks its masks up in the index; llguidance walks its lexer, slowest
where a wide character class allows much of the vocabulary), and both stay far below a target forward.

    .venv/bin/python benchmarks/grammar_mask.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from paraspec.models.loader import load_tokenizer_if_any, resolve_checkpoint

TARGET = "Qwen/Qwen2.5-Coder-1.5B-Instruct"
VOCAB = 151_936
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "tags", "role"],
    "additionalProperties": False,
}
SCHEMA_TEXT = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"], "role": "admin"}'
REGEX = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01]) [A-Z][a-z]+( [A-Z][a-z]+)*: [a-z ,.]{10,80}"
REGEX_TEXT = "2024-03-14 Grace Hopper: the first compiler ran, and the bug was a moth."
ROLLBACK = 4


def byte_vocabulary(tokenizer) -> dict[bytes, list[int]]:
    """outlines-core's vocabulary: each token's bytes (byte-level BPE: the printable stand-ins mapped back)."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    chars = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    to_byte = {chr(c): c for c in chars}
    extra = [b for b in range(256) if b not in chars]
    to_byte.update({chr(256 + i): b for i, b in enumerate(extra)})
    assert set(to_byte) == set(alphabet)
    specials = set(tokenizer.all_special_ids)
    vocab: dict[bytes, list[int]] = {}
    for text, token in tokenizer.get_vocab().items():
        if token not in specials and all(c in to_byte for c in text):
            vocab.setdefault(bytes(to_byte[c] for c in text), []).append(token)
    return vocab


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer):
        import llguidance.hf

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB)
        self.mask = torch.zeros((VOCAB + 31) // 32, dtype=torch.int32)

    def compile(self, kind: str, spec: str):
        m = self.llg.LLMatcher
        grammar = m.grammar_from_json_schema(spec) if kind == "json_schema" else m.grammar_from_regex(spec)
        matcher = m(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def fill_mask(self, state) -> None:
        state.unsafe_compute_mask_ptr(self.mask.data_ptr(), self.mask.numel() * 4)

    def consume(self, state, token: int) -> None:
        assert state.consume_token(token), state.get_error()

    def rollback(self, state, n: int) -> None:
        state.rollback(n)

    def fork(self, state):
        return state.deep_copy()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer):
        import outlines_core

        self.oc = outlines_core
        self.vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, byte_vocabulary(tokenizer))
        self.mask = torch.zeros((VOCAB + 31) // 32, dtype=torch.int32)

    def compile(self, kind: str, spec: str):
        regex = self.oc.json_schema.build_regex_from_schema(spec) if kind == "json_schema" else spec
        return self.oc.Guide(self.oc.Index(regex, self.vocabulary), max_rollback=64)

    def fill_mask(self, state) -> None:
        state.write_mask_into(self.mask.data_ptr(), self.mask.numel(), 4)

    def consume(self, state, token: int) -> None:
        state.advance(token, return_tokens=False)

    def rollback(self, state, n: int) -> None:
        state.rollback_state(n)

    fork = None


def measure(engine, kind: str, spec: str, tokens: list[int]) -> dict:
    start = time.perf_counter()
    state = engine.compile(kind, spec)
    compile_s = time.perf_counter() - start
    masks, consumes, rollbacks, forks = [], [], [], []
    for i, token in enumerate(tokens):
        start = time.perf_counter()
        engine.fill_mask(state)
        masks.append(time.perf_counter() - start)
        allowed = bool(engine.mask[token // 32] >> (token % 32) & 1)
        assert allowed, f"{engine.name}: token {i} ({token}) of the valid text is masked out"
        start = time.perf_counter()
        engine.consume(state, token)
        consumes.append(time.perf_counter() - start)
        if i >= ROLLBACK:
            start = time.perf_counter()
            engine.rollback(state, ROLLBACK)
            rollbacks.append(time.perf_counter() - start)
            for again in tokens[i - ROLLBACK + 1 : i + 1]:
                engine.consume(state, again)
        if engine.fork is not None:
            start = time.perf_counter()
            engine.fork(state)
            forks.append(time.perf_counter() - start)
    us = lambda xs: statistics.mean(xs) * 1e6 if xs else float("nan")  # noqa: E731
    return dict(
        compile_ms=compile_s * 1e3,
        mask_mean_us=us(masks),
        mask_median_us=statistics.median(masks) * 1e6,
        mask_max_us=max(masks) * 1e6,
        consume_us=us(consumes),
        rollback_us=us(rollbacks),
        fork_us=us(forks),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="fresh compiles per engine and constraint (the first and the best printed)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer_if_any(resolve_checkpoint(TARGET))
    cases = [
        ("json_schema", json.dumps(SCHEMA), tokenizer.encode(SCHEMA_TEXT)),
        ("regex", REGEX, tokenizer.encode(REGEX_TEXT)),
    ]
    columns = ["compile_ms", "mask_mean_us", "mask_median_us", "mask_max_us", "consume_us", "rollback_us", "fork_us"]
    print(f"{'engine':20} {'constraint':12} {'tokens':>6} " + " ".join(f"{c:>14}" for c in columns))
    for cls in (Llguidance, OutlinesCore):
        start = time.perf_counter()
        engine = cls(tokenizer)
        print(f"# {engine.name}: tokenizer conversion {time.perf_counter() - start:.2f} s")
        for kind, spec, tokens in cases:
            runs = [measure(engine, kind, spec, tokens) for _ in range(args.repeat)]
            best = {c: min(r[c] for r in runs) for c in columns}
            for label, row in (("first", runs[0]), ("best", best)):
                name = f"{engine.name} {label}"
                print(f"{name:20} {kind:12} {len(tokens):6d} " + " ".join(f"{row[c]:14.1f}" for c in columns))


if __name__ == "__main__":
    main()
