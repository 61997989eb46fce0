"""The language-model head every backend and rescoring share: response log-probs, entropies, the fused head loss.

Legend: B = rows, Lp = padded prompt length (left-padded), L = padded response length (right-padded),
D = hidden size, V = vocabulary size (or this rank's shard of it), N = scored (unmasked) response tokens.

The hidden state at position ``t`` predicts token ``t + 1``, so the log-prob of response token ``j`` comes from
the hidden state of the position just before it. A backend runs its own forward and hands this module the
hidden states aligned with the response columns (``h_BUD``, U <= L used columns); :func:`scatter_response` takes
the N masked-in positions, runs one head function on them (the fused log-prob kernel, the fused head loss, or a
vocab-parallel head) and scatters the results back to ``[B, L]`` (0 at masked-out positions). No ``[B, T, V]``
logits tensor ever exists. Nothing here knows a backend: the Hugging Face backend, the Megatron backend and the
rescoring engine all import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from alignopsd.engine.policy.shared_prefix import plan_rows, takes, tree_inputs
from alignopsd.engine.policy.varlen_attention import (
    prefix_tree_on,
    prefix_tree_supported,
    varlen_attention_on,
    varlen_supported,
)
from alignopsd.engine.tokens.layout import position_ids
from alignopsd.kernels.head import fused_token_loss
from alignopsd.kernels.head import logprob as kernel_logprob
from torch import Tensor, nn

LossFn = Callable[[Tensor, Tensor | None], Tensor]
HeadFn = Callable[[Tensor, Tensor], tuple]


def token_logprobs(
    hidden_ND: Tensor,
    weight_VD: Tensor,
    targets_N: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    bias_V: Tensor | None = None,
    impl: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Fused log-prob head: ``log softmax(hidden @ weight.T / temperature)[targets]`` without [N, V] logits.

    hidden_ND: [N, D] final hidden states (after the final norm); weight_VD: [V, D] output embedding;
    targets_N: [N] token ids. Returns ([N] fp32 log-probs, [N] fp32 entropies or None).
    impl: the kernel's implementation (``alignopsd.kernels.head``: "auto" is Triton on CUDA, the tiled torch path on
    CPU; an unknown value is refused by the kernel).
    """
    if not temperature > 0:
        raise ValueError(f"temperature: must be > 0, got {temperature}")
    if int(hidden_ND.shape[0]) == 0:
        empty = hidden_ND.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    kw = {"bias": bias_V} if bias_V is not None else {}
    out = kernel_logprob(
        hidden_ND, weight_VD, targets_N, temperature=temperature, with_entropy=with_entropy, impl=impl, **kw
    )
    if with_entropy:
        logp, ent = out
        return logp.float(), ent.float()
    return (out[0] if isinstance(out, tuple) else out).float(), None


def logprob_head(model: nn.Module, *, temperature: float, with_entropy: bool = False, impl: str = "auto") -> HeadFn:
    """``head(h_ND, t_N) -> ([N] log-probs, [N] entropies or None)`` of ``model``'s LM head (:func:`token_logprobs`
    at ``temperature``), the head the row scorers hand to :func:`scatter_response`."""
    weight, bias = output_head(model)

    def head(h_ND: Tensor, t_N: Tensor) -> tuple[Tensor, Tensor | None]:
        return token_logprobs(
            h_ND, weight, t_N, temperature=temperature, with_entropy=with_entropy, bias_V=bias, impl=impl
        )

    return head


