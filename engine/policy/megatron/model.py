"""megatron-core ``GPTModel`` built from a Hugging Face config (Llama and Qwen2 families).

Legend: B = rows, T = tokens per row, D = hidden size, hn = head dim.

RoPE, RMSNorm, SwiGLU, grouped-query attention, Qwen2's QKV bias, tied or untied embeddings.
Rows are ``[prompt (left-padded) | response (right-padded)]`` as everywhere in the engine; the
rotary phases follow each row's own position ids (cumulative attended tokens minus one), so the
scores equal the Hugging Face model's on padded rows too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from alignopsd.engine.policy.megatron.convert import Dims
from alignopsd.engine.tokens.layout import position_ids
from torch import Tensor


def transformer_engine_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def layer_spec(kind: str = "auto"):
    """megatron-core's own layer spec: "local" (plain torch) or "te" (Transformer Engine, CUDA)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs  # noqa: PLC0415

    if kind not in ("auto", "local", "te"):
        raise ValueError(f"layer_spec: expected 'auto', 'local' or 'te', got {kind!r}")
    if kind == "auto":
        kind = "te" if transformer_engine_available() else "local"
    if kind == "te":
        if not transformer_engine_available():
            raise ValueError("layer_spec: 'te' needs transformer_engine and CUDA")
        return "te", specs.get_gpt_layer_with_transformer_engine_spec()
    return "local", specs.get_gpt_layer_local_spec(normalization="RMSNorm")


def rope_settings(hf_config) -> tuple[float, str]:
    """(rope theta, rope type) from a Hugging Face config (``rope_parameters`` in transformers 5,
    ``rope_theta`` / ``rope_scaling`` before)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("rope_theta: not found in the Hugging Face config")
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return float(theta), str(kind)


RECOMPUTE = ("none", "full", "selective")


def recompute_settings(recompute: str) -> dict:
    """TransformerConfig fields of an activation-recomputation choice: ``none``; ``full`` (each transformer
    layer keeps only its input and is recomputed in the backward pass, one layer per checkpoint); ``selective``
    (only the core attention is recomputed)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute: expected one of {RECOMPUTE}, got {recompute!r}")
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    return {}


def transformer_config(hf_config, tp: int, params_dtype: torch.dtype = torch.float32, recompute: str = "none"):
    """A megatron ``TransformerConfig`` equivalent to ``hf_config`` at tensor-parallel size ``tp``, with the
    activation recomputation ``recompute`` (see :func:`recompute_settings`)."""
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415

    _, rope_kind = rope_settings(hf_config)
    if rope_kind != "default":
        raise ValueError(f"rope_scaling: rope type {rope_kind!r} is not supported by the megatron backend")
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act: expected 'silu' (SwiGLU), got {act!r}")
    d = Dims.from_hf_config(hf_config)
    d.check_tp(tp)
    cuda = torch.cuda.is_available()
    return TransformerConfig(
        num_layers=d.num_layers,
        hidden_size=d.hidden,
        num_attention_heads=d.heads,
        num_query_groups=d.groups,
        ffn_hidden_size=d.ffn,
        kv_channels=d.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=d.qkv_bias,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=not cuda,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # Weights always come from a Hugging Face checkpoint, but initialisation also tags each
        # parameter with its tensor-parallel attributes (the gradient norm needs them).
        perform_initialization=True,
        **recompute_settings(recompute),
    )


def build_gpt_model(
    hf_config, tp: int, params_dtype: torch.dtype = torch.float32, spec: str = "auto", recompute: str = "none"
):
    """(GPTModel for this rank, spec kind). ``parallel_state`` must already be initialised."""
    from megatron.core.models.gpt import GPTModel  # noqa: PLC0415

    cfg = transformer_config(hf_config, tp, params_dtype, recompute)
    kind, layer = layer_spec(spec)
    d = Dims.from_hf_config(hf_config)
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=layer,
        vocab_size=d.vocab,
        max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
        position_embedding_type="rope",
        rotary_base=int(rope_settings(hf_config)[0]),
        share_embeddings_and_output_weights=d.tied,
        parallel_output=True,
    )
    if torch.cuda.is_available():
        model = model.cuda()
    return model, kind


def te_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Local-spec names -> Transformer Engine spec names (its norms are fused into the next linear)."""
    out = {}
    for k, v in state.items():
        k = k.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
        k = k.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
        out[k] = v
    return out


def local_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {}
    for k, v in state.items():
        if k.endswith("_extra_state"):
            continue
        k = k.replace("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
        k = k.replace("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight")
        out[k] = v
    return out


def forward_hidden(model, input_ids: Tensor, attention_mask: Tensor, padding_idx: int | None = None) -> Tensor:
    """[B, T, D] final hidden states (after the final norm) of ``model`` (a GPTModel) for padded rows.

    ``padding_idx``: the Hugging Face embedding's ``padding_idx`` (the config's ``pad_token_id``): as in
    ``nn.Embedding(padding_idx=...)``, looking that token up passes no gradient to its embedding row (with tied
    embeddings the row still learns through the output head), so both backends train the same weights."""
    t = int(input_ids.shape[1])
    causal_TT = torch.triu(torch.ones(t, t, dtype=torch.bool, device=input_ids.device), diagonal=1)
    masked_B1TT = causal_TT[None, None] | ~attention_mask.bool()[:, None, None, :]
    return forward_layout(model, input_ids, position_ids(attention_mask), masked_B1TT, padding_idx)


def forward_layout(
    model, input_ids: Tensor, pos_BT: Tensor, masked_B1TT: Tensor, padding_idx: int | None = None
) -> Tensor:
    """[B, T, D] final hidden states of ``model`` for any attention layout: token t of row b sits at position
    ``pos_BT[b, t]`` (its rotary phase) and attends to key k unless ``masked_B1TT[b, 0, t, k]`` (True = blocked).
    ``padding_idx``: as in :func:`forward_hidden`."""
    emb_TBD = model.embedding(input_ids=input_ids, position_ids=pos_BT)
    if padding_idx is not None and torch.is_grad_enabled():
        pad_TB1 = (input_ids == padding_idx).t().unsqueeze(-1)
        emb_TBD = torch.where(pad_TB1, emb_TBD.detach(), emb_TBD)
    rope_S11h = model.rotary_pos_emb(int(pos_BT.max()) + 1)
    rope_TB1h = rope_S11h[:, 0, 0, :][pos_BT.t()].unsqueeze(2)
    hidden_TBD = model.decoder(hidden_states=emb_TBD, attention_mask=masked_B1TT, rotary_pos_emb=rope_TB1h)
    return hidden_TBD.transpose(0, 1)


def output_weight(model) -> Tensor:
    """This rank's vocabulary shard of the output head [V/tp, D] (the embedding when tied)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight
