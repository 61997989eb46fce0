"""Hugging Face policy backend: log-probs of response tokens through the fused log-prob head, AdamW updates.

Legend: B = rows, Lp = padded prompt length (left-padded), L = padded response length (right-padded),
T = Lp + L, D = hidden size, V = vocabulary size, N = scored (unmasked) response tokens.

The model input of a row is ``[prompt | response]``. The hidden state at position ``t`` predicts token
``t + 1``, so the log-prob of response token ``j`` comes from the hidden state of the position just before
it: the last prompt position for ``j = 0``. The last response token is never pushed through the model
(nothing it predicts is scored). Log-probs are taken only at the N masked-in response positions, through
``token_logprobs`` (``alignopsd.kernels.logprob`` when it is available, a chunked torch head otherwise), so
no ``[B, T, V]`` logits tensor ever exists. Masked-out response positions get log-prob 0 and entropy 0.

Distributed: when ``torch.distributed`` is initialised (gloo on CPU, NCCL on CUDA) and ``ddp=True``, the
scoring module (transformer body + head) of an fp32 model is wrapped in ``DistributedDataParallel``, so
gradients are averaged across ranks at each backward; use ``no_sync()`` for all but the last micro-batch of an
update. A bf16/fp16 model is not wrapped: its gradients accumulate in fp32 buffers (``MasterAdamW``) and are
averaged over ranks in fp32 once per optimizer step (a bf16 all-reduce would round every summand).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from alignopsd.engine.parallel import devices
from alignopsd.engine.policy.base import check_loss_fn, prompt_width
from alignopsd.engine.policy.mixed_precision import MasterAdamW, needs_master_weights
from alignopsd.engine.step.batch import position_ids
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)

LossFn = Callable[[Tensor, Tensor | None], Tensor]

# Logits of one chunk of the chunked head hold at most this many elements (2^25 fp32 = 128 MiB):
# with SmolLM2's V = 49152 that is 682 tokens per chunk.
_HEAD_CHUNK_ELEMENTS = 1 << 25


# ----------------------------------------------------------------------------------------------------------------------
# fused log-prob head
# ----------------------------------------------------------------------------------------------------------------------


def _chunk_logprob(
    hidden_CD: Tensor, weight_VD: Tensor, bias_V: Tensor | None, targets_C: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    """(log-prob [C], entropy [C]) of one chunk; the [C, V] logits live only inside this call."""
    logits_CV = hidden_CD @ weight_VD.t()
    if bias_V is not None:
        logits_CV = logits_CV + bias_V
    logits_CV = logits_CV.float() / temperature
    lse_C = torch.logsumexp(logits_CV, dim=-1)
    logp_C = logits_CV.gather(-1, targets_C[:, None]).squeeze(-1) - lse_C
    probs_CV = torch.softmax(logits_CV, dim=-1)
    ent_C = lse_C - (probs_CV * logits_CV).sum(-1)
    return logp_C, ent_C


def chunked_token_logprobs(
    hidden_ND: Tensor,
    weight_VD: Tensor,
    targets_N: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    bias_V: Tensor | None = None,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Torch reference of the fused head: fp32 log-probs (and entropies) of ``targets_N``.

    Processes ``chunk_size`` tokens at a time; with autograd on, each chunk is checkpointed so its [C, V]
    logits are recomputed in backward instead of being kept.
    """
    n = int(hidden_ND.shape[0])
    if chunk_size is None:
        chunk_size = max(1, _HEAD_CHUNK_ELEMENTS // max(1, int(weight_VD.shape[0])))
    need_grad = torch.is_grad_enabled() and (hidden_ND.requires_grad or weight_VD.requires_grad)
    logps, ents = [], []
    for s in range(0, n, chunk_size):
        h = hidden_ND[s : s + chunk_size]
        tg = targets_N[s : s + chunk_size]
        if need_grad:
            lp, en = checkpoint(_chunk_logprob, h, weight_VD, bias_V, tg, temperature, use_reentrant=False)
        else:
            lp, en = _chunk_logprob(h, weight_VD, bias_V, tg, temperature)
        logps.append(lp)
        ents.append(en)
    if n == 0:
        empty = hidden_ND.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    logp_N = torch.cat(logps)
    return logp_N, (torch.cat(ents) if with_entropy else None)


def _kernel_logprob():
    """The kernels package's fused head, or None when it is not there (then the chunked torch head is used)."""
    try:
        mod = importlib.import_module("alignopsd.kernels.logprob")
    except ImportError:
        return None
    fn = getattr(mod, "logprob", None)
    if fn is None or not callable(fn):
        return None
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if not {"temperature", "with_entropy", "bias"} <= set(params):
        return None
    return fn


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
    impl: "auto" (``alignopsd.kernels.logprob`` when importable: Triton on CUDA, its tiled torch path on CPU;
    else "chunked") | "kernel" (require the kernels package) | "chunked" (this module's checkpointed torch head).
    """
    if not temperature > 0:
        raise ValueError(f"temperature: must be > 0, got {temperature}")
    if impl not in ("auto", "kernel", "chunked"):
        raise ValueError(f"impl: expected 'auto', 'kernel' or 'chunked', got {impl!r}")
    fn = None if impl == "chunked" else _kernel_logprob()
    if impl == "kernel" and fn is None:
        raise ValueError("impl: 'kernel' requested but alignopsd.kernels.logprob is not available")
    if fn is not None and int(hidden_ND.shape[0]) > 0:
        kw = {"bias": bias_V} if bias_V is not None else {}
        out = fn(hidden_ND, weight_VD, targets_N, temperature=temperature, with_entropy=with_entropy, **kw)
        if with_entropy:
            logp, ent = out
            return logp.float(), ent.float()
        return (out[0] if isinstance(out, tuple) else out).float(), None
    return chunked_token_logprobs(
        hidden_ND, weight_VD, targets_N, temperature=temperature, with_entropy=with_entropy, bias_V=bias_V
    )


# ----------------------------------------------------------------------------------------------------------------------
# model pieces
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
) -> tuple[Tensor, Tensor | None, int] | tuple[Tensor, Tensor | None, int, Tensor]:
    """One forward of ``[prompt | response]`` rows; returns ([B, L] fp32 log-probs, [B, L] entropy or None,
    number of token positions pushed through the model).

    prompt_ids/prompt_mask: [B, Lp] left-padded; response_ids/response_mask: [B, L] right-padded. Columns
    that are padding in every row are trimmed before the forward; the output keeps the full width L.

    Fused loss: with ``loss_fn(logp_BL, ent_BL or None) -> scalar`` the head goes through
    ``alignopsd.kernels.fused_token_loss`` (gradients formed with the log-probs: three head matmuls instead
    of four) and a fourth output is returned: a zero-valued scalar carrying ``loss_fn``'s gradient (add it
    to the loss value, or call ``backward`` on it). ``loss_fn`` must be a sum of per-token terms (token-mean
    losses with fixed denominators are); it is evaluated once per token chunk with the other positions
    held at ``loss_fill`` ([B, L], default 0) and the returned log-probs/entropies are detached.
    """
    _check_rows(prompt_ids, prompt_mask, response_ids, response_mask)
    b, lr = response_ids.shape
    rmask = response_mask.bool()
    logp_BL = torch.zeros(b, lr, dtype=torch.float32, device=response_ids.device)
    ent_BL = torch.zeros_like(logp_BL) if with_entropy else None
    cols = rmask.any(0).nonzero()
    if cols.numel() == 0 or b == 0:
        if loss_fn is not None:
            return logp_BL, ent_BL, 0, torch.zeros((), device=response_ids.device)
        return logp_BL, ent_BL, 0
    lr_used = int(cols.max()) + 1
    start = int(prompt_mask.bool().any(0).nonzero().min())
    p_ids, p_mask = prompt_ids[:, start:], prompt_mask[:, start:].long()
    lp = int(p_ids.shape[1])
    ids = torch.cat([p_ids, response_ids[:, : lr_used - 1]], dim=1)
    mask = torch.cat([p_mask, response_mask[:, : lr_used - 1].long()], dim=1)
    body = transformer_body(model)
    hidden = body(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False)
    hidden_BTD = hidden.last_hidden_state if hasattr(hidden, "last_hidden_state") else hidden[0]
    h_BLD = hidden_BTD[:, lp - 1 : lp - 1 + lr_used]
    sel = rmask[:, :lr_used]
    weight, bias = output_head(model)
    if loss_fn is not None:
        carrier, lp_N, ent_N = fused_head_loss(
            h_BLD[sel], weight, bias, response_ids[:, :lr_used][sel], rmask, loss_fn, loss_fill,
            temperature=temperature, with_entropy=with_entropy,
        )  # fmt: skip
    else:
        lp_N, ent_N = token_logprobs(
            h_BLD[sel],
            weight,
            response_ids[:, :lr_used][sel],
            temperature=temperature,
            with_entropy=with_entropy,
            bias_V=bias,
            impl=impl,
        )
    logp_BL = logp_BL.masked_scatter(rmask, lp_N)
    if with_entropy:
        ent_BL = ent_BL.masked_scatter(rmask, ent_N)
    if loss_fn is not None:
        return logp_BL, ent_BL, int(ids.numel()), carrier
    return logp_BL, ent_BL, int(ids.numel())


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
    """(zero-valued gradient carrier, [N] log-probs, [N] entropies or None) through ``fused_token_loss``.

    ``group`` / ``vocab_start``: vocab-parallel head (this rank's shard of the output embedding)."""
    from alignopsd.kernels.fused_loss import fused_token_loss  # noqa: PLC0415

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
        hidden_ND, weight_VD, targets_N, token_loss, bias=bias_V, temperature=temperature,
        with_entropy=with_entropy, group=group, vocab_start=vocab_start,
    )  # fmt: skip
    return loss - loss.detach(), lp_N, ent_N


class ResponseScorer(nn.Module):
    """Wraps a causal LM so that one ``forward`` yields response log-probs (the unit DDP wraps)."""

    def __init__(self, model: nn.Module, impl: str = "auto") -> None:
        super().__init__()
        self.model = model
        self.impl = impl

    def forward(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        response_ids: Tensor,
        response_mask: Tensor,
        temperature: float = 1.0,
        with_entropy: bool = False,
        loss_fn: LossFn | None = None,
        loss_fill: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, Tensor]:
        out = score_rows(
            self.model,
            prompt_ids,
            prompt_mask,
            response_ids,
            response_mask,
            temperature=temperature,
            with_entropy=with_entropy,
            impl=self.impl,
            loss_fn=loss_fn,
            loss_fill=loss_fill,
        )
        if loss_fn is not None:
            return out[0], out[1], out[3]
        return out[0], out[1]


# ----------------------------------------------------------------------------------------------------------------------
# the backend
# ----------------------------------------------------------------------------------------------------------------------


def _split_rows(input_ids: Tensor, attention_mask: Tensor, response_length: int, device) -> tuple[Tensor, ...]:
    """(prompt ids, prompt mask, response ids, response mask) of validated ``[prompt | response]`` rows, moved to
    the model's ``device`` (the backend's device boundary)."""
    lp = prompt_width(input_ids, attention_mask, response_length)
    input_ids, attention_mask = devices.to_device(input_ids, device), devices.to_device(attention_mask, device)
    return input_ids[:, :lp], attention_mask[:, :lp], input_ids[:, lp:], attention_mask[:, lp:]


class HFPolicy:
    """A Hugging Face causal LM as the trained policy (``PolicyBackend``).

    model: a ``PreTrainedModel`` (Llama, Qwen2, ...) already on its device. lr, weight_decay, betas, eps:
    AdamW settings (weight decay applies to every trainable parameter, as in verl). warmup_steps: linear
    learning-rate warm-up over this many optimizer steps (0: constant). ddp: wrap in DistributedDataParallel
    when ``torch.distributed`` is initialised with more than one process. gradient_checkpointing: enable the
    model's activation checkpointing for training forwards. impl: fused-head implementation (see
    ``token_logprobs``).

    Precision: a model with bf16/fp16 parameters is trained with fp32 master weights (``MasterAdamW``:
    AdamW and its moments in fp32, the model's parameters refreshed from the masters after each step), so
    updates below the low-precision resolution accumulate instead of vanishing. fp32 models use a plain
    ``torch.optim.AdamW`` on their parameters.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float = 1e-6,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        warmup_steps: int = 0,
        ddp: bool = True,
        gradient_checkpointing: bool = False,
        impl: str = "auto",
    ) -> None:
        if not lr > 0:
            raise ValueError(f"lr: must be > 0, got {lr}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay: must be >= 0, got {weight_decay}")
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas: expected two values in [0, 1), got {betas}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps: must be >= 0, got {warmup_steps}")
        self.model = model
        if gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.scorer = ResponseScorer(model, impl=impl)
        self.distributed = bool(ddp and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
        self.params = [p for p in model.parameters() if p.requires_grad]
        adamw = dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
        self.master = needs_master_weights(self.params)
        self.module: nn.Module = self.scorer
        if self.distributed and self.master:  # fp32 gradient buffers, all-reduced at the optimizer step
            for t in [*model.parameters(), *model.buffers()]:  # the same start on every rank, as DDP makes it
                dist.broadcast(t.data, src=0)
        elif self.distributed:
            dev = next(model.parameters()).device
            kw: dict[str, Any] = {"device_ids": [dev.index]} if dev.type == "cuda" else {}
            self.module = nn.parallel.DistributedDataParallel(self.scorer, **kw)
        if self.master:
            self.optimizer: torch.optim.AdamW = MasterAdamW(self.params, **adamw)
        else:
            self.optimizer = torch.optim.AdamW(self.params, **adamw)
        self.warmup_steps = warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps > 0 else 1.0
        )
        self.steps = 0
        self.skipped_steps = 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def response_logprobs(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        response_length: int,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        grad: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """([B, L] fp32 log-probs of the last ``response_length`` columns, [B, L] entropy or None).

        input_ids/attention_mask: [B, T] rows ``[prompt (left-padded) | response (right-padded)]``.
        grad=True keeps the graph (training forward, through DDP when distributed).
        """
        args = (*_split_rows(input_ids, attention_mask, response_length, self.device), temperature, with_entropy)
        if grad:
            self.model.train()
            return self.module(*args)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                return self.scorer(*args)
        finally:
            self.model.train(was_training)

    supports_fused_loss = True
    """``response_loss`` is available: the head's gradients are formed with the log-probs (see ``score_rows``)."""

    def response_loss(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        response_length: int,
        loss_fn: LossFn,
        *,
        loss_fill: Tensor | None = None,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """Training forward through the fused head loss: ([B, L] log-probs, [B, L] entropy or None, carrier).

        ``loss_fn(logp_BL, ent_BL) -> scalar`` must be a sum of per-token terms; ``carrier`` is a zero-valued
        scalar whose gradient is ``loss_fn``'s (``(carrier * scale).backward()``); log-probs are detached.
        Goes through DDP when distributed, like ``response_logprobs(grad=True)``.
        """
        rows = _split_rows(input_ids, attention_mask, response_length, self.device)
        check_loss_fn(loss_fn)
        self.model.train()
        return self.module(*rows, temperature, with_entropy, loss_fn, loss_fill)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Skip the DDP gradient all-reduce (for all micro-batches but the last of an update). With fp32 master
        weights there is nothing to skip: the all-reduce runs once, at the optimizer step."""
        if self.distributed and not self.master:
            return self.module.no_sync()
        return contextlib.nullcontext()

    def gradients(self) -> list[Tensor]:
        """The accumulated gradients (the fp32 buffers with master weights, else ``.grad``), None skipped."""
        if self.master:
            return self.optimizer.grads_to_masters()
        return [p.grad for p in self.params if p.grad is not None]

    def grad_norm(self) -> float:
        grads = self.gradients()
        if not grads:
            return 0.0
        return float(torch.nn.utils.get_total_norm(grads, 2.0))

    def optimizer_step(self, max_grad_norm: float | None) -> dict:
        """Clip to ``max_grad_norm`` (None or <= 0: no clipping), step AdamW and the schedule, zero grads.

        A non-finite gradient norm skips the step (weights and optimizer state unchanged) with a warning.
        Returns {"grad_norm": float (before clipping), "skipped": bool, "lr": float}. With fp32 master
        weights the fp32 gradient buffers are used (averaged over data-parallel ranks first); norm, clipping and
        the step use the masters.
        """
        master = self.master
        params = self.optimizer.masters if master else self.params
        if master and self.distributed:
            self.optimizer.all_reduce_grads()
        grads = self.gradients()
        norm = float(torch.nn.utils.get_total_norm(grads, 2.0)) if grads else 0.0
        lr = float(self.optimizer.param_groups[0]["lr"])
        if not math.isfinite(norm):
            log.warning("optimizer step skipped: gradient norm is %s", norm)
            self.skipped_steps += 1
            self.zero_grad()
            return {"grad_norm": norm, "skipped": True, "lr": lr}
        if max_grad_norm is not None and max_grad_norm > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, torch.tensor(norm))
        self.optimizer.step()
        if master:
            self.optimizer.masters_to_model()
        self.scheduler.step()
        self.steps += 1
        self.zero_grad()
        return {"grad_norm": norm, "skipped": False, "lr": lr}

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        return self.model.named_parameters()

    def hf_state_dict(self) -> dict[str, Tensor]:
        """Full weights in Hugging Face layout (detached; tied weights appear under both names)."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(name, tensor) pairs of :meth:`hf_state_dict` for the generation engine (no copy is made)."""
        return iter(self.hf_state_dict().items())

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and schedule state for a checkpoint."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("model", "optimizer"):
            if key not in state:
                raise ValueError(f"state: missing {key!r}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        self.steps = int(state.get("steps", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
