"""Many requests at once: each request runs its strategy's own decode loop, unchanged, in its caller's thread; the
forwards they ask of one model meet here and go through that model in ONE forward per step.

    a request joins (a sequence of each model's multi-sequence context is its own: its KV cache, its rollback)
    each step:
        every request that is computing (not waiting on its reader) asks for its next forward, then waits
        when all of them have asked, the last to ask runs the step for everyone:
            per model, the asks that may share a forward (a few tokens on a sequence that has its prompt) go
            in one forward (one llama_decode; one pass of the native decoder); the others (a prompt, a forward
            wider or narrower than the probe admits) run alone
        each request takes its rows and goes on with its own acceptance, sampling and commit
    a request leaves when it ends (done, cancelled, failed): its sequences are free for the next one

Why every answer is bit-identical to the same request run alone: a request's loop, its generator and its
drafters are its own, and a row's logits do not depend on which rows share its forward -- where the load-time
probe found so for these kernels on this CPU (LlamaCppModel.batch_exact, NativeSequences.batch_exact and
min_shared_width, measured with forwards of the widths this scheduler builds). Where it did not, every ask runs
alone: requests still interleave, one forward each. A draft on llama.cpp's fastest kernels (not batch-invariant)
shares its forwards too, except a seeded sampled request's (Member.repeatable): a greedy answer is the target's
whatever the draft proposed, and only a seeded one promises to repeat.
A request waiting on its reader (a stream not being read) does not hold the others up: it is idle until its
reader asks for more.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(eq=False)
class _Ask:
    model: Any  # a LlamaCppModel or NativeSequences with several sequences
    sequence_id: int
    tokens: list[int]
    outputs: int  # rows wanted: the last `outputs` tokens'
    alone: bool  # a prompt, or wider than a shared forward allows
    prefill: bool = False
    result: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False


@dataclass(eq=False)
class Member:
    """One request in the batch: whether it is computing (its forwards are awaited) and what it asks now."""

    computing: bool = True
    # its answer must repeat as alone (a seeded sampled request): on a model whose rows depend on which rows share
    # their forward (a draft on llama.cpp's fastest kernels) its forwards run alone; a greedy answer is the target's
    # whatever the draft proposed, and an unseeded one promises no repeat, so theirs are shared
    repeatable: bool = False
    ask: _Ask | None = None
    rows: dict = field(default_factory=dict)  # per model (id): tokens of its last shareable ask


@dataclass
class BatchStats:
    steps: int = 0  # forwards shared by several requests' asks, and forwards run alone
    shared_rows: int = 0  # rows of the shared forwards
    last_rows: int = 0  # rows of the last step's forwards (/metrics: batch rows per step)
    widths: dict = field(default_factory=dict)  # requests per shared forward -> count
    moves: int = 0  # requests moved to a lower sequence when another left (Batcher.move)


class Batcher:
    """The step-driven scheduler of one Engine's requests over its multi-sequence models."""

    def __init__(self):
        self._cv = threading.Condition()
        self._members: list[Member] = []
        self._stepping = False
        self._lock = threading.Lock()  # one llama.cpp call at a time (a step, a rollback)
        self.stats = BatchStats()

    # -- membership ----------------------------------------------------------------------------------------------
    def join(self, repeatable: bool = False) -> Member:
        member = Member(repeatable=repeatable)
        with self._cv:
            self._members.append(member)
        return member

    def leave(self, member: Member) -> None:
        with self._cv:
            if member in self._members:
                self._members.remove(member)
            self._cv.notify_all()  # the others may all have asked already

    @contextmanager
    def idle(self, member: Member):
        """While a request waits on its reader, the others' steps do not wait for its ask."""
        with self._cv:
            member.computing = False
            self._cv.notify_all()
        try:
            yield
        finally:
            with self._cv:
                member.computing = True

    def move(self, sources: list[BatchedSequence], targets: list[BatchedSequence]) -> None:
        """Between steps: the request decoding on `sources` (a sequence of each model) goes on on the sequences of
        `targets` (free: their request has left), its caches moved there (LlamaCppModel.move_sequence) and an ask
        it has posted rewritten; the two sets of proxies swap sequence numbers. Keeps the running sequences
        0, 1, 2, ...: llama.cpp decodes sequences in one micro-batch only while their ids follow each other."""
        with self._between_steps():
            for src, dst in zip(sources, targets):
                src.model.move_sequence(src.sequence_id, dst.sequence_id)
                if src.member is not None and src.member.ask is not None and src.member.ask.model is src.model:
                    src.member.ask.sequence_id = dst.sequence_id
                src.sequence_id, dst.sequence_id = dst.sequence_id, src.sequence_id
            self.stats.moves += 1

    # -- forwards --------------------------------------------------------------------------------------------
    @contextmanager
    def _between_steps(self):
        """Hold the scheduler between steps: no step runs (none starts), no llama.cpp call is in flight."""
        with self._cv:
            while self._stepping:
                self._cv.wait()
            with self._lock:
                yield

    def length(self, proxy: BatchedSequence) -> int:
        with self._cv:  # not while its sequence moves (move())
            return proxy.model._lengths[proxy.sequence_id]

    def rollback(self, proxy: BatchedSequence, length: int) -> None:
        with self._between_steps():
            proxy.model.rollback(length, proxy.sequence_id)

    def forward(self, proxy: BatchedSequence, tokens: list[int], outputs: int, prefill: bool = False) -> torch.Tensor:
        """The rows a forward of `tokens` on the proxy's sequence gives (the last `outputs`), run in this step."""
        member, model = proxy.member, proxy.model
        assert member is not None  # the Engine sets it before the request decodes
        with self._cv:
            sequence_id = proxy.sequence_id
            if not prefill:  # this request's own errors, raised here, not in the step
                model._check_room(len(tokens), sequence_id)
                model._check_vocabulary(tokens)
            exact_rows = model.batch_exact or (not model.exact and not member.repeatable)
            shareable = (
                not prefill
                and exact_rows
                and model._lengths[sequence_id] > 0
                and model.min_shared_width <= len(tokens) <= model.exact_width
            )
            ask = _Ask(model, sequence_id, list(tokens), outputs, alone=not shareable, prefill=prefill)
            member.rows[id(model)] = len(tokens) if shareable else 0
            member.ask = ask
            self._cv.notify_all()
            while not ask.done:
                if not self._stepping and self._all_asked():
                    self._stepping = True
                    asks = [m.ask for m in self._members if m.ask is not None]
                    for m in self._members:
                        m.ask = None
                    self._cv.release()
                    try:
                        self._step(asks)
                    finally:
                        self._cv.acquire()
                        self._stepping = False
                        self._cv.notify_all()
                else:
                    self._cv.wait()
        member.ask = None
        if ask.error is not None:
            raise ask.error
        assert ask.result is not None  # a step sets one of error and result
        return ask.result

    def shared_load(self, proxy: BatchedSequence) -> list[int]:
        """The rows each other computing request brings to a step of the proxy's model (the tokens of its last
        shareable ask on it): what the adaptive rule prices a busy step by (drafters/adaptive.best_length)."""
        with self._cv:
            rows = [m.rows.get(id(proxy.model), 0) for m in self._members if m is not proxy.member and m.computing]
            return [r for r in rows if r]

    def _all_asked(self) -> bool:
        return all(m.ask is not None or not m.computing for m in self._members)

    def _step(self, asks: list[_Ask]) -> None:
        """Run every ask of this step: the shareable ones of each model in as few forwards as their widths allow,
        the rest alone. An error fails the asks of the forward that raised it (each one's request raises it)."""
        with self._lock:
            rows = 0
            for model in {id(a.model): a.model for a in asks}.values():
                shared = [a for a in asks if a.model is model and not a.alone]
                for group in _groups(shared, model.exact_width, model.n_batch):
                    self._run(
                        group,
                        lambda g=group, m=model: m.forward_batch([(a.sequence_id, a.tokens, a.outputs) for a in g]),
                    )
                    rows += sum(len(a.tokens) for a in group)
                    self.stats.shared_rows += sum(len(a.tokens) for a in group)
                    self.stats.widths[len(group)] = self.stats.widths.get(len(group), 0) + 1
                    self.stats.steps += 1
            for a in asks:
                if a.alone:
                    run = (
                        (lambda a=a: [a.model.prefill(a.tokens, a.sequence_id)[None]])
                        if a.prefill
                        else (lambda a=a: [a.model.forward(a.tokens, last_n=a.outputs, sequence_id=a.sequence_id)])
                    )
                    self._run([a], run)
                    rows += len(a.tokens)
                    self.stats.steps += 1
            self.stats.last_rows = rows

    @staticmethod
    def _run(group: list[_Ask], forward) -> None:
        try:
            for a, result in zip(group, forward()):
                a.result = result
        except BaseException as e:  # noqa: BLE001 -- handed to each asking request, raised there
            for a in group:
                a.error = e
        for a in group:
            a.done = True


