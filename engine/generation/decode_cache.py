"""Key/value caches of the Hugging Face generator, and the CPU decoding attention that reads one shared prefix.

Legend: B = rows of the cache, G = shared prefixes, P = their (left-padded) length, S = positions one forward
pushes, n = positions a row holds after its prefix, C = the rows' preallocated capacity, H = query heads,
K = key/value heads, R = H / K query heads per key/value head, D = head dim.

Both caches give the generator (engine/generation/hf.py) one interface: ``push(valid_BS)`` before a forward of
S positions per row (``valid`` marks the non-padding ones), ``share(prefix_of_row, shared)`` to turn the B rows
just pushed into G shared prefixes read by the rows that follow, ``select(rows)`` to drop finished rows, and
``forward_kwargs()`` for the model call.

- :class:`ModelKV` is the model's own attention over transformers' ``DynamicCache``: the cache grows by
  concatenation at every token, and a shared prefix is copied to each of its rows.
- :class:`SharedPrefixKV` (CPU, Llama-style attention: see :func:`shared_prefix_supported`) keeps each prefix once
  and the rows' own positions in a buffer preallocated for the whole budget, in fp32. During generation the model's
  attention is :func:`shared_prefix_attention` (registered with transformers as ``ATTN_NAME``; the training forward
  keeps its own). A single-token query (decoding) is a grouped matmul: the R query heads of a key/value head
  against its keys without repeating them, and all rows sharing a prefix in one GEMM against that prefix's one
  copy; softmax over ``[prefix | own]`` scores in fp32. A multi-token push (prefill) of a bf16 model on a CPU with
  AVX512-BF16 runs the C++ kernel of kernels/attention_native.py (the prefix read in place, bf16 products with fp32
  accumulation, fp32 softmax); otherwise SDPA with ``enable_gqa`` over the prefix gathered per row. Measured on a
  2-core AVX-512 CPU for SmolLM2-135M shapes (32 rows, 1,000 keys, 650 shared), decoding: transformers' SDPA path
  (``repeat_kv`` copies, bf16 flash kernel) costs tens of ms per layer call, this one 1-3 ms
  (bench/results/overhead-2026-12-02-warm.md).

In fp32 both give the same tokens for the same seed up to float rounding (tests/engine/test_generation_hf.py).
"""

from __future__ import annotations

import torch
from alignopsd.engine.policy.varlen_attention import attention_swapped, plain_causal_attention
from alignopsd.kernels import NativePath, resolve_impl
from alignopsd.kernels.attention_native import (
    measure_attention,
    prefix_attention,
    prefix_attention_applies,
    torch_prefix_attention,
)
from alignopsd.kernels.native_choice import ATTENTION
from torch import Tensor

ATTN_NAME = "alignopsd_shared_prefix"


def shared_prefix_supported(model) -> bool:
    """Whether :class:`SharedPrefixKV` can serve ``model``: on the CPU, a Llama/Qwen2/Qwen3 causal LM whose
    layers all use full attention (no sliding window)."""
    return plain_causal_attention(model)


def shared_prefix_attention_on(model):
    """Run the model's attention as :func:`shared_prefix_attention` inside the block (restored after it)."""
    return attention_swapped(model, ATTN_NAME, shared_prefix_attention)


