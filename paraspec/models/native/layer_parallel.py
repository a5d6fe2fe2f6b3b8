"""Draft forwards beyond the Model protocol: a full attention mask over the cache, and EasySpec's layer parallelism.

    exact_forward   the native decoder's forward with an explicit [n, start + n] mask, so that new tokens can
                    see only some cached slots (a token tree drafted level by level keeps earlier levels in the
                    cache: a node must see its ancestors there, not their siblings)
    layer_parallel_forward   EasySpec (Wu et al. 2025, Sec. 3.1): the layers of one group all read the same input hidden
                    state; their attention outputs are added to the residual (in layer order), then their MLPs
                    run one after the other. With `exchange`, each attention of a group runs on one device and
                    the outputs are all-gathered; every device runs the (replicated) MLPs itself.
    layer groups    "0,1-3,4-7,...,31" (the paper's Appendix B), or generated from a layer-parallel size

Works on `NativeModel` (models/native/decoder.py), whose layers expose attention_block and mlp_block separately.
"""

from __future__ import annotations

from typing import Protocol

import torch


def parse_layer_groups(spec: str, num_layers: int) -> list[list[int]]:
    """'0,1-3,4,5' -> [[0], [1, 2, 3], [4], [5]]; the groups must cover 0..num_layers-1 in order."""
    groups = []
    for part in spec.replace(" ", "").split(","):
        lo, _, hi = part.partition("-")
        try:
            lo_i, hi_i = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"bad layer group {part!r} in {spec!r}; write groups like '0,1-3,4-7,...'") from None
        groups.append(list(range(lo_i, hi_i + 1)))
    flat = [layer for g in groups for layer in g]
    if flat != list(range(num_layers)):
        raise ValueError(
            f"layer groups {spec!r} must list every layer 0..{num_layers - 1} once, in order, as consecutive ranges"
        )
    return groups


def layer_parallel_groups(layer_parallel_size: int, num_layers: int) -> list[list[int]]:
    """Groups of `layer_parallel_size` consecutive layers; the first and the last layer always run alone (as in the
    paper)."""
    if layer_parallel_size < 1:
        raise ValueError(f"layer_parallel_size must be >= 1, got {layer_parallel_size}")
    if num_layers <= 2 or layer_parallel_size == 1:
        return [[i] for i in range(num_layers)]
    middle = list(range(1, num_layers - 1))
    return (
        [[0]]
        + [middle[i : i + layer_parallel_size] for i in range(0, len(middle), layer_parallel_size)]
        + [[num_layers - 1]]
    )


class Exchange(Protocol):
    """How the devices of one draft share attention outputs: rank r of `world` computes the attention of the
    layers group[r::world]; all_gather takes a CPU tensor and returns every rank's, indexed by rank, on the CPU
    (ShmExchange moves shared memory)."""

    rank: int
    world: int

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...


def _prepare(model, token_ids, positions, mask):
    n, start = len(token_ids), model.cache.length
    if n == 0:
        raise ValueError("forward needs at least one token")
    if start + n > model.max_context:
        raise ValueError(f"context full: {start} cached + {n} new tokens exceed max_context {model.max_context}")
    pos = torch.arange(start, start + n) if positions is None else torch.as_tensor(positions)
    pos = pos.to(model.device)
    if mask is None:
        mask = model.attention_mask(pos, start, None)
    else:
        if model.cfg.sliding_window is not None:
            raise ValueError(
                "an explicit cache mask with a sliding-window draft is not supported; "
                "use a draft without sliding-window attention"
            )
        mask = mask.to(device=model.device, dtype=torch.bool)
        if mask.shape != (n, start + n):
            raise ValueError(f"mask must be [{n}, {start + n}] (new tokens x cached + new), got {tuple(mask.shape)}")
    cos, sin = model.rope(pos)
    return n, start, cos, sin, mask


