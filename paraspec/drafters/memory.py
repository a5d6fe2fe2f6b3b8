"""What a model-free drafter remembers of its own proposals: per pattern, how far the last proposal from it was
right (llama.cpp's ngram-map keeps the accepted count of each key's last draft the same way, `n_accepted`).

A pattern is the matched context a proposal continues (its last KEY_TOKENS tokens). After each round the drafter
is told the tokens committed after its last proposal (`Drafter.committed`), whoever drafted them, so a proposal cut
short by the adaptive rule, or not drafted at all, is judged too: `right` = how many of its first tokens the
committed tokens confirm, `complete` = no committed token contradicted it. The next proposal from the same pattern
that continues it the same way is

    cut to `right` tokens      when the last one went wrong after them (it proposes the token the target did not
                               take there again: the text parts from the pattern's continuation at the same
                               place, as an edit renaming a variable does at each use);
    extended                   when the last one was right as far as it was checked: the drafter's length cap
                               (the suffix drafter's factor of the match length) does not apply.

A proposal that continues the pattern otherwise (the drafter found another continuation since) is neither.
Kept per request (reset with the drafter), so its size is bounded by the request's rounds.
"""

from __future__ import annotations

from paraspec.request_state import common_prefix

KEY_TOKENS = 4  # context tokens that name a pattern


class PatternMemory:
    def __init__(self):
        self.last: dict[tuple, tuple[list[int], int, bool]] = {}  # pattern -> (proposal, right, complete)
        self._pending: tuple[tuple, list[int], int] | None = None  # (pattern, proposal, prefix length)

    def reset(self) -> None:
        self.last.clear()
        self._pending = None

    def consult(self, sequence: list[int], matched: int, proposal: list[int]) -> tuple[int | None, bool]:
        """(cap, extend) for `proposal`, found after a `matched`-token match at the end of `sequence` (`limit`);
        the proposal is remembered, to be judged by the next round's committed tokens."""
        pattern = self.pattern(sequence, matched)
        verdict = self.limit(pattern, proposal)
        self.remember(pattern, proposal, len(sequence))
        return verdict

    @staticmethod
    def pattern(sequence: list[int], matched: int) -> tuple | None:
        """The pattern a proposal after a `matched`-token match continues (None without a match)."""
        n = min(matched, KEY_TOKENS)
        return tuple(sequence[len(sequence) - n :]) if n > 0 else None

    def limit(self, pattern: tuple | None, proposal: list[int]) -> tuple[int | None, bool]:
        """(cap, extend) for `proposal` from `pattern`: cap = the tokens right last time, if the last proposal
        went wrong after them and this one proposes the same tokens up to there (else None); extend = the last
        one was right as far as it was checked and this one agrees with what was confirmed."""
        if pattern is None or pattern not in self.last:
            return None, False
        old, right, complete = self.last[pattern]
        if complete:
            return None, proposal[:right] == old[:right]
        return (right, False) if proposal[: right + 1] == old[: right + 1] else (None, False)

    def remember(self, pattern: tuple | None, proposal: list[int], prefix_len: int) -> None:
        """The proposal as the drafter found it (before any cut), continuing a sequence of prefix_len tokens."""
        self._pending = (pattern, list(proposal), prefix_len) if pattern is not None and proposal else None

    def committed(self, prefix_len: int, tokens: list[int]) -> None:
        """The round after the last proposal committed `tokens` after the first prefix_len tokens of the sequence."""
        if self._pending is None or self._pending[2] != prefix_len or not tokens:
            return
        pattern, proposal, _ = self._pending
        self._pending = None
        right = common_prefix(proposal, tokens)
        self.last[pattern] = (proposal, right, right == min(len(tokens), len(proposal)))
