"""Packed rows on the CPU without the packed sequence's whole mask: each row's causal attention on its own.

A packed forward (``lm_head.packed_inputs``: the attended positions of all rows in one ``[1, N]`` sequence, position
ids restarting at 0 in every row) needs attention that does not cross rows. transformers builds it from the
position ids as one ``[N, N]`` block-diagonal mask, and SDPA on a CPU then computes every one of the N^2 scores: on
the quickstart's micro-batches of 8,704 positions that made packed rows 2.5x slower than padded ones
(bench/results/update-cpu-paths-2026-12-06.md), where CUDA's flash-attention varlen computes only each row's
own block. :func:`varlen_attention` does what varlen does, row by row: SDPA with ``is_causal`` on each row's
segment of the packed queries, keys and values (the segments start where the position ids restart), so a packed
forward computes Σ_rows len² attention scores, fewer than padded rows (B × T²), and its projections and MLPs
touch no padding at all. Registered with transformers as ``ATTN_NAME`` with no mask (the segments are the mask);
:func:`varlen_attention_on` switches a model to it for one forward, where :func:`varlen_supported` says the
model's attention is a plain causal attention over RoPE'd queries and keys (Llama, Qwen2, Qwen3 without sliding
windows) on the CPU. The log-probs equal the padded forward's (fp32, 1e-5; tests/engine/test_packed_rows.py).

:func:`prefix_tree_attention` is the attention of the packed layout that pushes each shared prompt prefix once
(engine/policy/shared_prefix.py): a segment that starts at position 0 is a root and attends causally to itself, one
that starts at p > 0 is a suffix and attends to the first p positions of the last root and causally to itself.
Registered as ``TREE_NAME``, switched on for one forward by :func:`prefix_tree_on` where :func:`prefix_tree_supported`
(the same models as the row-by-row attention).
"""

from __future__ import annotations

import contextlib
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

ATTN_NAME = "alignopsd_varlen"
TREE_NAME = "alignopsd_prefix_tree"
MODEL_TYPES = ("llama", "qwen2", "qwen3")  # attention called with RoPE'd q/k and no extra score terms


def plain_causal_attention(model) -> bool:
    """Whether ``model`` (a causal LM or its body) is a Llama/Qwen2/Qwen3 whose layers all use full causal attention
    (no sliding window), on the CPU: the models whose attention a custom CPU attention may replace."""
    cfg = model.config
    if next(model.parameters()).device.type != "cpu" or getattr(cfg, "model_type", None) not in MODEL_TYPES:
        return False
    if getattr(cfg, "use_sliding_window", False):
        return False
    return all(t == "full_attention" for t in (getattr(cfg, "layer_types", None) or ()))


varlen_supported = plain_causal_attention
prefix_tree_supported = plain_causal_attention


def segment_starts(position_ids: Tensor) -> list[int]:
    """Start of every row's segment in a packed ``[1, N]`` sequence (where the position ids restart), then N."""
    if position_ids.dim() != 2 or position_ids.shape[0] != 1:
        raise ValueError(f"position_ids: expected one packed sequence [1, N], got {tuple(position_ids.shape)}")
    pos = position_ids[0]
    starts = (pos == 0).nonzero().squeeze(1).tolist()
    if not starts or starts[0] != 0:
        raise ValueError("position_ids: a packed sequence must start a row at position 0")
    return [*starts, int(pos.shape[0])]


def varlen_attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention interface over one packed sequence: ``query`` ``[1, H, N, D]``, ``key``/``value``
    ``[1, K, N, D]`` (K divides H), the rows' segments read from ``position_ids``; returns ``([1, N, H, D], None)``."""
    pos = kwargs.get("position_ids")
    if pos is None or query.shape[0] != 1:
        raise ValueError(f"{ATTN_NAME}: needs one packed sequence and its position_ids (got {tuple(query.shape)})")
    bounds = segment_starts(pos)
    p = dropout if module.training else 0.0
    gqa = key.shape[1] != query.shape[1]
    # split, not one slice per row: a slice's backward zero-fills a tensor of the whole sequence for every row,
    # the split's backward is one concatenation of the rows' gradients
    sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    outs = [
        F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=scaling, enable_gqa=gqa)
        for q, k, v in zip(*(t.split(sizes, dim=2) for t in (query, key, value)))
    ]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs) -> None:
    return None


