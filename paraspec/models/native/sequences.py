"""The native decoder with several sequences: one KV cache per request, their rows in one forward.

`NativeSequences(decoder, max_context, n_seqs=N)` is a NativeModel whose methods take `sequence_id` (which request's
cache) and which adds what the Scheduler (scheduler.py) drives: `forward_batch([(sequence_id, tokens, outputs)])` runs
the rows of several sequences through every row-wise part of the model at once -- embeddings, norms, the q/k/v, o and
MLP products, the LM head -- and attention per sequence over its own cache, exactly as that sequence's forward
alone computes it. So a row's logits equal its logits alone wherever the products of this CPU (or GPU) give a row
the same bits whatever the number of rows beside it; the load-time probe (`measure_batch_exact`) checks that for
this model on this machine, and where it does not hold the requests take turns (one forward each), as on
llama.cpp (models/llamacpp/model.py).

Dynamic shapes only: the padded forward (models/native/padded.py) captures one cache in its CUDA graph, so an
Engine padding forwards runs one request at a time.
"""

from __future__ import annotations

import sys
from collections.abc import Generator
from typing import cast

import torch

from paraspec.models.base import SequenceChecks, check_batch, measure_batch_exact
from paraspec.models.native.decoder import DecoderLayer, KVCache, NativeModel

PROBE_WIDTH = 8  # the widest forward of one sequence that may share a step (the probe covers it)
PROBE_PROMPTS = (9, 5, 17, 12, 3, 14, 7, 11)  # the probe's context lengths, one per sequence (cycled)


