"""Structured outputs: a request's constraint (a JSON object, a JSON schema, a regex, a Lark grammar) as a mask on
the target's rows, through llguidance (benchmarks/grammar_mask.py measures it against outlines-core and says why).

    check_structured(value)         SamplingParams' check: the (kind, spec) pair, its grammar compiled (ValueError)
    GrammarMatcher.for_request(...) a request's matcher: the grammar compiled once per (tokenizer, kind, spec)
    matcher.mask_rows(logits, row_tokens)        row i: -inf where the grammar forbids a token after the committed
                                                 output and row_tokens[:i] (a verification's drafts)
    matcher.mask_tree(logits, tokens, parents)   a token tree's rows: row 0 at the output, row i + 1 after node i's path
    matcher.consume(token)                       a committed token (RequestState.commit): the state follows the
                                                 output only
    matcher.forced(limit)                        the tokens the grammar forces after the committed output (drafted
                                                 first: drafters/forced.py)
    matcher.ahead(tokens)                        a block run in the state after the output and some drafts, rolled back
    matcher.follow(tokens)                       a draft worker's matcher: the state after its cache's output
                                                 (drafts included), rolled back with the cache
    WorkerGrammar(folder, structured, end_ids)   what a worker builds its matcher from (a matcher does not pickle)

The matcher's state is the committed output's: masking a round's rows consumes its drafts and rolls them back, so
rejected drafts never reach it. A draft the grammar forbids stays in the rows and is rejected like any other (the
target's p is 0 there); the rows after it are left unmasked, since no accepted path reaches them.

End tokens (the target's EOS ids and the request's stop ids): each is allowed where the grammar accepts (the output
so far is complete), and a stop id that is an ordinary token also where the grammar allows it; the tokenizer's own
EOS is never allowed unless it ends the request. The matcher never consumes an end token: the request ends there.
"""

from __future__ import annotations

import contextlib
import functools
import json
import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "grammar")  # "grammar": a Lark grammar (llguidance's)
ANY_JSON_OBJECT = '{"type": "object"}'


def check_structured(value) -> tuple[str, str] | None:
    """SamplingParams.structured as a (kind, spec) pair of strings, its grammar compiled: a ValueError names the
    kind and the spec that does not compile. A json_schema spec may be given as a dict (kept as JSON text)."""
    if value is None:
        return None
    pair = tuple(value) if isinstance(value, (tuple, list)) else None
    if pair is None or len(pair) != 2 or pair[0] not in STRUCTURED_KINDS:
        raise ValueError(
            f"structured must be a (kind, spec) pair with kind one of {', '.join(STRUCTURED_KINDS)}, got {value!r}"
        )
    kind, spec = pair
    if kind == "json_schema" and isinstance(spec, dict):
        spec = json.dumps(spec)
    if not isinstance(spec, str) or (kind == "json_object") != (spec == ""):
        need = "the empty string" if kind == "json_object" else "a non-empty string"
        raise ValueError(f"structured {kind}: the spec must be {need}, got {spec!r}")
    compile_grammar(kind, spec)
    return kind, spec


@functools.lru_cache(maxsize=256)
def compile_grammar(kind: str, spec: str) -> str:
    """llguidance's grammar for (kind, spec), checked; independent of the tokenizer."""
    import llguidance

    m = llguidance.LLMatcher
    try:
        if kind == "json_object":
            grammar = m.grammar_from_json_schema(ANY_JSON_OBJECT)
        elif kind == "json_schema":
            grammar = m.grammar_from_json_schema(spec)
        elif kind == "regex":
            grammar = m.grammar_from_regex(spec)
        else:
            grammar = m.grammar_from_lark(spec)
        failed, messages = m.validate_grammar_with_warnings(grammar)
    except (ValueError, TypeError, RuntimeError) as e:
        failed, messages = True, [str(e)]
    if failed:
        raise ValueError(f"structured {kind} {spec!r} does not compile: {'; '.join(messages).strip()}")
    return grammar


# per tokenizer (weakly: an Engine's, gone with it) and width: the tokenizer in llguidance's form (its conversion
# takes seconds on a real vocabulary) and a fresh matcher per (kind, spec), which a request copies (sharing the grammar)
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
MAX_GRAMMARS = 256  # compiled grammars kept per tokenizer (the oldest dropped first)


def _template(tokenizer, n_vocab: int, kind: str, spec: str):
    """(llguidance's tokenizer, a fresh matcher of (kind, spec) on it), built once each."""
    import llguidance
    import llguidance.hf

    by_width = _COMPILED.setdefault(tokenizer, {})
    if n_vocab not in by_width:
        by_width[n_vocab] = (llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab), {})
    ll_tokenizer, templates = by_width[n_vocab]
    if (kind, spec) not in templates:
        if len(templates) >= MAX_GRAMMARS:
            del templates[next(iter(templates))]
        templates[(kind, spec)] = llguidance.LLMatcher(ll_tokenizer, compile_grammar(kind, spec), log_level=0)
    return ll_tokenizer, templates[(kind, spec)]


