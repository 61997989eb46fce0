"""The policy-backend interface shared by the Hugging Face and Megatron backends.

Legend: B = rows, T = Lp + L input length, L = response length.
Inputs are ``[prompt (left-padded) | response (right-padded)]`` rows; log-probs are of the
response tokens (the last L positions) under logits / temperature, computed with the fused
log-prob head (no [B, T, V] logits).
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


class PolicyBackend(Protocol):
    def response_logprobs(
        self,
        input_ids: Tensor,  # [B, T]
        attention_mask: Tensor,  # [B, T]
        response_length: int,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        grad: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """([B, L] fp32 log-probs of the response tokens, [B, L] entropy or None)."""
        ...

    def optimizer_step(self, max_grad_norm: float) -> dict:
        """Clip, step, zero grads. Returns {"grad_norm": float, "skipped": bool}; a non-finite norm skips."""
        ...

    def zero_grad(self) -> None: ...

    def hf_state_dict(self) -> dict[str, Tensor]:
        """Full weights in Hugging Face layout (for checkpoints and pushing to the rollout engine)."""
        ...
