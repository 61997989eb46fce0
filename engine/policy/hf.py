"""Hugging Face policy backend: log-probs of response tokens through the fused log-prob head, AdamW updates.

Legend: B = rows, Lp = padded prompt length (left-padded), L = padded response length (right-padded),
T = Lp + L, D = hidden size, V = vocabulary size, N = scored (unmasked) response tokens.

The model input of a row is ``[prompt | response]``. The hidden state at position ``t`` predicts token
``t + 1``, so the log-prob of response token ``j`` comes from the hidden state of the position just before
it: the last prompt position for ``j = 0``. The last response token is never pushed through the model
(nothing it predicts is scored). Log-probs are taken only at the N masked-in response positions, through
the shared LM head (engine/policy/lm_head.py: ``alignopsd.kernels.logprob``), so no ``[B, T, V]`` logits tensor
ever exists. Masked-out response positions get log-prob 0 and entropy 0.

Distributed: when ``torch.distributed`` is initialised (gloo on CPU, NCCL on CUDA) and ``ddp=True``, the
scoring module (transformer body + head) of an fp32 model is wrapped in ``DistributedDataParallel``, so
gradients are averaged across ranks at each backward; use ``no_sync()`` for all but the last micro-batch of an
update. A bf16/fp16 model is not wrapped: its gradients accumulate in fp32 buffers (``MasterAdamW``) and are
averaged over ranks in fp32 once per optimizer step (a bf16 all-reduce would round every summand).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from alignopsd.engine.parallel import devices
from alignopsd.engine.policy.base import (
    ParallelLayout,
    RowLayout,
    check_loss_fn,
    check_optimizer_settings,
    prompt_width,
)
from alignopsd.engine.policy.lm_head import LossFn, score_rows
from alignopsd.engine.policy.lora import LoraAdapter
from alignopsd.engine.policy.mixed_precision import MasterAdamW, needs_master_weights
from alignopsd.engine.policy.varlen_attention import prefix_tree_supported, recompute_as_run
from alignopsd.kernels.native_choice import pinned
from torch import Tensor, nn

log = logging.getLogger(__name__)


class ResponseScorer(nn.Module):
    """Wraps a causal LM so that one ``forward`` yields response log-probs (the unit DDP wraps)."""

    def __init__(self, model: nn.Module, rows: RowLayout, impl: str = "auto") -> None:
        super().__init__()
        self.model = model
        self.impl = impl
        self.rows = rows

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
            packed=self.rows.packs(),
            share=self.rows.shares(),
        )
        if loss_fn is not None:
            return out.logp, out.entropy, out.carrier
        return out.logp, out.entropy


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

    adapter: LoRA adapters injected into ``model`` (engine/policy/lora.py; ``model`` is then ``adapter.model``):
    only the adapters train (fp32, a plain AdamW: they are their own fp32 masters), :meth:`hf_state_dict` and
    :meth:`hf_weights` give the merged weights, and checkpoints hold the adapter (:attr:`adapter`).

    packed: forwards in padding-free rows (engine/policy/lm_head.py ``score_rows``): True, False, or None for where
    measured faster here (:attr:`rows`, a :class:`~alignopsd.engine.policy.base.RowLayout`, holds it and the
    measured choice). Unless False, rows sharing a prompt prefix push it once where it pays (``RowLayout.shares``,
    engine/policy/shared_prefix.py), on a model whose attention the prefix tree replaces (the CPU).
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
        adapter: LoraAdapter | None = None,
        packed: bool | None = False,
    ) -> None:
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas: expected two values in [0, 1), got {betas}")
        check_optimizer_settings(lr, weight_decay, warmup_steps)
        if adapter is not None and adapter.model is not model:
            raise ValueError("adapter: must be the LoRA adapter injected into this model (adapter.model is model)")
        self.adapter = adapter
        self.model = model
        self.hf_config = getattr(model, "config", None)
        self.hf_model = model
        if gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            # recomputed under the attention each forward ran (a packed forward's row-by-row attention)
            context_fn = functools.partial(recompute_as_run, model.config)
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": context_fn}
            )
        # shared prompt prefixes pushed once where the model runs the prefix tree's attention and rows are not padded
        # by configuration (nor pinned to the torch paths: ALIGNOPSD_CPU_PATHS=torch)
        self.rows = RowLayout(
            packed, share_prefixes=packed is not False and prefix_tree_supported(model) and not pinned()
        )
        self.scorer = ResponseScorer(model, self.rows, impl=impl)
        self.distributed = bool(ddp and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
        self.layout = (
            ParallelLayout(dp_rank=dist.get_rank(), dp_size=dist.get_world_size())
            if self.distributed
            else ParallelLayout()
        )
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.betas, self.eps = betas, eps
        self.master = needs_master_weights(self.params)
        self.module: nn.Module = self.scorer
        if self.distributed and self.master:  # fp32 gradient buffers, all-reduced at the optimizer step
            for t in [*model.parameters(), *model.buffers()]:  # the same start on every rank, as DDP makes it
                dist.broadcast(t.data, src=0)
        elif self.distributed:
            dev = next(model.parameters()).device
            kw: dict[str, Any] = {"device_ids": [dev.index]} if dev.type == "cuda" else {}
            self.module = nn.parallel.DistributedDataParallel(self.scorer, **kw)
        self.optimizer: torch.optim.AdamW | None = None
        self.reset_optimizer(lr=lr, weight_decay=weight_decay, warmup_steps=warmup_steps)

    def reset_optimizer(self, *, lr: float, weight_decay: float, warmup_steps: int) -> None:
        """AdamW (over fp32 masters where the policy keeps them, seeded from the current weights), its warm-up
        schedule and the step counters, started afresh: what a policy built from these weights starts with."""
        check_optimizer_settings(lr, weight_decay, warmup_steps)
        if self.optimizer is not None and self.master:
            self.optimizer.remove_hooks()  # the old masters stop collecting gradients
        adamw = dict(lr=lr, weight_decay=weight_decay, betas=self.betas, eps=self.eps)
        if self.master:
            self.optimizer = MasterAdamW(self.params, **adamw)
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
            self.optimizer.all_reduce_grads()  # folds any leftover low-precision .grad into the masters first
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
        """Full weights in Hugging Face layout (detached; tied weights appear under both names); with LoRA the
        merged weights (base + adapter)."""
        if self.adapter is not None:
            return self.adapter.merged_state_dict()
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(name, tensor) pairs of :meth:`hf_state_dict` for the generation engine (no copy is made, but the
        merged targeted weights of a LoRA policy)."""
        if self.adapter is not None:
            return self.adapter.merged_weights()
        return iter(self.hf_state_dict().items())

    def load_hf_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load full Hugging Face weights into the model (a tied ``lm_head`` may be absent); fp32 master weights
        are re-seeded from them (else the next step would write the old masters back over them). With LoRA they
        become the base and the adapters are reset to zero (the model then computes exactly these weights)."""
        if self.adapter is not None:
            missing, unexpected = self.adapter.load_merged(state)
        else:
            missing, unexpected = self.model.load_state_dict(state, strict=False)
        bad = [k for k in missing if "lm_head" not in k]
        if bad or unexpected:
            raise ValueError(f"weights do not match the model (missing {bad[:3]}, unexpected {unexpected[:3]})")
        if self.master:
            self.optimizer.masters_from_model()

    def optimizer_state(self) -> dict[str, Any]:
        """AdamW (with the fp32 masters when there are any), schedule and step counters."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`optimizer_state`'s state; a state without masters (an fp32 run's) seeds them from the
        loaded weights."""
        if "optimizer" not in state:
            raise ValueError(f"optimizer state: no 'optimizer' entry (keys {sorted(state)[:5]}; another backend's?)")
        self.optimizer.load_state_dict(state["optimizer"])
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        self.steps = int(state.get("steps", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))

    scores_itself = False
    """The rescorer scores with :attr:`model` directly (``PolicyBackend.scores_itself``)."""

    def prefix_logprobs(self, *rows, **kw):
        raise TypeError(
            f"{type(self).__name__} scores no packed rows itself (scores_itself is False): score its model directly"
        )

    sharded_checkpoint = False
    """Checkpoints hold the full weights and :meth:`optimizer_state` (every rank holds the whole model)."""

    def local_state(self) -> dict[str, Tensor]:
        return self.hf_state_dict()

    def save_checkpoint(self, path) -> None:
        raise TypeError(f"{type(self).__name__} has no sharded checkpoint (sharded_checkpoint is False): {path}")

    def load_checkpoint(self, path, *, verify: bool = True) -> None:
        raise TypeError(
            f"{path} is a sharded checkpoint; the Hugging Face backend cannot load it (resume with the backend that "
            "wrote it, or start a new run from its model.safetensors)"
        )
