"""Weight conversion between Hugging Face (Llama / Qwen2) and megatron-core ``GPTModel`` shards.

Legend: V = vocabulary, D = hidden size, F = MLP width, nq = query heads, ng = key/value groups,
hn = head dim, tp = tensor-parallel size, r = tensor-parallel rank.

Megatron's local layer spec stores, per layer and per tensor-parallel rank:
- ``self_attention.linear_qkv`` (column parallel): for each of the rank's ng/tp query groups, the
  group's nq/ng query heads, then its key head, then its value head, stacked on dim 0
  ([(nq/ng + 2) * hn * ng/tp, D]); Qwen2's q/k/v biases follow the same layout.
- ``self_attention.linear_proj`` (row parallel): columns of o_proj for the rank's query heads.
- ``mlp.linear_fc1`` (column parallel, gated): [gate rows of rank r; up rows of rank r].
- ``mlp.linear_fc2`` (row parallel): columns of down_proj for rank r.
- ``embedding.word_embeddings`` and ``output_layer`` (vocab parallel): rows of rank r.
- norms are replicated.
The conversion is exact (pure slicing and concatenation); ``megatron_to_hf(hf_to_megatron(x))``
gives ``x`` back bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class Dims:
    """The shapes the conversion needs, read from a Hugging Face config."""

    num_layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool

    @staticmethod
    def from_hf_config(hf_config: PretrainedConfig | SimpleNamespace) -> Dims:
        """The shapes of a Hugging Face config (or of a namespace of its ``config.json`` fields)."""
        heads = int(hf_config.num_attention_heads)
        head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
        qkv_bias = bool(getattr(hf_config, "attention_bias", False)) or getattr(hf_config, "model_type", "") == "qwen2"
        return Dims(
            num_layers=int(hf_config.num_hidden_layers),
            hidden=int(hf_config.hidden_size),
            ffn=int(hf_config.intermediate_size),
            heads=heads,
            groups=int(getattr(hf_config, "num_key_value_heads", None) or heads),
            head_dim=head_dim,
            vocab=int(hf_config.vocab_size),
            tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
        )

    def check_tp(self, tp: int) -> None:
        """ValueError naming the first dimension that ``tp`` shards unevenly."""
        if tp < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {tp}")
        for name, value in (
            ("num_attention_heads", self.heads),
            ("num_key_value_heads", self.groups),
            ("intermediate_size", self.ffn),
        ):
            if value % tp:
                raise ValueError(f"tensor_parallel_size: {tp} does not divide {name} = {value}")
        if self.vocab % tp:
            raise ValueError(f"tensor_parallel_size: {tp} does not divide vocab_size = {self.vocab}")


def _rows(t: Tensor, tp: int, r: int) -> Tensor:
    n = t.shape[0] // tp
    return t[r * n : (r + 1) * n]


def _cols(t: Tensor, tp: int, r: int) -> Tensor:
    n = t.shape[1] // tp
    return t[:, r * n : (r + 1) * n]


def _pack_qkv(q: Tensor, k: Tensor, v: Tensor, d: Dims) -> Tensor:
    """[nq*hn, ...], [ng*hn, ...], [ng*hn, ...] -> per-group interleaved [(nq/ng+2)*hn*ng, ...]."""
    per = d.heads // d.groups
    rest = q.shape[1:]
    qg = q.reshape(d.groups, per * d.head_dim, *rest)
    kg = k.reshape(d.groups, d.head_dim, *rest)
    vg = v.reshape(d.groups, d.head_dim, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def _unpack_qkv(qkv: Tensor, d: Dims) -> tuple[Tensor, Tensor, Tensor]:
    per = d.heads // d.groups
    rest = qkv.shape[1:]
    g = qkv.reshape(d.groups, (per + 2) * d.head_dim, *rest)
    q = g[:, : per * d.head_dim].reshape(-1, *rest)
    k = g[:, per * d.head_dim : (per + 1) * d.head_dim].reshape(-1, *rest)
    v = g[:, (per + 1) * d.head_dim :].reshape(-1, *rest)
    return q, k, v


def hf_to_megatron(hf: dict[str, Tensor], d: Dims, tp: int, r: int) -> dict[str, Tensor]:
    """The state dict of tensor-parallel rank ``r`` of ``tp`` from a full Hugging Face state dict."""
    d.check_tp(tp)
    if not 0 <= r < tp:
        raise ValueError(f"rank: expected 0 <= rank < {tp}, got {r}")

    def get(name: str) -> Tensor:
        if name not in hf:
            raise ValueError(f"state_dict: missing Hugging Face weight {name!r}")
        return hf[name]

    out: dict[str, Tensor] = {"embedding.word_embeddings.weight": _rows(get("model.embed_tokens.weight"), tp, r)}
    for i in range(d.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = get(p + "input_layernorm.weight")
        qkv = _pack_qkv(
            get(p + "self_attn.q_proj.weight"),
            get(p + "self_attn.k_proj.weight"),
            get(p + "self_attn.v_proj.weight"),
            d,
        )
        out[m + "self_attention.linear_qkv.weight"] = _rows(qkv, tp, r)
        if d.qkv_bias:
            qkv_b = _pack_qkv(
                get(p + "self_attn.q_proj.bias"), get(p + "self_attn.k_proj.bias"), get(p + "self_attn.v_proj.bias"), d
            )
            out[m + "self_attention.linear_qkv.bias"] = _rows(qkv_b, tp, r)
        out[m + "self_attention.linear_proj.weight"] = _cols(get(p + "self_attn.o_proj.weight"), tp, r)
        out[m + "pre_mlp_layernorm.weight"] = get(p + "post_attention_layernorm.weight")
        gate, up = get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")
        out[m + "mlp.linear_fc1.weight"] = torch.cat([_rows(gate, tp, r), _rows(up, tp, r)], dim=0)
        out[m + "mlp.linear_fc2.weight"] = _cols(get(p + "mlp.down_proj.weight"), tp, r)
    out["decoder.final_layernorm.weight"] = get("model.norm.weight")
    if not d.tied:
        out["output_layer.weight"] = _rows(get("lm_head.weight"), tp, r)
    return {k: v.contiguous().clone() for k, v in out.items()}


def conversion_parts(d: Dims) -> list[str | int]:
    """The units of the conversion back to Hugging Face, in order: ``"embedding"``, each layer's index and
    ``"final"`` (the final norm and an untied output head). Each converts from its own megatron weights alone."""
    return ["embedding", *range(d.num_layers), "final"]


def part_of(name: str) -> str | int | None:
    """The conversion part (see :func:`conversion_parts`) that reads the megatron weight ``name``; None for a
    name that no part reads."""
    if name.startswith("embedding."):
        return "embedding"
    if name.startswith("decoder.layers."):
        return int(name.split(".")[2])
    if name.startswith(("decoder.final_layernorm.", "output_layer.")):
        return "final"
    return None


def megatron_part_to_hf(shards: list[dict[str, Tensor]], d: Dims, part: str | int) -> dict[str, Tensor]:
    """The Hugging Face weights of one conversion ``part`` from the state dicts of all ``len(shards)``
    tensor-parallel ranks (each needs only that part's megatron weights). A tied output head comes with the
    embedding, as the same tensor."""
    tp = len(shards)
    if tp < 1:
        raise ValueError("shards: need the state dict of at least one tensor-parallel rank")
    d.check_tp(tp)

    def cat_rows(name: str) -> Tensor:
        return torch.cat([s[name] for s in shards], dim=0)

    def cat_cols(name: str) -> Tensor:
        return torch.cat([s[name] for s in shards], dim=1)

    out: dict[str, Tensor] = {}
    if part == "embedding":
        out["model.embed_tokens.weight"] = cat_rows("embedding.word_embeddings.weight")
        if d.tied:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
    elif part == "final":
        out["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"]
        if not d.tied:
            out["lm_head.weight"] = cat_rows("output_layer.weight")
    elif isinstance(part, int) and 0 <= part < d.num_layers:
        p, m = f"model.layers.{part}.", f"decoder.layers.{part}."
        out[p + "input_layernorm.weight"] = shards[0][m + "input_layernorm.weight"]
        q, k, v = _unpack_qkv(cat_rows(m + "self_attention.linear_qkv.weight"), d)
        out[p + "self_attn.q_proj.weight"], out[p + "self_attn.k_proj.weight"] = q, k
        out[p + "self_attn.v_proj.weight"] = v
        if d.qkv_bias:
            qb, kb, vb = _unpack_qkv(cat_rows(m + "self_attention.linear_qkv.bias"), d)
            out[p + "self_attn.q_proj.bias"], out[p + "self_attn.k_proj.bias"] = qb, kb
            out[p + "self_attn.v_proj.bias"] = vb
        out[p + "self_attn.o_proj.weight"] = cat_cols(m + "self_attention.linear_proj.weight")
        out[p + "post_attention_layernorm.weight"] = shards[0][m + "pre_mlp_layernorm.weight"]
        fc1 = [s[m + "mlp.linear_fc1.weight"] for s in shards]
        half = fc1[0].shape[0] // 2
        out[p + "mlp.gate_proj.weight"] = torch.cat([f[:half] for f in fc1], dim=0)
        out[p + "mlp.up_proj.weight"] = torch.cat([f[half:] for f in fc1], dim=0)
        out[p + "mlp.down_proj.weight"] = cat_cols(m + "mlp.linear_fc2.weight")
    else:
        raise ValueError(f"part: expected 'embedding', 'final' or a layer index below {d.num_layers}, got {part!r}")
    return {k: v.contiguous() for k, v in out.items()}


def megatron_to_hf(shards: list[dict[str, Tensor]], d: Dims) -> dict[str, Tensor]:
    """A full Hugging Face state dict from the state dicts of all ``len(shards)`` tensor-parallel ranks."""
    out: dict[str, Tensor] = {}
    for part in conversion_parts(d):
        out.update(megatron_part_to_hf(shards, d, part))
    return out


def check_parallel_layout(hf_config, tp: int, world_size: int) -> None:
    """Pre-flight of a tensor-parallel run (before any weight loads): ``tp`` divides the attention heads, the
    key/value heads, the MLP width and the vocabulary of ``hf_config``, and the world size is a multiple of it."""
    Dims.from_hf_config(hf_config).check_tp(tp)
    if world_size % tp:
        raise ValueError(
            f"tensor_parallel_size: the world size {world_size} is not a multiple of tensor_parallel_size = {tp}"
        )