class NativeSequences(SequenceChecks, NativeModel):
    exact = True  # one configuration for targets and drafts (llama.cpp's drafts run others: LlamaCppModel.exact)
    splits_prompts = False  # a forward into an empty cache is one forward (models.base.Sequences)

    def __init__(self, decoder, max_context: int, eos_token_ids: tuple[int, ...] = (), n_seqs: int = 2):
        if n_seqs < 2:
            raise ValueError(f"n_seqs={n_seqs}: NativeSequences holds two or more sequences; use NativeModel")
        super().__init__(decoder, max_context, eos_token_ids, padded_width=None)
        self.n_seqs = n_seqs
        self.caches = [self.cache] + [
            KVCache(self.cfg, max_context, self.dtype, self.device) for _ in range(n_seqs - 1)
        ]
        self.n_batch = min(512, max_context)
        self.exact_width = min(PROBE_WIDTH, max_context)
        self.batch_probe = measure_batch_exact(self, self.exact_width, PROBE_PROMPTS)
        exact = {
            kind: all(r["max_abs_diff"] == 0.0 for r in self.batch_probe if r["kind"] == kind)
            for kind in ("decode", "verify")
        }
        # a CPU's one-row product is often another kernel (a GEMV) than its product of several rows: then one-token
        # steps stay alone and verifications (2..exact_width tokens) share, each as exact as alone
        self.batch_exact = exact["decode"] or exact["verify"]
        self.min_shared_width = 1 if exact["decode"] else 2
        if not exact["verify"]:
            self.exact_width = 1
        if not (exact["decode"] and exact["verify"]):
            what = {
                (False, True): "one-token steps run alone, verifications of several sequences share forwards",
                (True, False): "verifications run alone, one-token steps of several sequences share forwards",
                (False, False): "every forward runs alone",
            }[exact["decode"], exact["verify"]]
            print(
                f"paraspec: on {self.device} ({self.dtype}) some rows of the native decoder differ when other "
                f"sequences' rows share their forward (the load-time probe): {what}",
                file=sys.stderr,
                flush=True,
            )

    # -- one sequence at a time: the NativeModel methods on that sequence's cache ------------------------------
    @property
    def _lengths(self) -> list[int]:
        return [c.length for c in self.caches]

    def _use(self, sequence_id: int) -> None:
        if not 0 <= sequence_id < self.n_seqs:
            raise ValueError(f"sequence {sequence_id} of {self.n_seqs}")
        self.cache = self.caches[sequence_id]

    def rollback(self, length: int, sequence_id: int = 0) -> None:
        self._use(sequence_id)
        super().rollback(length)

    def prefill(self, token_ids: list[int], sequence_id: int = 0) -> torch.Tensor:
        self.rollback(0, sequence_id)
        return self.forward(token_ids, last_n=1, sequence_id=sequence_id)[-1]

    def prompt_steps(self, token_ids: list[int], sequence_id: int = 0) -> Generator[None, None, torch.Tensor]:
        """The prompt in one step: one forward, as a request alone (NativeModel's prefill) decodes it; the logits
        [1, vocab] of its last token."""
        return self.prefill(token_ids, sequence_id)[None]
        yield  # a generator of one step

    def forward(
        self,
        token_ids: list[int],
        positions: list[int] | None = None,
        tree_mask: torch.Tensor | None = None,
        last_n: int | None = None,
        sequence_id: int = 0,
    ) -> torch.Tensor:
        self._use(sequence_id)  # the Scheduler checked room and vocabulary when the forward was asked
        return super().forward(token_ids, positions, tree_mask, last_n)

    def keep_path(self, prefix_len: int, slots: list[int], sequence_id: int = 0) -> None:
        self._use(sequence_id)
        super().keep_path(prefix_len, slots)

    def move_sequence(self, src: int, dst: int) -> None:
        """Sequence `src`'s cache becomes sequence `dst`'s and `src` is empty (the cache tensors trade places: the
        same bytes, so its next rows are what they would have been)."""
        if not (0 <= src < self.n_seqs and 0 <= dst < self.n_seqs) or src == dst:
            raise ValueError(f"move_sequence({src}, {dst}): two different sequences of {self.n_seqs}")
        self.caches[src], self.caches[dst] = self.caches[dst], self.caches[src]
        self.caches[src].length = 0
        self.cache = self.caches[0]

    # -- several sequences in one forward -----------------------------------------------------------------------
    @staticmethod
    def step_forwards(widths: list[int]) -> list[int]:
        """A forward_batch is one pass of all its rows."""
        return [sum(widths)] if widths else []

    @torch.inference_mode()
    def forward_batch(self, items: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
        """Items (sequence_id, token_ids, outputs), each sequence at most once with 1..exact_width tokens after its
        prompt: one pass of all their rows; returns each item's logits [outputs, vocab] of its last `outputs`
        tokens, in the items' order."""
        check_batch(self, items)
        sequence_ids = [sequence_id for sequence_id, _, _ in items]
        caches = [self.caches[sequence_id] for sequence_id in sequence_ids]
        starts = [c.length for c in caches]
        spans, at = [], 0
        for _, tokens, _ in items:
            spans.append(slice(at, at + len(tokens)))
            at += len(tokens)
        positions = torch.cat([torch.arange(s, s + len(t), device=self.device) for s, (_, t, _) in zip(starts, items)])
        masks = [self.attention_mask(positions[span], start, None) for span, start in zip(spans, starts)]
        cos, sin = self.rope(positions)
        h = self.embed([t for _, tokens, _ in items for t in tokens])
        for i, module in enumerate(self.decoder.model.layers):
            layer = cast(DecoderLayer, module)  # nn.ModuleList yields Modules
            attn = layer.self_attn
            q, k, v = attn.project(layer.input_layernorm(h), cos, sin)
            rows = [
                attn.attend(q[:, span], k[:, span], v[:, span], cache, i, start, mask)
                for span, cache, start, mask in zip(spans, caches, starts, masks)
            ]
            h = h + attn.o_proj(torch.cat(rows))
            h = h + layer.mlp_block(h)
        for cache, start, (_, tokens, _) in zip(caches, starts, items):
            cache.length = start + len(tokens)
        keep = torch.cat(
            [
                torch.arange(span.stop - outputs, span.stop, device=self.device)
                for span, (_, _, outputs) in zip(spans, items)
            ]
        )
        logits = self.logits(h[keep])
        out, at = [], 0
        for _, _, outputs in items:
            out.append(logits[at : at + outputs])
            at += outputs
        return out