def fused_head_loss(
    hidden_ND: Tensor,
    weight_VD: Tensor,
    bias_V: Tensor | None,
    targets_N: Tensor,
    rmask_BL: Tensor,
    loss_fn: LossFn,
    loss_fill: Tensor | None,
    *,
    temperature: float,
    with_entropy: bool,
    group=None,
    vocab_start: int = 0,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """([N] log-probs, [N] entropies or None, zero-valued gradient carrier) through ``fused_token_loss``.

    ``loss_fn(logp_BL, ent_BL or None)`` must be a sum of per-token terms; it is evaluated once per token chunk
    with the other positions held at ``loss_fill`` ([B, L], default 0). ``group`` / ``vocab_start``:
    vocab-parallel head (this rank's shard of the output embedding)."""
    b, length = rmask_BL.shape
    pos_N = rmask_BL.reshape(-1).nonzero().squeeze(1)  # row-major: the order of hidden[mask]
    fill = torch.zeros(b * length, dtype=torch.float32, device=rmask_BL.device)
    if loss_fill is not None:
        if tuple(loss_fill.shape) != (b, length):
            raise ValueError(f"loss_fill: expected shape {(b, length)}, got {tuple(loss_fill.shape)}")
        fill = loss_fill.detach().to(fill.device, torch.float32).reshape(-1)
    zeros = torch.zeros(b * length, dtype=torch.float32, device=rmask_BL.device)

    def token_loss(lp_n: Tensor, ent_n: Tensor | None, idx_n: Tensor) -> Tensor:
        where = pos_N[idx_n.to(pos_N.device)]
        lp_BL = fill.index_put((where,), lp_n.to(fill.device)).view(b, length)
        ent_BL = zeros.index_put((where,), ent_n.to(fill.device)).view(b, length) if ent_n is not None else None
        return loss_fn(lp_BL, ent_BL)

    loss, lp_N, ent_N = fused_token_loss(
        hidden_ND,
        weight_VD,
        targets_N,
        token_loss,
        bias=bias_V,
        temperature=temperature,
        with_entropy=with_entropy,
        group=group,
        vocab_start=vocab_start,
    )
    return lp_N, ent_N, loss - loss.detach()


def scatter_response(h_BUD: Tensor, targets_BL: Tensor, rmask_BL: Tensor, head: HeadFn) -> tuple:
    """The slice-forward-scatter step: ``head`` on the masked-in response positions, results back to [B, L].

    h_BUD: [B, U, D] hidden states predicting response columns 0..U-1 (U <= L: columns that are padding in
    every row may be cut before the forward); targets_BL, rmask_BL: [B, L] response ids and mask (False past U).
    head(h_ND, targets_N) -> (logp_N, ent_N or None, *extra). Returns ([B, L] fp32 log-probs, [B, L] fp32
    entropies or None, *extra), 0 at masked-out positions.
    """
    used = int(h_BUD.shape[1])
    sel = rmask_BL[:, :used]
    logp_N, ent_N, *extra = head(h_BUD[sel], targets_BL[:, :used][sel])
    logp_BL = torch.zeros(rmask_BL.shape, dtype=torch.float32, device=rmask_BL.device)
    logp_BL = logp_BL.masked_scatter(rmask_BL, logp_N.float())
    ent_BL = None
    if ent_N is not None:
        ent_BL = torch.zeros_like(logp_BL).masked_scatter(rmask_BL, ent_N.float())
    return (logp_BL, ent_BL, *extra)


# ----------------------------------------------------------------------------------------------------------------------
# Hugging Face-format causal LMs (the policy, the reference model, the rescoring copy)
# ----------------------------------------------------------------------------------------------------------------------


def transformer_body(model: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM (``model.model`` for Llama/Qwen2), returning hidden states, not logits."""
    body = getattr(model, "model", None)
    if body is None and hasattr(model, "get_decoder"):
        body = model.get_decoder()
    if body is None:
        raise ValueError(f"model: cannot find the transformer body of {type(model).__name__} (no .model)")
    return body


def output_head(model: nn.Module) -> tuple[Tensor, Tensor | None]:
    """(weight [V, D], bias [V] or None) of the LM head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"model: {type(model).__name__} has no output embedding (LM head)")
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "final_logit_softcapping", None):
        raise ValueError("model: final_logit_softcapping is not supported by the fused log-prob head")
    return head.weight, getattr(head, "bias", None)


def _check_rows(prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor) -> None:
    if prompt_ids.dim() != 2 or prompt_ids.shape != prompt_mask.shape:
        raise ValueError(f"prompt_mask: expected the shape of prompt_ids {tuple(prompt_ids.shape)}")
    if response_ids.dim() != 2 or response_ids.shape != response_mask.shape:
        raise ValueError(f"response_mask: expected the shape of response_ids {tuple(response_ids.shape)}")
    if prompt_ids.shape[0] != response_ids.shape[0]:
        raise ValueError(f"response_ids: {response_ids.shape[0]} rows, prompt_ids has {prompt_ids.shape[0]}")
    if prompt_ids.shape[1] == 0 or not bool(prompt_mask[:, -1].bool().all()):
        raise ValueError("prompt_mask: every prompt must be non-empty and left-padded (last column attended)")