@contextmanager
def attention_swapped(model, name: str, fn, mask_fn=None):
    """Run ``model``'s attention as ``fn`` (registered with transformers as ``name``; ``mask_fn``: its mask builder,
    None: the model's own) inside the block, its own attention restored after it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, fn)  # idempotent: one dict entry each
    if mask_fn is not None:
        AttentionMaskInterface.register(name, mask_fn)
    cfg = model.config
    before = cfg._attn_implementation
    cfg._attn_implementation = name
    try:
        yield
    finally:
        cfg._attn_implementation = before


def recompute_as_run(config) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """A ``torch.utils.checkpoint`` ``context_fn`` for a model with gradient checkpointing (``config``: its config):
    the backward's recomputation of a layer runs the attention implementation the layer's forward ran. An attention
    swapped in for one forward (:func:`attention_swapped`: a packed forward's row-by-row attention) is restored before
    the backward, and the model's own attention would recompute other values (across the packed rows)."""
    ran = config._attn_implementation

    @contextmanager
    def recompute():
        before = config._attn_implementation
        config._attn_implementation = ran
        try:
            yield
        finally:
            config._attn_implementation = before

    return contextlib.nullcontext(), recompute()


def tree_segments(position_ids: Tensor) -> list[tuple[int, int]]:
    """(length, first position) of every segment of a packed ``[1, N]`` sequence laid out as a prefix tree: a segment
    begins where the position ids do not continue by one (first position 0: a root; p > 0: a suffix of the last root
    that reads its first p positions)."""
    if position_ids.dim() != 2 or position_ids.shape[0] != 1 or position_ids.shape[1] == 0:
        raise ValueError(f"position_ids: expected one packed sequence [1, N], got {tuple(position_ids.shape)}")
    pos = position_ids[0]
    brk = (pos[1:] != pos[:-1] + 1).nonzero().squeeze(1).add(1).tolist()
    starts = [0, *brk]
    firsts = pos[starts].tolist()
    if firsts[0] != 0:
        raise ValueError("position_ids: a prefix-tree sequence must start a root at position 0")
    ends = [*brk, int(pos.shape[0])]
    return [(e - s, f) for s, e, f in zip(starts, ends, firsts)]


def prefix_tree_attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention interface over one packed prefix-tree sequence (module docstring): ``query``
    ``[1, H, N, D]``, ``key``/``value`` ``[1, K, N, D]``, the segments read from ``position_ids``; returns
    ``([1, N, H, D], None)``. A suffix of ``S`` positions over a prefix of ``p`` attends to ``p + S`` keys under a
    ``[S, p + S]`` mask (query ``i`` sees keys ``<= p + i``)."""
    pos = kwargs.get("position_ids")
    if pos is None or query.shape[0] != 1:
        raise ValueError(f"{TREE_NAME}: needs one packed sequence and its position_ids (got {tuple(query.shape)})")
    segs = tree_segments(pos)
    p = dropout if module.training else 0.0
    gqa = key.shape[1] != query.shape[1]
    sizes = [n for n, _ in segs]
    outs, root = [], None
    for (n, first), q, k, v in zip(segs, *(t.split(sizes, dim=2) for t in (query, key, value))):
        if first == 0:
            root = (k, v)
            outs.append(
                F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=scaling, enable_gqa=gqa)
            )
            continue
        if root is None or root[0].shape[2] < first:
            raise ValueError(f"{TREE_NAME}: a suffix at position {first} has no root of at least {first} positions")
        kk, vv = (torch.cat([r[:, :, :first], t], dim=2) for r, t in zip(root, (k, v)))
        sees = torch.arange(first + n, device=q.device) <= torch.arange(n, device=q.device)[:, None] + first
        outs.append(
            F.scaled_dot_product_attention(q, kk, vv, attn_mask=sees, dropout_p=p, scale=scaling, enable_gqa=gqa)
        )
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


def prefix_tree_on(model):
    """Run ``model``'s attention as :func:`prefix_tree_attention` inside the block (its own restored after it)."""
    return attention_swapped(model, TREE_NAME, prefix_tree_attention, _no_mask)


def varlen_attention_on(model):
    """Run ``model``'s attention as :func:`varlen_attention` inside the block (its own restored after it)."""
    return attention_swapped(model, ATTN_NAME, varlen_attention, _no_mask)
