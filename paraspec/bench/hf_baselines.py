"""The peer baselines: transformers' own `model.generate` (hf-ar), assisted generation (hf-assisted) and prompt
lookup decoding (hf-prompt-lookup, transformers' model-free drafter).

They run in this process on the very tensors paraspec's models hold (same weights, same dtype), with the same
prompt ids, thread count, token budget and EOS ids, and they return a `GenerationResult` like the Engine's:
- TTFT and the token-progress curve come from a streamer (transformers hands it the new tokens of each step);
- the trace's draft/verify events come from forward hooks on the two models;
- for hf-assisted, a round is the draft forwards (one candidate each) before a target forward; the tokens the
  streamer receives after it are the accepted candidates plus one target token (fewer where EOS or the
  budget cut the round);
- for hf-prompt-lookup, every target forward is a round: its width less the tokens already in the cache (the
  prompt in the first forward, the last token after) is the number of candidates copied from the context.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from paraspec.engine import GenerationResult
from paraspec.request_state import RequestState
from paraspec.runtime.devices import sync
from paraspec.sampling import SamplingParams, make_generator
from paraspec.stats import compute_stats
from paraspec.trace import Trace

HF_STRATEGIES = {
    "hf-ar": "transformers model.generate (autoregressive), same weights/dtype/threads",
    "hf-assisted": "transformers assisted generation (generate(assistant_model=draft)), same weights/dtype/threads",
    "hf-prompt-lookup": "transformers prompt lookup decoding (generate(prompt_lookup_num_tokens=N)), no draft model",
}
PROMPT_LOOKUP_TOKENS = 10  # candidates per round: the value of transformers' documentation (it has no default)


def hf_causal_lm(model, folder):
    """A transformers CausalLM sharing `model`'s weight tensors (no copy), with a neutral generation config.

    `model` is a paraspec Model: the native decoder keeps the Hugging Face parameter names, and the hf backend
    wraps a transformers module. Sharing keeps the memory of a benchmark at one copy of each model and guarantees
    that the baselines compute with exactly paraspec's weights and dtype.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    source = getattr(model, "decoder", None) or getattr(model, "model", None)
    if not isinstance(source, torch.nn.Module):
        raise ValueError(f"hf-* baselines need an in-process model with torch weights, got {type(model).__name__}")
    weights = source.state_dict()
    dtype = next(iter(weights.values())).dtype
    config = AutoConfig.from_pretrained(str(folder))
    with _no_init_weights():  # parameters are allocated but never written: the shared tensors replace them
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = hf.load_state_dict(weights, strict=False, assign=True)
    tied = getattr(hf, "_tied_weights_keys", None) or ()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(
            f"{folder}: transformers' {type(hf).__name__} does not match paraspec's weights "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    if "lm_head.weight" not in weights and hasattr(hf, "tie_weights"):
        hf.tie_weights()
    # generation_config.json may carry sampling defaults (repetition_penalty, top_k...): start from none
    eos = list(model.eos_token_ids)
    hf.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos[0] if eos else None)
    return hf.eval().requires_grad_(False)


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights  # transformers 5
    except ImportError:  # pragma: no cover - transformers 4
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


class _Progress:
    """A transformers streamer: the first put is the prompt, every later one the tokens a step committed."""

    def __init__(self, trace: Trace):
        self.trace, self.tokens, self._prompt_seen = trace, 0, False
        self.first_token_s: float | None = None

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        now = self.trace.now()
        self.tokens += int(value.numel())
        if self.first_token_s is None:
            self.first_token_s = now
        self.trace.commit(self.tokens, now)

    def end(self) -> None:
        pass


class _ForwardTimer:
    """Forward hooks that add one trace event per model call: (device, kind of the first call, kind after).
    Each hook waits for the model's device first, so a GPU forward is timed whole."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self.calls: dict[str, int] = {}  # forwards by device
        self._handles: list = []  # the hooks, removed by close()
        self._start: dict[str, float] = {}  # by device: when its forward in flight started
        self.seconds: dict[str, float] = {}  # by kind of call: prefill, decode, draft, verify

    def watch(self, module, device: str, first_kind: str, kind: str) -> None:
        def before(mod, args, kwargs):
            sync(mod.device)
            self._start[device] = self.trace.now()

        def after(mod, args, kwargs, output):
            sync(mod.device)
            end = self.trace.now()
            start = self._start.pop(device, end)
            ids = kwargs.get("input_ids", args[0] if args else None)
            width = int(ids.shape[-1]) if ids is not None else 0
            n = self.calls.get(device, 0)
            event_kind = first_kind if n == 0 else kind
            self.trace.add(device, event_kind, start, end, width)
            self.calls[device] = n + 1
            self.seconds[event_kind] = self.seconds.get(event_kind, 0.0) + end - start

        self._handles += [
            module.register_forward_pre_hook(before, with_kwargs=True),
            module.register_forward_hook(after, with_kwargs=True),
        ]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _lookups_per_round(trace: Trace, prompt_tokens: int) -> list[int]:
    """Candidates of each target forward of prompt lookup: the first forward takes the prompt with them, every
    later one the last committed token with them."""
    widths = [e.tokens for e in sorted(trace.events, key=lambda e: e.start_s) if e.device == "target"]
    return [w - (prompt_tokens if i == 0 else 1) for i, w in enumerate(widths)]


def _drafts_per_round(trace: Trace) -> list[int]:
    """Draft forwards before each target forward: one candidate each (transformers' assistant loop)."""
    rounds, pending = [], 0
    for event in sorted(trace.events, key=lambda e: e.start_s):
        if event.device == "draft":
            pending += 1
        else:
            rounds.append(pending)
            pending = 0
    return rounds


class HFBaseline:
    """One of HF_STRATEGIES over shared-weight transformers models; `generate` mirrors Engine.generate."""

    def __init__(
        self,
        name: str,
        target_hf,
        draft_hf=None,
        max_context: int = 4096,
        num_assistant_tokens: int | None = None,
        confidence_threshold: float | None = None,
        prompt_lookup_tokens: int = PROMPT_LOOKUP_TOKENS,
        prompt_lookup_ngram: int | None = None,
    ):
        if name not in HF_STRATEGIES:
            raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(HF_STRATEGIES)}")
        if name == "hf-assisted" and draft_hf is None:
            raise ValueError("hf-assisted needs a draft model (--draft)")
        self.name, self.target, self.max_context = name, target_hf, max_context
        self.draft = draft_hf if name == "hf-assisted" else None
        if name == "hf-prompt-lookup" and (prompt_lookup_tokens < 1 or (prompt_lookup_ngram or 1) < 1):
            raise ValueError(
                f"hf-prompt-lookup needs >= 1 candidate tokens and an n-gram size >= 1, got "
                f"{prompt_lookup_tokens} and {prompt_lookup_ngram}"
            )
        # transformers' max_matching_ngram_size: None is its own default (2)
        self.lookup = (
            {"prompt_lookup_num_tokens": prompt_lookup_tokens, "max_matching_ngram_size": prompt_lookup_ngram}
            if name == "hf-prompt-lookup"
            else {}
        )
        self.eos_ids = list(target_hf.generation_config.eos_token_id or [])
        if self.draft is not None:
            # transformers reads the assistant's settings from the assistant's generation config
            if num_assistant_tokens is not None:
                self.draft.generation_config.num_assistant_tokens = num_assistant_tokens
            if confidence_threshold is not None:
                self.draft.generation_config.assistant_confidence_threshold = confidence_threshold

    @property
    def dtype(self) -> torch.dtype:
        return next(self.target.parameters()).dtype

    def settings(self) -> dict:
        """What the baseline ran with (written to results.json)."""
        out: dict[str, Any] = {"dtype": str(self.dtype).removeprefix("torch."), "eos_token_ids": self.eos_ids}
        if self.draft is not None:
            from transformers import GenerationConfig

            defaults = (
                GenerationConfig._get_default_generation_params()
                if hasattr(GenerationConfig, "_get_default_generation_params")
                else {}
            )
            for key in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold"):
                value = getattr(self.draft.generation_config, key, None)
                out[key] = defaults.get(key) if value is None else value
        if self.lookup:
            out.update(
                prompt_lookup_num_tokens=self.lookup["prompt_lookup_num_tokens"],
                max_matching_ngram_size=self.lookup["max_matching_ngram_size"] or 2,
            )
        return out

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], params: SamplingParams, record_margins: bool = False) -> GenerationResult:
        from transformers import GenerationConfig

        stop = set(self.eos_ids) | set(params.stop_token_ids or ())
        sampling = {} if params.greedy else dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=0,
            do_sample=not params.greedy,
            eos_token_id=sorted(stop),
            pad_token_id=self.target.generation_config.pad_token_id,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            num_beams=1,
            return_dict_in_generate=True,
            output_scores=record_margins,
            **sampling,
            **{k: v for k, v in self.lookup.items() if v is not None},
        )
        if not params.greedy and params.seed is not None:
            torch.manual_seed(params.seed)
        ids = torch.tensor([prompt_ids]).to(self.target.device)
        trace = Trace()
        progress, timer = _Progress(trace), _ForwardTimer(trace)
        # the target's first call takes the prompt (with the first candidates, when speculating): its prefill
        timer.watch(self.target, "target", "prefill", "decode" if self.draft is None and not self.lookup else "verify")
        if self.draft is not None:
            timer.watch(self.draft, "draft", "draft", "draft")
        extra = {"assistant_model": self.draft} if self.draft is not None else {}
        try:
            sync(self.target.device)
            start = time.perf_counter()
            trace.t0 = start
            out = self.target.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config, streamer=progress, **extra
            )
            sync(self.target.device)
            total = time.perf_counter() - start
        finally:
            timer.remove()
        tokens = out.sequences[0, len(prompt_ids) :].tolist()
        return self._result(
            prompt_ids, tokens, params, stop, trace, progress, timer, total, out.scores if record_margins else None
        )

    def _result(self, prompt_ids, tokens, params, stop, trace, progress, timer, total, scores):
        # A RequestState filled with what transformers did, so that the stats use the Engine's arithmetic.
        run = RequestState(
            prompt_ids=list(prompt_ids),
            params=params,
            stop_ids=frozenset(stop),
            generator=make_generator(0),
            max_context=self.max_context,
            trace=trace,
        )
        run.tokens = tokens
        run.first_token_s = progress.first_token_s
        run.finish_reason = "stop" if tokens and tokens[-1] in stop else "length"
        if self.draft is not None or self.lookup:
            drafts = _drafts_per_round(trace) if self.draft is not None else _lookups_per_round(trace, len(prompt_ids))
            gains = [b[1] - a[1] for a, b in zip([(0.0, 0)] + trace.progress, trace.progress)]
            accepted = [min(k, gain - 1) for k, gain in zip(drafts, gains)]
            run.rounds, run.drafted, run.accepted = len(drafts), sum(drafts), sum(accepted)
            run.verified_tokens = len(tokens)
            run.rollbacks = sum(a < k for a, k in zip(accepted, drafts))
            run.draft_s = timer.seconds.get("draft", 0.0)
            run.verify_s = timer.seconds.get("verify", 0.0)  # the prefill is not verification
        margins = None
        if scores is not None:
            margins = {}
            for i, step in enumerate(scores):
                top2 = step.float().topk(2, dim=-1).values
                margins[i] = float(top2[0, 0] - top2[0, 1])
        return GenerationResult(
            text="",
            token_ids=tokens,
            stats=compute_stats(run, self.name, total),
            trace=trace,
            finish_reason=run.finish_reason,
            prompt_ids=list(prompt_ids),
            margins=margins,
        )
