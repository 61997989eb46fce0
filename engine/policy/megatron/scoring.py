"""Scoring with a tensor-parallel megatron-core ``GPTModel`` shard, shared by the trained policy and the frozen
reference (legend as in ``backend``: B rows, T tokens per row, L response length, N scored tokens, D hidden size).

:class:`ShardScoring` is the no-grad and training forward to per-token log-probs on this rank's vocabulary shard
(``alignopsd.kernels.logprob_vocab_parallel``; no rank holds the full [N, V] logits). A class using it sets
``model`` (the GPTModel shard), ``tp``, ``tp_rank``, ``tp_group`` and ``padding_idx``.

:class:`FrozenShard` is such a shard that never trains: a snapshot of a policy's shard (the reference model of the
KL term, built from the initial weights), sharded exactly like the policy, with no gradients, optimizer or
data-parallel wrapper.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from alignopsd.engine import devices
from alignopsd.engine.devices import module_device
from alignopsd.engine.policy.base import prompt_width
from alignopsd.engine.policy.megatron.model import build_gpt_model, forward_hidden, output_weight
from torch import Tensor


class ShardScoring:
    """Per-token log-probs of response tokens from a tensor-parallel GPTModel shard (see the module docstring)."""

    model: torch.nn.Module
    tp: int
    tp_rank: int
    tp_group: object
    padding_idx: int | None

    def _logprob(self, hidden_ND: Tensor, targets_N: Tensor, temperature: float, with_entropy: bool):
        from alignopsd.kernels.logprob import logprob, logprob_vocab_parallel  # noqa: PLC0415

        weight = output_weight(self.model)
        if self.tp == 1:
            out = logprob(hidden_ND, weight, targets_N, temperature=temperature, with_entropy=with_entropy)
        else:
            out = logprob_vocab_parallel(
                hidden_ND,
                weight,
                targets_N,
                group=self.tp_group,
                vocab_start=self.tp_rank * int(weight.shape[0]),
                temperature=temperature,
                with_entropy=with_entropy,
            )
        return out if with_entropy else (out, None)

    def _to_device(self, *rows: Tensor) -> tuple[Tensor, ...]:
        """The backend's device boundary: rows onto the shard's device."""
        dev = module_device(self.model)
        return tuple(devices.to_device(r, dev) for r in rows)

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

        Same contract as the Hugging Face backend: masked-out response positions get 0. Every rank of
        a tensor-parallel group must call this with the same rows.
        """
        lp = prompt_width(input_ids, attention_mask, response_length)
        input_ids, attention_mask = self._to_device(input_ids, attention_mask)
        rmask_BL = attention_mask[:, lp:].bool()
        ctx = contextlib.nullcontext() if grad else torch.no_grad()
        self.model.train(grad)
        with ctx:
            hidden_BTD = forward_hidden(self.model, input_ids[:, :-1], attention_mask[:, :-1], self.padding_idx)
            h_BLD = hidden_BTD[:, lp - 1 :]
            logp_N, ent_N = self._logprob(h_BLD[rmask_BL], input_ids[:, lp:][rmask_BL], temperature, with_entropy)
            logp_BL = torch.zeros(rmask_BL.shape, dtype=torch.float32, device=input_ids.device)
            logp_BL = logp_BL.masked_scatter(rmask_BL, logp_N.float())
            ent_BL = None
            if with_entropy:
                ent_BL = torch.zeros_like(logp_BL).masked_scatter(rmask_BL, ent_N.float())
        return logp_BL, ent_BL


@contextlib.contextmanager
def rng_preserved() -> Iterator[None]:
    """Random states as they were before the block: the CPU generator, the current CUDA device's and
    megatron-core's model-parallel tracker (which initialises tensor-parallel weights)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker  # noqa: PLC0415

    tracker = get_cuda_rng_tracker()
    saved = tracker.get_states()
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            tracker.set_states(saved)


class FrozenShard(ShardScoring):
    """A frozen copy of ``policy``'s current shard (a ``MegatronPolicy``, or any ``ShardScoring`` with ``hf_config``
    and ``spec``): the same megatron-core layout, tensor-parallel group and parameter dtype, its parameters copied
    (no conversion: the copy is exact) and never trained. Build it before the first update to score the initial
    weights. Every rank of the tensor-parallel group builds its own shard."""

    def __init__(self, policy) -> None:
        src = policy.model
        params_dtype = next(src.parameters()).dtype
        self.hf_config = policy.hf_config
        self.tp, self.tp_rank, self.tp_group = policy.tp, policy.tp_rank, policy.tp_group
        self.padding_idx = policy.padding_idx
        with rng_preserved():  # the fresh model's random initialisation (overwritten below) draws no step's numbers
            self.model, self.spec = build_gpt_model(policy.hf_config, policy.tp, params_dtype, policy.spec, "none")
        missing, unexpected = self.model.load_state_dict(src.state_dict(), strict=False)
        if missing or unexpected:
            raise ValueError(f"policy: its shard does not match a fresh model (missing {missing[:3]}, unexpected "
                             f"{unexpected[:3]})")  # fmt: skip
        self.model.requires_grad_(False)
        self.model.eval()

    def response_logprobs(self, input_ids, attention_mask, response_length, *, temperature=1.0, with_entropy=False,
                          grad=False):  # fmt: skip
        """``ShardScoring.response_logprobs`` without gradients (a frozen model has none to give)."""
        if grad:
            raise ValueError("grad: a frozen shard is never trained")
        return super().response_logprobs(input_ids, attention_mask, response_length, temperature=temperature,
                                          with_entropy=with_entropy, grad=False)  # fmt: skip