@torch.inference_mode()
def exact_forward(
    model,
    token_ids: list[int],
    positions=None,
    mask: torch.Tensor | None = None,
    last_n: int | None = None,
    head: bool = True,
) -> torch.Tensor | None:
    """The ordinary layer-by-layer forward; `mask` (bool [n, start + n]) replaces the causal mask.
    head=False skips the LM head (a replica that only needs its KV cache filled) and returns None."""
    n, start, cos, sin, mask = _prepare(model, token_ids, positions, mask)
    h = model.embed(token_ids)
    for i, layer in enumerate(model.decoder.model.layers):
        h = layer(h, cos, sin, model.cache, i, start, mask)
    model.cache.length = start + n
    if not head:
        return None
    return model.logits(h if last_n is None else h[-last_n:])


@torch.inference_mode()
def layer_parallel_forward(
    model,
    token_ids: list[int],
    groups: list[list[int]],
    positions=None,
    mask: torch.Tensor | None = None,
    last_n: int | None = None,
    exchange: Exchange | None = None,
    record: dict | None = None,
    head: bool = True,
) -> torch.Tensor | None:
    """Layer-parallel forward (the paper's "fuzzy" forward). Writes the KV of every layer this rank computes; with an
    exchange, layers computed by other ranks get no KV here (they are recomputed exactly by calibration anyway).

    `record`, if given, receives per layer the input hidden state of its attention ("h_in"), the attention
    output ("attn"), the layer output ("h_out") and q/k/v, for the hidden-state studies.
    """
    n, start, cos, sin, mask = _prepare(model, token_ids, positions, mask)
    layers = model.decoder.model.layers
    h = model.embed(token_ids)
    for group in groups:
        mine = group if exchange is None or len(group) == 1 else group[exchange.rank :: exchange.world]
        outputs = {}
        for i in mine:
            if record is not None:
                _record_qkv(record, i, layers[i], h, cos, sin)
            outputs[i] = layers[i].attention_block(h, cos, sin, model.cache, i, start, mask)
        if exchange is not None and len(group) > 1:
            outputs = _gather(exchange, group, outputs, n, h)
        if record is not None:
            for i in group:
                record.setdefault(i, {}).update(h_in=h.clone(), attn=outputs[i].clone())
        for i in group:  # summed in layer order: every rank gets the same bits
            h = h + outputs[i]
        for i in group:
            h = h + layers[i].mlp_block(h)
            if record is not None:
                record[i]["h_out"] = h.clone()
    model.cache.length = start + n
    if not head:
        return None
    return model.logits(h if last_n is None else h[-last_n:])


def _gather(exchange: Exchange, group: list[int], outputs: dict, n: int, h: torch.Tensor) -> dict:
    """All-gather one group's attention outputs: each rank sends its layers' outputs stacked in layer order."""
    per_rank = [group[r :: exchange.world] for r in range(exchange.world)]
    width = max(len(layers) for layers in per_rank)
    send = h.new_zeros(width, n, h.shape[-1])
    for j, i in enumerate(per_rank[exchange.rank]):
        send[j] = outputs[i]
    # the exchange moves CPU tensors: one copy out of h's device, one copy back per rank
    received = [t.to(h.device) for t in exchange.all_gather(send.cpu())]
    return {i: received[r][j] for r, layers in enumerate(per_rank) for j, i in enumerate(layers)}


def _record_qkv(record: dict, i: int, layer, h, cos, sin) -> None:
    from paraspec.models.native.decoder import rotate_half

    attn, cfg = layer.self_attn, layer.self_attn.cfg
    x = layer.input_layernorm(h)
    q = attn.q_proj(x).view(x.shape[0], cfg.num_heads, cfg.head_dim).transpose(0, 1)
    k = attn.k_proj(x).view(x.shape[0], cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
    v = attn.v_proj(x)
    record.setdefault(i, {}).update(
        q=(q * cos + rotate_half(q) * sin).transpose(0, 1).reshape(x.shape[0], -1),
        k=(k * cos + rotate_half(k) * sin).transpose(0, 1).reshape(x.shape[0], -1),
        v=v.clone(),
    )