class ModelKV:
    """transformers' ``DynamicCache`` with the 2-D padding mask the model's own attention needs."""

    def __init__(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.mask: Tensor | None = None  # [B, T] long

    def push(self, valid_BS: Tensor) -> None:
        v = valid_BS.long()
        self.mask = v if self.mask is None else torch.cat([self.mask, v], dim=1)

    def share(self, prefix_of_row: Tensor, shared: Tensor) -> None:
        self.cache.batch_select_indices(prefix_of_row)  # each row gets a copy of its prefix's keys and values
        self.mask = self.mask[prefix_of_row] * shared[:, None].long()  # a row without a prefix: all masked

    def select(self, rows: Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]

    def forward_kwargs(self) -> dict:
        return {"attention_mask": self.mask, "past_key_values": self.cache}


class SharedPrefixKV:
    """Shared prefixes kept once, the rows' own keys/values preallocated (see the module doc). fp32 storage."""

    def __init__(self, num_layers: int, budget: int) -> None:
        self.num_layers = num_layers
        self.budget = int(budget)  # positions reserved after the first push of a row set (the generated tokens)
        self.k: list[Tensor | None] = [None] * num_layers  # [B, K, C, D] own keys (views of the first rows)
        self.v: list[Tensor | None] = [None] * num_layers
        self.pk: list[Tensor | None] = [None] * num_layers  # [G, K, P, D] prefix keys
        self.pv: list[Tensor | None] = [None] * num_layers
        self.valid: Tensor | None = None  # [B, C] bool: own positions that are not padding
        self.prefix_valid: Tensor | None = None  # [B, P] bool: the prefix positions each row reads
        self.prefix_valid_GP: Tensor | None = None  # [G, P] bool: each prefix's non-padding positions
        self.row_prefix: Tensor | None = None  # [B] long: the prefix each row reads, -1 for none
        self.groups: list[tuple[int, Tensor | None, int]] = []  # (prefix, its rows or None for all rows, row count)
        self.length = 0  # own positions filled
        self.start = 0  # first own position of the current push
        self.bias: Tensor | None = None  # [B, 1, S, P + n] fp32: 0 where a query may attend, -inf elsewhere

    def push(self, valid_BS: Tensor) -> None:
        valid = valid_BS.bool()
        B, S = valid.shape
        if self.valid is None:  # a new row set: room for its prompt part and the budget
            self.valid = torch.zeros((B, S + self.budget), dtype=torch.bool, device=valid.device)
        if self.length + S > self.valid.shape[1]:
            raise ValueError(f"push: {S} positions exceed the cache capacity {self.valid.shape[1]} at {self.length}")
        self.start, self.length = self.length, self.length + S
        self.valid[:, self.start : self.length] = valid
        mask = self.valid[:, None, : self.length].expand(-1, S, -1)  # [B, S, n]
        if S > 1:
            qpos = torch.arange(self.start, self.length, device=valid.device)[:, None]
            kpos = torch.arange(self.length, device=valid.device)[None, :]
            mask = mask & (kpos <= qpos)  # causal; a padding query sees no key of its own, as in the model's mask
        if self.prefix_valid is not None:
            mask = torch.cat([self.prefix_valid[:, None, :].expand(-1, S, -1), mask], dim=2)
        # a query with no key at all (left padding without a prefix) attends to itself, so its softmax has a term;
        # its output reaches no one (its key is masked for every other query)
        mask = mask.clone()
        mask[..., -S:].diagonal(dim1=1, dim2=2).logical_or_(~mask.any(-1))
        self.bias = torch.zeros((B, 1, *mask.shape[1:]), dtype=torch.float32, device=valid.device)
        self.bias.masked_fill_(~mask[:, None], float("-inf"))  # one additive mask for every layer of this push

    def update(self, key: Tensor, value: Tensor, layer_idx: int) -> tuple[Tensor, Tensor]:
        """Called by the model's attention layers: store this push's keys/values (``[B, K, S, D]``)."""
        if self.k[layer_idx] is None:
            B, K, _, D = key.shape
            shape = (B, K, self.valid.shape[1], D)
            self.k[layer_idx] = key.new_empty(shape, dtype=torch.float32)
            self.v[layer_idx] = key.new_empty(shape, dtype=torch.float32)
        self.k[layer_idx][:, :, self.start : self.length] = key
        self.v[layer_idx][:, :, self.start : self.length] = value
        return key, value

    def share(self, prefix_of_row: Tensor, shared: Tensor) -> None:
        """The rows pushed so far become the shared prefixes; the next push starts the rows that read them."""
        if self.prefix_valid is not None:
            raise ValueError("share: the cache already holds shared prefixes")
        pk = [k[:, :, : self.length].contiguous() for k in self.k]
        pv = [v[:, :, : self.length].contiguous() for v in self.v]
        self._set_prefixes(pk, pv, self.valid[:, : self.length], torch.where(shared.bool(), prefix_of_row, -1))

    @classmethod
    def reading(
        cls, pk: list[Tensor], pv: list[Tensor], valid_GP: Tensor, prefix_of_row: Tensor, budget: int = 0
    ) -> SharedPrefixKV:
        """A cache whose rows read the given prefixes (``pk``/``pv``: per layer ``[G, K, P, D]``, ``valid_GP`` their
        non-padding positions, ``prefix_of_row`` ``[B]``, -1 for none) before their own positions: rows scored
        behind prompts whose keys and values were kept (engine/generation/prompt_cache.py)."""
        kv = cls(len(pk), budget)
        kv._set_prefixes(pk, pv, valid_GP.bool(), prefix_of_row.long())
        return kv

    def _set_prefixes(self, pk: list[Tensor], pv: list[Tensor], valid_GP: Tensor, row_prefix: Tensor) -> None:
        self.pk, self.pv = pk, pv
        self.prefix_valid_GP = valid_GP
        self.row_prefix = row_prefix
        self._regroup()
        self.k = [None] * self.num_layers
        self.v = [None] * self.num_layers
        self.valid, self.length, self.start = None, 0, 0

    def _regroup(self) -> None:
        """Prefix validity per row and the groups of rows reading each prefix (None: every row reads it)."""
        rp = self.row_prefix
        self.prefix_valid = self.prefix_valid_GP[rp.clamp_min(0)] & rp.ge(0)[:, None]
        self.groups = []
        for g in rp[rp >= 0].unique().tolist():
            rows = torch.nonzero(rp.eq(g)).flatten()
            n = int(rows.numel())
            self.groups.append((g, None if n == rp.numel() else rows, n))

    def select(self, rows: Tensor) -> None:
        """Keep ``rows`` (in that order; a row may be repeated, which copies its keys and values)."""
        n, m, before = self.length, int(rows.numel()), int(self.valid.shape[0])
        kept = rows.tolist()
        moves = [(j, r) for j, r in enumerate(kept) if r != j]
        in_order = m <= before and all(a < b for a, b in zip(kept, kept[1:]))
        for buf in (self.k, self.v):
            for i, t in enumerate(buf):
                if m > before:  # more rows than the buffer holds: a new buffer of the same capacity
                    buf[i] = t[rows]
                    continue
                if in_order:  # dropping rows (decoding): move each later row up in place, no gathered copy
                    for j, r in moves:
                        t[j, :, :n].copy_(t[r, :, :n])
                else:
                    t[:m, :, :n] = t[rows, :, :n]  # the right side is gathered into a new tensor first
                buf[i] = t[:m]
        self.valid = self.valid[rows]
        if self.prefix_valid is not None:
            self.row_prefix = self.row_prefix[rows]
            self._regroup()

    def snapshot_bytes(self) -> int:
        """Bytes :meth:`prompts_snapshot` would hold (keys and values of every layer, fp32)."""
        B, K, _, D = self.k[0].shape
        width = self.length + (self.prefix_valid.shape[1] if self.prefix_valid is not None else 0)
        return 2 * self.num_layers * B * K * width * D * 4

    def prompts_snapshot(self) -> tuple[list[Tensor], list[Tensor], Tensor]:
        """(keys, values: per layer ``[B, K, P + n, D]``, valid ``[B, P + n]``) of every row: its prefix followed by
        the own positions pushed so far, copied once (decoding and :meth:`select` then leave them unchanged)."""
        n = self.length
        valid = self.valid[:, :n]
        if self.prefix_valid is None:
            return [k[:, :, :n].clone() for k in self.k], [v[:, :, :n].clone() for v in self.v], valid.clone()
        g = self.row_prefix.clamp_min(0)
        one = bool((g == g[0]).all())  # one prefix for every row: read as a view, not gathered per row

        def prefix(t: Tensor) -> Tensor:
            return t[g[:1]].expand(g.numel(), -1, -1, -1) if one else t[g]

        ks = [torch.cat([prefix(pk), k[:, :, :n]], dim=2) for pk, k in zip(self.pk, self.k)]
        vs = [torch.cat([prefix(pv), v[:, :, :n]], dim=2) for pv, v in zip(self.pv, self.v)]
        return ks, vs, torch.cat([self.prefix_valid, valid], dim=1)

    def forward_kwargs(self) -> dict:
        return {"attention_mask": None, "past_key_values": self, "prefix_kv": self}

    # ------------------------------------------------------------------ attention
    def attend(self, layer: int, query_BHSD: Tensor, scaling: float) -> Tensor:
        """Attention output ``[B, S, H, D]`` (query dtype) of this push's queries over prefix + own keys: a push of
        several positions of a bf16 model runs in the C++ kernel where it applies (kernels/attention_native.py:
        the prefix read in place) where it was measured faster here, else in its torch path (the gathered prefix, fp32
        scaled-dot-product attention)."""
        if query_BHSD.shape[2] == 1:
            out = self._decode(layer, query_BHSD.float(), scaling)
        else:
            k, v = self.k[layer][:, :, : self.length], self.v[layer][:, :, : self.length]
            pk, pv = (self.pk[layer], self.pv[layer]) if self.prefix_valid is not None else (None, None)
            rows = self.row_prefix if pk is not None else None
            args = (query_BHSD, k, v, pk, pv, rows, self.bias, scaling)
            native = NativePath(
                prefix_attention_applies(query_BHSD, k, v, pk, pv), ATTENTION, lambda: measure_attention(*args)
            )
            if resolve_impl("auto", native=native) == "cpp":  # measured faster here (kernels/native_choice.py)
                out = prefix_attention(*args)
            else:
                out = torch_prefix_attention(*args)
        return out.to(query_BHSD.dtype)

    def _decode(self, layer: int, q: Tensor, scaling: float) -> Tensor:
        B, H, _, D = q.shape
        k, v = self.k[layer][:, :, : self.length], self.v[layer][:, :, : self.length]
        K = k.shape[1]
        R = H // K
        q = q.reshape(B, K, R, D)
        own = torch.matmul(q, k.transpose(-1, -2))  # [B, K, R, n]
        if self.prefix_valid is None:
            probs = torch.softmax(own.mul_(scaling).add_(self.bias), dim=-1)
            return torch.matmul(probs, v).reshape(B, 1, H, D)
        P = self.prefix_valid.shape[1]
        scores = q.new_empty((B, K, R, P + own.shape[-1]))
        scores[..., P:] = own
        if len(self.groups) != 1 or self.groups[0][1] is not None:
            scores[..., :P] = 0.0  # rows without a prefix (masked by the bias)
        for g, rows, m in self.groups:
            qg = (q if rows is None else q[rows]).transpose(0, 1).reshape(K, m * R, D)
            sg = torch.matmul(qg, self.pk[layer][g].transpose(-1, -2)).view(K, m, R, P).transpose(0, 1)
            if rows is None:
                scores[..., :P] = sg
            else:
                scores[rows, :, :, :P] = sg
        probs = torch.softmax(scores.mul_(scaling).add_(self.bias), dim=-1)
        out = torch.matmul(probs[..., P:], v)  # [B, K, R, D]
        for g, rows, m in self.groups:
            pg = (probs if rows is None else probs[rows])[..., :P].transpose(0, 1).reshape(K, m * R, P)
            og = torch.matmul(pg, self.pv[layer][g]).view(K, m, R, D).transpose(0, 1)
            if rows is None:
                out += og
            else:
                out[rows] += og
        return out.reshape(B, 1, H, D)


def shared_prefix_attention(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    prefix_kv: SharedPrefixKV | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention interface: the model's attention over a :class:`SharedPrefixKV` (whose ``update`` has
    already stored ``key``/``value``). ``query`` is ``[B, H, S, D]``; returns ``([B, S, H, D], None)``."""
    if prefix_kv is None:
        raise ValueError(f"{ATTN_NAME}: called without its cache (prefix_kv); it serves generation only")
    if dropout or kwargs.get("sliding_window") or kwargs.get("softcap"):
        raise ValueError(f"{ATTN_NAME}: dropout, sliding windows and soft-capping are not supported")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return prefix_kv.attend(module.layer_idx, query, scale), None
