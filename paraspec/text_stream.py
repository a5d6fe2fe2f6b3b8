"""Streamed text that never takes anything back: TextDeltas turns the growing text of a run into deltas that always
add up to the final text."""
from __future__ import annotations


class TextDeltas:
    """Deltas of a growing text. Held back until later tokens settle them: text that a stop string may still
    claim (the stop strings' longest proper prefix: it is cut from the output if the stop string completes) and an
    incomplete UTF-8 sequence (decoded as U+FFFD until its last byte arrives)."""

    def __init__(self, stop: tuple[str, ...] = ()):
        self.hold = max(map(len, stop)) - 1 if stop else 0
        self.sent = ""                    # what was handed out: every delta so far, joined

    def update(self, text: str, final: bool = False) -> str:
        """The new delta ("" if none yet) given the whole text so far; `final`: the run is done, hold nothing back."""
        if not final:
            text = text[:max(len(text) - self.hold, 0)]
            if text.endswith("\ufffd"):
                return ""
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta
