"""A padded forward for the native decoder: every forward runs exactly W token rows.

Why. A GPU library picks its matrix kernel by shape, so on a GPU a token's logits depend on how many tokens its
forward carried: `sd`'s 6-token verification and `ar`'s 1-token step would disagree in the last bits, and a greedy
tie would break differently. Padding every forward to one width W (one shape, one kernel) makes a row's result a
function of that row alone, by construction -- and on a GPU, where a forward of a few tokens is bound by reading
the weights, the padding costs almost nothing (docs/GPU.md measures it). One shape also means one CUDA graph:
the whole forward is captured once and replayed, so a small model is not bound by Python launching ~40 kernels a
layer (gpt-fast and vLLM decode the same way).

How. Preallocated inputs (token ids, RoPE positions, cache slots) and a [W, slots] visibility mask; attention
always runs over the whole cache (one shape), the mask hiding what a row may not see. A forward of n tokens is
cut into ceil(n / W) steps; the rows after the last real one are padding (token 0, its own slot, causal), written
into cache slots past the end, which the next write replaces. The cache has W spare slots for that.

On CPU the same code runs eagerly (no graph): the lossless suite proves it there (tests/models/test_padded.py,
tests/strategies/test_lossless.py). Padding costs more on a compute-bound CPU (docs/GPU.md, "The padded,
graph-captured step"), so the CPU default stays the dynamic forward.
"""

from __future__ import annotations

import contextlib
import json
import threading
import warnings

import torch

from paraspec.models.cache import cache_dir, write_json

WIDTHS = (1, 2, 4, 8, 16, 32)  # the widths "auto" measures
AUTO_TOLERANCE = 1.15  # "auto": the widest W whose forward costs at most this times the cheapest's


def check_width(width) -> int | str | None:
    """`padded_width` as Engine and load_model take it: None (dynamic shapes), an int >= 1, or "auto"."""
    if width is None or width == "auto":
        return width
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(
            f"padded_width must be an integer >= 1, 'auto' (measured on the device) or None "
            f"(dynamic shapes), got {width!r}"
        )
    return width


def choose_width(costs: dict[int, float], tolerance: float = AUTO_TOLERANCE) -> int:
    """The widest W whose measured cost per forward stays within `tolerance` of the cheapest width's: up to there
    padding is free, and a wider W verifies longer drafts in one step."""
    if not costs:
        raise ValueError("choose_width needs at least one measured width")
    floor = min(costs.values())
    return max(w for w, c in costs.items() if c <= tolerance * floor)


_CUDA_SETUP = threading.RLock()


def cuda_setup(device) -> contextlib.AbstractContextManager:
    """Held while a model is put on a CUDA device, measured and captured: two threads of one process (the
    in-process runtime's workers) capturing graphs at once, or one loading weights while another captures, can
    invalidate a capture or abort the process. Nothing on a CPU."""
    return _CUDA_SETUP if torch.device(device).type == "cuda" else contextlib.nullcontext()


class PaddedForward:
    """The fixed-width forward of one NativeModel: its input buffers, the step, and (on CUDA) the step's graph."""

    def __init__(self, model, width: int, graph: bool | None = None, compiled: bool = False):
        self.model, self.width = model, width
        self.compiled = compiled
        device = model.device
        slots = model.cache.k.shape[2]
        self.key_slots = torch.arange(slots, device=device)
        self.host_key_slots = torch.arange(slots)
        self.inputs = torch.zeros(3, width, dtype=torch.long, device=device)  # ids, positions, slots
        self.visible = torch.zeros(width, slots, dtype=torch.bool, device=device)
        self.inputs[1:] = torch.arange(width, device=device)  # until the first forward: a causal chain at
        self._causal_visibility(self.inputs[2], model.cfg.sliding_window)  # slot 0 (no all-masked row: no NaN)
        self.out: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        # compiled: torch.compile fuses the step's small kernels (norms, RoPE, SiLU, residuals, the mask) at one
        # fixed shape, so a row's result still depends on that row alone; captured in the graph below on CUDA
        self._step = torch.compile(self.step, fullgraph=True, dynamic=False) if compiled else self.step
        if graph and device.type != "cuda":
            raise ValueError(
                f"graph=True captures a CUDA graph: the model is on {device}; pass graph=None "
                f"(graphs where the device is CUDA) or False"
            )
        if graph if graph is not None else device.type == "cuda":
            self._capture()

    @property
    def graphed(self) -> bool:
        return self.graph is not None

    # -- the step: what the graph captures ----------------------------------------------------------------------

    def step(self) -> torch.Tensor:
        """One forward of the W rows in `inputs`, under `visible`; returns logits [W, vocab] (float32)."""
        m = self.model
        ids, positions, slots = self.inputs
        cos, sin = m._cos[positions], m._sin[positions]
        bias = torch.zeros(self.visible.shape, dtype=m.dtype, device=m.device).masked_fill_(
            ~self.visible, float("-inf")
        )
        h = m.decoder.model.embed_tokens(ids)
        for i, layer in enumerate(m.decoder.model.layers):
            h = h + layer.self_attn.over_whole_cache(layer.input_layernorm(h), cos, sin, m.cache, i, slots, bias)
            h = h + layer.mlp_block(h)
        return m.logits(h)

    def _capture(self) -> None:
        """Warm up on a side stream (cuBLAS handles, allocator), then capture one step. The cache is empty here:
        the warm-up's writes land in slots that the first forward replaces. A capture that fails leaves the
        eager step (same shapes, so still exact; only slower), with a warning that says so."""
        device = self.model.device
        with cuda_setup(device):
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.inference_mode(), torch.cuda.stream(stream):
                for _ in range(2):
                    self._step()
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: a worker's other threads (heartbeats, channels) may call CUDA while this one captures
                with torch.inference_mode(), torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    self.out = self._step()
            except RuntimeError as e:
                warnings.warn(
                    f"CUDA graph capture of the {self.width}-row forward failed on {device} ({e}); "
                    f"running it eagerly (exact, slower)",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self.out = None
                return
            self.graph = graph

    def run(self) -> torch.Tensor:
        if self.graph is None:
            return self._step()
        self.graph.replay()
        assert self.out is not None  # the graph's output, captured with it
        return self.out

    # -- a forward of any length, in steps of W -----------------------------------------------------------------

    def forward(
        self, token_ids: list[int], positions: list[int] | None, tree_mask: torch.Tensor | None, last_n: int | None
    ) -> torch.Tensor:
        m, W = self.model, self.width
        n, start = len(token_ids), m.cache.length
        keep_from = 0 if last_n is None else n - min(last_n, n)
        window = m.cfg.sliding_window
        new_visible = (
            None
            if tree_mask is None and positions is None
            else torch.ones(n, n, dtype=torch.bool).tril()
            if tree_mask is None
            else tree_mask.to("cpu", torch.bool)
        )
        key_positions = None
        if new_visible is not None:
            pos = torch.arange(start, start + n) if positions is None else torch.tensor(positions)
            key_positions = self.host_key_slots.clone()
            key_positions[start : start + n] = pos
        rows = []
        for first in range(0, n, W):
            real = min(W, n - first)
            base = start + first
            slot = torch.arange(base, base + W)
            ids = torch.zeros(W, dtype=torch.long)
            ids[:real] = torch.tensor(token_ids[first : first + real])
            pos = slot.clone()
            if key_positions is not None:
                pos[:real] = key_positions[base : base + real]
            self.inputs.copy_(torch.stack((ids, pos, slot)))
            if new_visible is None or key_positions is None:  # both None or neither
                self._causal_visibility(self.inputs[2], window)  # the slots, already on the device
            else:
                self.visible.copy_(self._visibility(start, first, real, slot, pos, new_visible, key_positions, window))
            logits = self.run()
            if first + real > keep_from:
                rows.append(logits[max(0, keep_from - first) : real].clone())
        m.cache.length = start + n
        return torch.cat(rows) if len(rows) > 1 else rows[0]

    def _causal_visibility(self, slot: torch.Tensor, window: int | None) -> None:
        """A chain (positions = slots): each row sees every slot up to its own (within the window). `slot`: the
        rows' slots on the model's device."""
        own = slot[:, None]
        torch.le(self.key_slots[None, :], own, out=self.visible)
        if window is not None:
            self.visible &= (own - self.key_slots[None, :]) < window

    def _visibility(
        self,
        start: int,
        first: int,
        real: int,
        slot: torch.Tensor,
        pos: torch.Tensor,
        new_visible: torch.Tensor,
        key_positions: torch.Tensor,
        window: int | None,
    ) -> torch.Tensor:
        """Rows of a tree (or explicit positions): the cached prefix, then the new tokens `new_visible` allows
        (those of earlier steps are in the cache by now); padding rows see every slot up to their own."""
        n = new_visible.shape[0]
        visible = self.host_key_slots[None, :] <= slot[:, None]  # padding rows: causal
        visible[:real] = False
        visible[:real, :start] = True
        visible[:real, start : start + n] = new_visible[first : first + real]
        if window is not None:
            visible &= (pos[:, None] - key_positions[None, :]) < window
        return visible


# -- "auto": the width measured on the device, once per (device, model shape, dtype) -----------------------------


def measured_width(model, widths=WIDTHS) -> int:
    """The W for this model on its device, measured once (graphs of each width, CUDA events) and remembered in
    the paraspec cache, so every process that loads the same model on the same kind of GPU pads alike (they
    must: a different W is a different kernel)."""
    key = _width_key(model)
    path = cache_dir() / "padded_width" / f"{key}.json"
    try:
        return int(json.loads(path.read_text())["width"])
    except (OSError, ValueError, KeyError):
        pass
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with cuda_setup(model.device), open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process measures; the others read its answer
        try:
            return int(json.loads(path.read_text())["width"])
        except (OSError, ValueError, KeyError):
            pass
        costs = {w: forward_cost_ms(model, w) for w in widths}
        width = choose_width(costs)
        write_json(path, {"width": width, "costs_ms": costs, "tolerance": AUTO_TOLERANCE})
        return width


def _width_key(model) -> str:
    import hashlib

    cfg = model.cfg
    name = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "cpu"
    shape = (
        name,
        str(model.dtype),
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.vocab_size,
        model.cache.k.shape[2],
        torch.__version__,
    )
    return hashlib.sha256(repr(shape).encode()).hexdigest()[:16]


def forward_cost_ms(model, width: int, graph: bool | None = None, repeats: int = 20, compiled: bool = False) -> float:
    """Median milliseconds of one `width`-row step of `model` (graph-captured on CUDA unless graph=False; through
    torch.compile if `compiled`), timed with CUDA events on a GPU, perf_counter on a CPU. The cache is left empty."""
    return step_cost_ms(PaddedForward(model, width, graph, compiled), repeats)


def step_cost_ms(padded: PaddedForward, repeats: int = 20) -> float:
    """Median milliseconds of one run of `padded` after 3 warm-ups (see forward_cost_ms). The cache is left empty."""
    import statistics
    import time

    model = padded.model
    times = []
    with torch.inference_mode():
        for i in range(repeats + 3):
            if model.device.type == "cuda":
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                padded.run()
                end.record()
                end.synchronize()
                elapsed = begin.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                padded.run()
                elapsed = (time.perf_counter() - t0) * 1000
            if i >= 3:
                times.append(elapsed)
    model.cache.length = 0
    return statistics.median(times)
