"""Streamed text that never takes anything back: IncrementalText decodes a growing list of tokens a short window at
a time (linear in the output, not quadratic), TextDeltas turns the growing text into deltas that always add up to
the final text."""

from __future__ import annotations


class TextDeltas:
    """Deltas of a growing text. Held back until later tokens settle them: text that a stop string may still
    claim (the stop strings' longest proper prefix: it is cut from the output if the stop string completes) and an
    incomplete UTF-8 sequence (decoded as U+FFFD until its last byte arrives)."""

    def __init__(self, stop: tuple[str, ...] = ()):
        self.hold = max(map(len, stop)) - 1 if stop else 0
        self.sent = ""  # what was handed out: every delta so far, joined

    def update(self, text: str, final: bool = False) -> str:
        """The new delta ("" if none yet) given the whole text so far; `final`: the run is done, hold nothing back."""
        if not final:
            text = text[: max(len(text) - self.hold, 0)]
            if text.endswith("\ufffd"):
                return ""
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        return delta


class IncrementalText:
    """The text of a growing token list, decoding only the tokens since the last settled piece plus the piece
    before them (the window keeps a sentencepiece word's leading space and a multi-byte character whole), as
    vLLM's and TGI's detokenizers do. Streaming n tokens decodes O(n) tokens in all, where decoding the whole
    list at every commit is O(n^2). `decoded` counts the tokens handed to the tokenizer (tests read it)."""

    INITIAL_CONTEXT = 5  # after a full decode: tokens before the end kept as the next window's context

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.text = ""  # always the decode of tokens[:read]
        self.prefix = 0  # the window's context starts here ...
        self.read = 0  # ... and what is new starts here
        self.decoded = 0

    def _decode(self, tokens: list[int]) -> str:
        self.decoded += len(tokens)
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def of(self, tokens: list[int]) -> str:
        """The decode of `tokens` (which extend the last call's) as decoding them whole gives it -- or, while the
        last character's bytes have not all arrived, a prefix of it that stops before the window holding them (a
        stream holds a half character back anyway).

        The window's text is appended only where that is provably the same: the window decodes to valid text (no
        U+FFFD: it starts and ends on character boundaries) that extends the decode of its context (no cleanup or
        merge across the boundary changed it). A window that ends in a half character waits for the rest;
        invalid bytes inside it, or a tokenizer that rewrites across the boundary, decode the whole list once
        more, as streams always did."""
        if self.tokenizer is None:
            return ""
        if len(tokens) < self.read:  # not an extension (never in a stream): start again
            return self._whole(tokens)
        if len(tokens) > self.read:
            before = self._decode(tokens[self.prefix : self.read])
            after = self._decode(tokens[self.prefix :])
            if "\ufffd" in after.rstrip("\ufffd") or "\ufffd" in before or not after.startswith(before):
                return self._whole(tokens)
            if not after.endswith("\ufffd"):
                self.text += after[len(before) :]
                self.prefix, self.read = self.read, len(tokens)
        return self.text

    def _whole(self, tokens: list[int]) -> str:
        self.text = self._decode(tokens)
        self.prefix, self.read = max(len(tokens) - self.INITIAL_CONTEXT, 0), len(tokens)
        return self.text