def packable(response_mask: Tensor) -> bool:
    """Whether packed rows give the padded forward's results: no response row has a masked column followed by an
    attended one (right padding only)."""
    m = response_mask.bool()
    return not bool((m[:, 1:] & ~m[:, :-1]).any()) if m.shape[1] > 1 else True


def packed_inputs(ids_BT: Tensor, mask_BT: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Padding-free rows: (``[1, N]`` ids of the attended positions of ``ids_BT``, row after row; ``[1, N]`` position
    ids restarting at 0 in every row; ``[B, T]`` slot of each attended position in the packed sequence). Built with
    tensor operations on the rows' device (one size read: N)."""
    keep = mask_BT.bool()
    flat = keep.reshape(-1)
    slot = flat.long().cumsum(0).sub_(1).view_as(keep)
    sel = flat.nonzero().squeeze(1)
    ids = ids_BT.reshape(-1).index_select(0, sel).unsqueeze(0)
    pos = position_ids(keep).reshape(-1).index_select(0, sel).unsqueeze(0)
    return ids, pos, slot


def packed_forward(body: nn.Module, ids_1N: Tensor, pos_1N: Tensor):
    """The transformer body's forward of one packed sequence: on the CPU each row's attention on its own where the
    model allows it (engine/policy/varlen_attention.py), else transformers' own (its block-diagonal mask)."""
    if varlen_supported(body):
        with varlen_attention_on(body):
            return body(input_ids=ids_1N, attention_mask=None, position_ids=pos_1N, use_cache=False)
    return body(input_ids=ids_1N, attention_mask=None, position_ids=pos_1N, use_cache=False)


def tree_forward(body: nn.Module, ids_1N: Tensor, pos_1N: Tensor):
    """The transformer body's forward of one packed prefix-tree sequence (engine/policy/shared_prefix.py
    ``tree_inputs``) under the prefix tree's attention (engine/policy/varlen_attention.py)."""
    with prefix_tree_on(body):
        return body(input_ids=ids_1N, attention_mask=None, position_ids=pos_1N, use_cache=False)


@dataclass(frozen=True)
class ScoredRows:
    """What :func:`score_rows` returns: ``logp`` [B, L] fp32 log-probs (0 at masked-out positions), ``entropy``
    [B, L] fp32 or None, ``pushed`` token positions the forward pushed through the model, ``shared`` positions it
    did not push because rows shared their prompt prefix (0 unless the prefix-tree layout was taken), ``carrier``
    the fused head loss's zero-valued gradient carrier (None without ``loss_fn``)."""

    logp: Tensor
    entropy: Tensor | None
    pushed: int
    shared: int = 0
    carrier: Tensor | None = None


def _hidden_rows(body, ids: Tensor, mask: Tensor, lp: int, lr_used: int, packed: bool, share: bool):
    """(``[B, U, D]`` hidden states predicting the response columns, positions pushed, positions shared) of the
    trimmed rows ``ids``/``mask`` (prompt width ``lp``): padded, packed, or as a prefix tree (engine/policy/
    shared_prefix.py) where ``share`` and the tree saves enough over the other two (``takes``)."""
    b = int(ids.shape[0])
    plan = None
    if share and prefix_tree_supported(body):
        plan = plan_rows(ids, mask, lp)
        plan = plan if plan.saved and takes(plan, plan.row_tokens if packed else int(ids.numel())) else None
    if plan is not None or packed:
        if plan is not None:
            ids_1N, pos_1N, slot_BT = tree_inputs(ids, mask, plan)
            hidden = tree_forward(body, ids_1N, pos_1N)
        else:
            ids_1N, pos_1N, slot_BT = packed_inputs(ids, mask)
            hidden = packed_forward(body, ids_1N, pos_1N)
        h_ND = hidden.last_hidden_state if hasattr(hidden, "last_hidden_state") else hidden[0]
        h_BUD = h_ND[0][slot_BT[:, lp - 1 : lp - 1 + lr_used]]  # each response column's predicting position
        return h_BUD, int(ids_1N.shape[1]), plan.saved if plan is not None else 0
    hidden = body(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False)
    hidden_BTD = hidden.last_hidden_state if hasattr(hidden, "last_hidden_state") else hidden[0]
    return hidden_BTD[:, lp - 1 : lp - 1 + lr_used], b * int(ids.shape[1]), 0


def score_rows(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    impl: str = "auto",
    loss_fn: LossFn | None = None,
    loss_fill: Tensor | None = None,
    packed: bool = False,
    share: bool = False,
) -> ScoredRows:
    """One forward of ``[prompt | response]`` rows of a Hugging Face causal LM (:class:`ScoredRows`: log-probs,
    entropies, the positions pushed and shared, the fused loss's carrier).

    prompt_ids/prompt_mask: [B, Lp] left-padded; response_ids/response_mask: [B, L] right-padded. Columns
    that are padding in every row are trimmed before the forward; the output keeps the full width L.

    ``packed``: padding-free rows (:func:`packed_inputs`): the attended positions of all rows in one sequence whose
    position ids restart at 0 in every row, so the model's attention (Hugging Face builds a block-diagonal causal
    mask from such position ids for SDPA and eager attention, and flash attention's variable-length path reads them)
    keeps each row to itself and no position of padding is computed; the counted positions are the attended ones.
    Taken when more than one row and every response mask has no hole (a masked column between attended ones:
    the position before an attended response token must itself be attended); otherwise the padded forward.
    A policy's forwards pass its ``RowLayout.packs()`` (engine/policy/base.py: configured, or measured by the update
    on its own micro-batches, engine/step/packing_trial.py).

    ``share``: under the same conditions, rows whose prompts share a prefix push it once, in a packed prefix tree
    (engine/policy/shared_prefix.py), where the model runs its attention (the CPU) and it saves at least
    ``shared_prefix.MIN_SAVED`` of the positions the padded or packed forward would push; a policy passes its
    ``RowLayout.shares()``. The results are the unshared forward's (fp32, 1e-5), gradients included.

    Fused loss: with ``loss_fn(logp_BL, ent_BL or None) -> scalar`` the head goes through
    :func:`fused_head_loss` (gradients formed with the log-probs: three head matmuls instead of four) and
    ``carrier`` is a zero-valued scalar carrying ``loss_fn``'s gradient (add it to the loss value, or call
    ``backward`` on it); the returned log-probs/entropies are then detached.
    """
    _check_rows(prompt_ids, prompt_mask, response_ids, response_mask)
    b, lr = response_ids.shape
    rmask = response_mask.bool()
    cols = rmask.any(0).nonzero()
    if cols.numel() == 0 or b == 0:
        logp_BL = torch.zeros(b, lr, dtype=torch.float32, device=response_ids.device)
        ent_BL = torch.zeros_like(logp_BL) if with_entropy else None
        carrier = torch.zeros((), device=response_ids.device) if loss_fn is not None else None
        return ScoredRows(logp_BL, ent_BL, 0, carrier=carrier)
    lr_used = int(cols.max()) + 1
    start = int(prompt_mask.bool().any(0).nonzero().min())
    p_ids, p_mask = prompt_ids[:, start:], prompt_mask[:, start:].long()
    lp = int(p_ids.shape[1])
    ids = torch.cat([p_ids, response_ids[:, : lr_used - 1]], dim=1)
    mask = torch.cat([p_mask, response_mask[:, : lr_used - 1].long()], dim=1)
    body = transformer_body(model)
    free = b > 1 and (packed or share) and packable(rmask)  # the choice first: packable reads the mask on the host
    h_BUD, pushed, shared = _hidden_rows(body, ids, mask, lp, lr_used, free and packed, free and share)
    weight, bias = output_head(model)
    if loss_fn is not None:

        def head(h_ND, t_N):
            return fused_head_loss(
                h_ND, weight, bias, t_N, rmask, loss_fn, loss_fill, temperature=temperature, with_entropy=with_entropy
            )

        logp_BL, ent_BL, carrier = scatter_response(h_BUD, response_ids, rmask, head)
        return ScoredRows(logp_BL, ent_BL, pushed, shared, carrier)

    def head(h_ND, t_N):
        return token_logprobs(
            h_ND, weight, t_N, temperature=temperature, with_entropy=with_entropy, bias_V=bias, impl=impl
        )

    logp_BL, ent_BL = scatter_response(h_BUD, response_ids, rmask, head)
    return ScoredRows(logp_BL, ent_BL, pushed, shared)