def _groups(asks: list[_Ask], width: int, n_batch: int) -> list[list[_Ask]]:
    """Asks packed in order into forwards of at most `width` rows (the probed exact width) and n_batch tokens."""
    groups: list[list[_Ask]] = []
    rows = 0
    for a in asks:
        if not groups or rows + len(a.tokens) > min(width, n_batch):
            groups.append([])
            rows = 0
        groups[-1].append(a)
        rows += len(a.tokens)
    return groups


class BatchedSequence:
    """The Model protocol on one sequence of a multi-sequence llama.cpp context, its forwards run by the Batcher
    in the step of every running request. What a strategy's decode loop holds as its target (or draft model)."""

    def __init__(self, batcher: Batcher, model, sequence_id: int, member: Member | None = None):
        self.batcher, self.model, self.sequence_id = batcher, model, sequence_id
        self.member = member  # the request decoding on it now (the Engine sets it per request)
        self.vocab_size, self.max_context, self.eos_token_ids = model.vocab_size, model.max_context, model.eos_token_ids

    @property
    def length(self) -> int:
        return self.batcher.length(self)

    def rollback(self, length: int) -> None:
        self.batcher.rollback(self, length)

    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        return self.batcher.forward(self, token_ids, 1, prefill=True)[0]

    def forward(self, token_ids: list[int], positions=None, tree_mask=None, last_n: int | None = None) -> torch.Tensor:
        if tree_mask is not None or positions is not None:
            return self.model.forward(
                token_ids, positions, tree_mask, last_n, sequence_id=self.sequence_id
            )  # its own error
        if not token_ids:
            raise ValueError("forward needs at least one token")
        outputs = len(token_ids) if last_n is None else min(last_n, len(token_ids))
        return self.batcher.forward(self, token_ids, outputs)

    def shared_load(self) -> list[int]:
        return self.batcher.shared_load(self)

    def keep_path(self, prefix_len: int, slots: list[int]) -> None:
        with self.batcher._between_steps():
            self.model.keep_path(prefix_len, slots, sequence_id=self.sequence_id)
