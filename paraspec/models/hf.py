"""Hugging Face fallback: any AutoModelForCausalLM behind the Model protocol, with a DynamicCache.

Slower than the native decoder and without tree attention, but it runs architectures we do not implement,
so `ar` and `sd` work for every causal LM transformers can load.
"""

from __future__ import annotations

from pathlib import Path

import torch

from paraspec.models.base import check_rollback


class HFModel:
    splits_prompts = False  # prompt and tokens after it: one forward (models.base.Model)

    def __init__(self, model, max_context: int, eos_token_ids: tuple[int, ...]):
        from transformers import DynamicCache

        self.model = model
        self.max_context = max_context
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.eos_token_ids = eos_token_ids
        self.device = next(model.parameters()).device
        self._new_cache = lambda: DynamicCache(config=model.config)
        self.cache = self._new_cache()

    @classmethod
    def load(cls, folder: Path, dtype: torch.dtype, max_context: int | None = None, device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        from paraspec.models.base import eos_ids, generation_eos_ids

        # transformers annotates PreTrainedModel.to's wrapper as taking the model, not a device
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()  # type: ignore[arg-type]
        cfg = model.config
        limit = getattr(cfg, "max_position_embeddings", None) or 4096
        return cls(model, min(max_context or 4096, limit), generation_eos_ids(folder, eos_ids(cfg.eos_token_id)))

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def rollback(self, length: int) -> None:
        check_rollback(length, self.length)
        if length == 0:
            self.cache = self._new_cache()
        elif length < self.length:
            self.cache.crop(length - self.length)  # a negative count removes that many (transformers 4 and 5)

    def keep_path(self, prefix_len: int, slots: list[int]) -> None:
        from paraspec.models.base import keep_chain

        keep_chain(self, prefix_len, slots)

    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        self.cache = self._new_cache()
        return self.forward(token_ids, last_n=1)[-1]

    @torch.inference_mode()
    def forward(
        self,
        token_ids: list[int],
        positions: list[int] | None = None,
        tree_mask: torch.Tensor | None = None,
        last_n: int | None = None,
    ) -> torch.Tensor:
        if tree_mask is not None:
            raise ValueError("tree attention needs the native backend; use backend='native' (--backend native)")
        start, n = self.length, len(token_ids)
        if start + n > self.max_context:
            raise ValueError(
                f"context full: {start} cached + {n} new tokens exceed max_context "
                f"{self.max_context}; create the engine with a larger max_context"
            )
        default = list(range(start, start + n))
        if positions is not None and list(positions) != default:
            raise ValueError("the hf backend only supports consecutive positions; use backend='native'")
        ids = torch.tensor([token_ids], device=self.device)
        out = self.model(
            input_ids=ids,
            past_key_values=self.cache,
            use_cache=True,
            cache_position=torch.arange(start, start + n, device=self.device),
            logits_to_keep=last_n or 0,
        )
        self.cache = out.past_key_values
        return out.logits[0].float()
