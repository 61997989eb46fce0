"""fp32 master weights for a low-precision (bf16/fp16) Hugging Face policy.

AdamW run directly on bf16 parameters loses every update smaller than half a bf16 ulp of the weight
(about 0.2% of its magnitude): at the paper profiles' learning rate of 1e-6 that is most of them. The
standard remedy (Megatron's ``Float16OptimizerWithFloat16Params``, apex/DeepSpeed "master weights") is
kept here for the Hugging Face backend:

- the model keeps its low-precision parameters (forward and backward in bf16/fp16);
- :class:`MasterAdamW` holds an fp32 copy (the *master*) of every trainable parameter and runs AdamW on
  those, so its moments are fp32 too;
- gradients are accumulated in fp32 (as megatron-core's ``main_grad``): after each backward pass (one per
  micro-batch) a hook on every model parameter adds its low-precision ``.grad`` into the master's fp32
  ``.grad`` and frees the low-precision one, so the sum over micro-batches is an fp32 sum; under data
  parallelism the average over ranks is taken on these fp32 buffers (:meth:`MasterAdamW.all_reduce_grads`),
  never on bf16 gradients;
- at each optimizer step the masters are clipped and stepped, and the model's parameters are refreshed from
  them (:meth:`MasterAdamW.masters_to_model`, round to nearest).

Small updates therefore accumulate in the masters until they move the rounded weight. ``state_dict()``
carries the masters (key ``master_params``) beside AdamW's state so that a resumed run continues from the
exact fp32 weights; a state dict without them (an fp32 run, or older code) re-seeds the masters from the
model's current parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

LOW_PRECISION = (torch.bfloat16, torch.float16)


def needs_master_weights(params: Iterable[Tensor]) -> bool:
    """True when any of ``params`` is bf16/fp16 (then the optimizer should step fp32 masters)."""
    return any(p.dtype in LOW_PRECISION for p in params)


class MasterAdamW(torch.optim.AdamW):
    """AdamW stepping fp32 masters of ``model_params`` (keyword arguments: those of ``torch.optim.AdamW``).

    The optimizer's own ``param_groups`` hold the masters, so learning-rate schedulers and
    ``state_dict``/``load_state_dict`` work as for a plain AdamW. Each backward adds the model's gradients into
    the masters' fp32 ``.grad`` (a post-accumulate-grad hook per parameter; the model's ``.grad`` stays None).
    Call :meth:`grads_to_masters` after the backward passes and before clipping (clip ``masters``), then
    ``step()``, then :meth:`masters_to_model`.
    """

    def __init__(self, model_params: Iterable[Tensor], **adamw_kwargs: Any) -> None:
        self.model_params = list(model_params)
        if not self.model_params:
            raise ValueError("model_params: no trainable parameter")
        self.masters = [p.detach().to(torch.float32, copy=True) for p in self.model_params]
        super().__init__(self.masters, **adamw_kwargs)
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulate(m)) for p, m in self._pairs()]

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the model's parameters (an optimizer started afresh replaces this one)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _pairs(self) -> list[tuple[Tensor, Tensor]]:
        return list(zip(self.model_params, self.masters))

    @staticmethod
    def _accumulate(master: Tensor):
        """The hook of one parameter: add its fresh low-precision gradient into ``master.grad`` (fp32)."""

        @torch.no_grad()
        def hook(p: Tensor) -> None:
            if master.grad is None:
                master.grad = p.grad.to(torch.float32, copy=True)
            else:
                master.grad.add_(p.grad)  # upcast inside the add: the sum is an fp32 sum
            p.grad = None

        return hook

    @torch.no_grad()
    def grads_to_masters(self) -> list[Tensor]:
        """The masters' fp32 gradients (None where no backward reached the parameter). A gradient still in a
        model parameter's ``.grad`` (one written without a backward pass) is added in first."""
        for p, m in self._pairs():
            if p.grad is not None:
                m.grad = p.grad.to(torch.float32, copy=True) if m.grad is None else m.grad.add_(p.grad)
                p.grad = None
        return [m.grad for m in self.masters if m.grad is not None]

    @torch.no_grad()
    def all_reduce_grads(self, group=None, bucket_elements: int = 1 << 25) -> None:
        """Average the masters' fp32 gradients over the ranks of ``group`` (the data-parallel all-reduce).

        Every rank holds a buffer for every master (zeros where no backward reached it), so the collectives
        line up; the buffers go over the wire in buckets of at most ``bucket_elements`` fp32 values, on the
        masters' device (the GPU under NCCL). A gradient still in a model parameter's ``.grad`` is folded into
        its master first, so it is averaged with the others (not added on one rank after the average)."""
        import torch.distributed as dist

        self.grads_to_masters()
        world = dist.get_world_size(group)
        for m in self.masters:
            if m.grad is None:
                m.grad = torch.zeros_like(m)
        bucket: list[Tensor] = []
        for i, m in enumerate(self.masters):
            bucket.append(m.grad)
            if (
                i == len(self.masters) - 1
                or sum(g.numel() for g in bucket) + self.masters[i + 1].numel() > bucket_elements
            ):
                flat = torch.cat([g.reshape(-1) for g in bucket])
                dist.all_reduce(flat, group=group)
                flat.div_(world)
                off = 0
                for g in bucket:
                    g.copy_(flat[off : off + g.numel()].view_as(g))
                    off += g.numel()
                bucket = []

    @torch.no_grad()
    def masters_to_model(self) -> None:
        """Refresh the model's low-precision parameters from the masters (round to nearest)."""
        for p, m in zip(self.model_params, self.masters):
            p.copy_(m)

    @torch.no_grad()
    def masters_from_model(self) -> None:
        """Re-seed the masters from the model's current parameters (after weights were loaded into the model
        without an optimizer state: else the next step would write the old masters back over them)."""
        for p, m in self._pairs():
            m.copy_(p)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the masters' and the model's gradients."""
        super().zero_grad(set_to_none=set_to_none)
        for p in self.model_params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["master_params"] = [m.detach().clone() for m in self.masters]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = dict(state_dict)
        saved = sd.pop("master_params", None)
        super().load_state_dict(sd)
        if saved is None:  # saved without masters: start them from the (already loaded) model weights
            self.masters_from_model()
            return
        with torch.no_grad():
            if len(saved) != len(self.masters):
                raise ValueError(
                    f"state_dict: master_params has {len(saved)} tensors, the optimizer has {len(self.masters)}"
                )
            for i, (m, s) in enumerate(zip(self.masters, saved)):
                if tuple(s.shape) != tuple(m.shape):
                    raise ValueError(
                        f"state_dict: master_params[{i}] has shape {tuple(s.shape)}, expected {tuple(m.shape)}"
                    )
                m.copy_(s)