@functools.lru_cache(maxsize=4)
def tokenizer_at(folder: str):
    """A checkpoint folder's tokenizer, loaded once per process (a worker's grammar); None where it has none (a
    weights-only checkpoint, a simulated model, a folder this node does not have)."""
    from paraspec.models.loader import load_tokenizer_if_any

    return load_tokenizer_if_any(folder)


@dataclass(frozen=True)
class WorkerGrammar:
    """A request's constraint as a worker gets it (amusd's verifier, the drafters of amusd and dsi): the target's
    checkpoint folder, whose tokenizer the Engine's matcher uses too, SamplingParams.structured, the ids that end the
    request."""

    folder: str
    structured: tuple[str, str]
    end_ids: tuple[int, ...]

    def matcher(self, vocab_size: int) -> GrammarMatcher | None:
        """The request's matcher in this process; None where this node has no tokenizer in `folder` (a drafter may
        then draft unmasked: its q is still the one it drew from)."""
        tokenizer = tokenizer_at(self.folder)
        return (
            None
            if tokenizer is None
            else GrammarMatcher.for_request(tokenizer, self.structured, vocab_size, self.end_ids)
        )


class GrammarMatcher:
    """One request's grammar state, over the target's `vocab_size` ids."""

    def __init__(self, matcher, ll_tokenizer, kind: str, spec: str, vocab_size: int, end_ids: Collection[int]):
        """matcher: llguidance's LLMatcher over ll_tokenizer (at least vocab_size ids wide)."""
        self.matcher, self.kind, self.spec, self.vocab_size = matcher, kind, spec, vocab_size
        self.end_ids = frozenset(end_ids)
        self._end = torch.tensor(sorted(t for t in self.end_ids if t < vocab_size), dtype=torch.long)
        ll_eos = [t for t in ll_tokenizer.eos_tokens if t not in self.end_ids and t < vocab_size]
        self._foreign_eos = torch.tensor(ll_eos, dtype=torch.long)
        self._bits = torch.zeros((ll_tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
        self._followed: list[int] = []  # the tokens `follow` consumed

    @classmethod
    def for_request(
        cls, tokenizer, structured: tuple[str, str], vocab_size: int, end_ids: Collection[int]
    ) -> GrammarMatcher:
        """A fresh matcher for `structured` (SamplingParams.structured) on the target's ids; `end_ids`: the ids that
        end the request (the target's EOS and the request's stop ids)."""
        kind, spec = structured
        ll_tokenizer, template = _template(tokenizer, max(vocab_size, len(tokenizer)), kind, spec)
        if template.is_error():
            raise ValueError(f"structured {kind} {spec!r} does not compile for this tokenizer: {template.get_error()}")
        return cls(template.deep_copy(), ll_tokenizer, kind, spec, vocab_size, end_ids)

    @property
    def accepting(self) -> bool:
        """The committed output is complete under the grammar (an end token may come now)."""
        return self.matcher.is_accepting()

    def allowed(self) -> torch.Tensor:
        """Bool [vocab_size]: the tokens allowed next in the matcher's current state, end tokens as the module says."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        if self.matcher.is_error():
            raise RuntimeError(f"the {self.kind} matcher failed: {self.matcher.get_error()}")
        bits = np.unpackbits(self._bits.numpy().view(np.uint8), bitorder="little")[: self.vocab_size]
        allowed = torch.from_numpy(bits.astype(bool))
        allowed[self._foreign_eos] = False
        if self.matcher.is_accepting():
            allowed[self._end] = True
        return allowed

    def mask_rows(self, logits: torch.Tensor, row_tokens: Sequence[int] = ()) -> torch.Tensor:
        """`logits` ([rows, vocab] or [vocab]) with -inf where the grammar forbids a token: row i after the committed
        output and row_tokens[:i]. Rows after a forbidden or an end token are left as they are (unreachable)."""
        rows = logits.reshape(-1, logits.shape[-1])
        allowed = torch.ones(rows.shape, dtype=torch.bool)
        consumed = 0
        try:
            for i in range(rows.shape[0]):
                allowed[i] = self._row(rows.shape[-1])
                if i >= len(row_tokens) or not self._advance(row_tokens[i], allowed[i]):
                    break
                consumed += 1
        finally:
            self.matcher.rollback(consumed)
        return rows.masked_fill(~allowed.to(rows.device), float("-inf")).reshape(logits.shape)

    def mask_tree(self, logits: torch.Tensor, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """A token tree's rows ([len(tokens) + 1, vocab]): row 0 after the committed output, row i + 1 after node
        i's path (parents come before children). A node below a forbidden or an end token keeps its row."""
        allowed = torch.ones(logits.shape, dtype=torch.bool)
        allowed[0] = self._row(logits.shape[-1])
        paths: list[list[int] | None] = []
        for i, (token, parent) in enumerate(zip(tokens, parents)):
            above = [] if parent < 0 else paths[parent]
            reachable = above is not None and token not in self.end_ids and bool(allowed[parent + 1, token])
            paths.append(above + [token] if above is not None and reachable else None)
            path = paths[-1]
            if path is None:
                continue
            if not self.matcher.consume_tokens(path):
                raise RuntimeError(f"the {self.kind} matcher refused an allowed path: {self.matcher.get_error()}")
            try:
                allowed[i + 1] = self._row(logits.shape[-1])
            finally:
                self.matcher.rollback(len(path))
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def mask_after(self, logits: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
        """One row ([vocab]) masked in the state after the committed output and `tokens` (a draft chain so far);
        unmasked where that state cannot be reached (a forbidden or an end token among them)."""
        if any(t in self.end_ids for t in tokens) or self.matcher.validate_tokens(list(tokens)) < len(tokens):
            return logits
        if not self.matcher.consume_tokens(list(tokens)):
            raise RuntimeError(f"the {self.kind} matcher refused valid tokens: {self.matcher.get_error()}")
        try:
            allowed = self._row(logits.shape[-1])
        finally:
            self.matcher.rollback(len(tokens))
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def follow(self, tokens: Sequence[int]) -> None:
        """Move the state to the longest prefix of `tokens` (an output, drafts included) that the grammar allows, up to
        the first end token: what a draft worker's cache holds. What no longer matches the tokens followed last is
        rolled back (the draft rolled back its cache); what follows it is consumed. Not mixed with `consume`."""
        followed = self._followed
        keep = len(followed)
        if list(tokens[:keep]) != followed:  # (one comparison in C in the usual case: the cache grew)
            keep = next((i for i, (a, b) in enumerate(zip(followed, tokens)) if a != b), min(keep, len(tokens)))
        if keep < len(followed):
            self.matcher.rollback(len(followed) - keep)
            del followed[keep:]
        for token in tokens[keep:]:
            if token in self.end_ids or self.matcher.validate_tokens([token]) < 1:
                break  # no accepted path goes past it: later drafts masked in the state before it (q still theirs)
            if not self.matcher.consume_token(token):
                raise RuntimeError(f"the {self.kind} matcher refused a valid token: {self.matcher.get_error()}")
            followed.append(token)

    def consume(self, token: int) -> None:
        """A committed token that does not end the request (RequestState.commit): the state moves past it."""
        if token in self.end_ids:
            return
        if not self.matcher.consume_token(token):
            raise RuntimeError(
                f"token {token} was committed where the {self.kind} constraint forbids it (a strategy that does not "
                f"mask its rows): {self.matcher.get_error()}"
            )

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces after the committed output: llguidance's fast-forward tokens (its
        forced bytes as tokens, less any last token a longer one could still replace: forced bytes are not always
        forced tokens), cut before an end token or an id the target does not have. The state does not move."""
        tokens: list[int] = []
        for token in self.matcher.compute_ff_tokens() if limit > 0 else ():
            if len(tokens) == limit or token in self.end_ids or token >= self.vocab_size:
                break
            tokens.append(token)
        return tokens

    @contextlib.contextmanager
    def ahead(self, tokens: Sequence[int]):
        """The state after the committed output and `tokens` (drafts the grammar allows, e.g. `forced`'s) while the
        block runs, rolled back after it: a drafter continuing those drafts masks its own there."""
        if tokens and not self.matcher.consume_tokens(list(tokens)):
            raise RuntimeError(f"the {self.kind} matcher refused drafts it allows: {self.matcher.get_error()}")
        try:
            yield
        finally:
            if tokens:
                self.matcher.rollback(len(tokens))

    def _row(self, width: int) -> torch.Tensor:
        if width != self.vocab_size:
            raise ValueError(f"logits have {width} columns, the {self.kind} matcher {self.vocab_size}")
        allowed = self.allowed()
        if not allowed.any():
            raise RuntimeError(f"the {self.kind} constraint allows no token here (the grammar has no way to go on)")
        return allowed

    def _advance(self, token: int, allowed: torch.Tensor) -> bool:
        """Consume a row token when a later row can be reached through it."""
        if token in self.end_ids or not (0 <= token < self.vocab_size) or not bool(allowed[token]):
            return False
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the {self.kind} matcher refused an allowed token: {self.matcher.get_error()}")
        return True
