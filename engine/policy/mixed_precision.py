"""fp32 master weights for a low-precision (bf16/fp16) Hugging Face policy.

AdamW run directly on bf16 parameters loses every update smaller than half a bf16 ulp of the weight
(about 0.2% of its magnitude): at the paper profiles' learning rate of 1e-6 that is most of them. The
standard remedy (Megatron's ``Float16OptimizerWithFloat16Params``, apex/DeepSpeed "master weights") is
kept here for the Hugging Face backend:

- the model keeps its low-precision parameters (forward and backward in bf16/fp16);
- :class:`MasterAdamW` holds an fp32 copy (the *master*) of every trainable parameter and runs AdamW on
  those, so its moments are fp32 too;
- at each optimizer step the model's gradients are upcast into the masters' ``.grad``
  (:meth:`MasterAdamW.grads_to_masters`), the masters are clipped and stepped, and the model's parameters
  are refreshed from them (:meth:`MasterAdamW.masters_to_model`, round to nearest).

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
    ``state_dict``/``load_state_dict`` work as for a plain AdamW. Call :meth:`grads_to_masters` after the
    backward passes and before clipping (clip ``masters``), then ``step()``, then :meth:`masters_to_model`.
    """

    def __init__(self, model_params: Iterable[Tensor], **adamw_kwargs: Any) -> None:
        self.model_params = list(model_params)
        if not self.model_params:
            raise ValueError("model_params: no trainable parameter")
        self.masters = [p.detach().to(torch.float32, copy=True) for p in self.model_params]
        super().__init__(self.masters, **adamw_kwargs)

    @torch.no_grad()
    def grads_to_masters(self) -> list[Tensor]:
        """Upcast each model gradient into its master's ``.grad`` (None stays None); returns the master grads."""
        for p, m in zip(self.model_params, self.masters):
            m.grad = None if p.grad is None else p.grad.detach().to(torch.float32, copy=True)
        return [m.grad for m in self.masters if m.grad is not None]

    @torch.no_grad()
    def masters_to_model(self) -> None:
        """Refresh the model's low-precision parameters from the masters (round to nearest)."""
        for p, m in zip(self.model_params, self.masters):
            p.copy_(m)

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
        with torch.no_grad():
            if saved is None:  # saved without masters: start them from the (already loaded) model weights
                for p, m in zip(self.model_params, self.masters):
                    m.copy_(p)
                return
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
