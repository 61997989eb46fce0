"""The supervised step recipe (the warm start's), beside the RL one (recipe.py): one optimizer step of the policy
backend on a batch of (prompt, response) examples, minimising the next-token cross entropy of the response tokens.

Legend: B = examples of this rank, Lp = padded prompt length, L = padded response length, T = Lp + L.

The rows are the layout every backend scores (engine/policy/base.py): ``[prompt (left-padded) | response
(right-padded)]``; the loss goes through the backend's fused log-prob head (``policy.response_loss``: no
``[B, T, V]`` logits; autograd through its log-probs where ``trainer.ppo.fused_head_loss`` is off), its optimizer,
warm-up and clipping (``policy.optimizer_step``), so whatever the backend is (Hugging Face, LoRA adapters, Megatron
tensor parallelism) the warm start trains it as RL does.

Data parallelism: every rank is handed the same batch and scores its share (every ``dp_size``-th example from its
``dp_rank``); the loss is the sum of its response tokens' negative log-probs over the whole batch's response tokens,
times the data-parallel size, because the backends average gradients over ranks: the update is the batch's
token-mean, as on one process. The ranks of a tensor-parallel group score the same rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from alignopsd.engine.parallel.collectives import all_reduce
from alignopsd.engine.parallel.split import check_split
from alignopsd.engine.policy.base import PolicyBackend
from alignopsd.engine.step.micro_batches import MicroBatch, RowGeometry, pack_by_tokens
from alignopsd.engine.step.packing_trial import PackingTrial
from alignopsd.engine.tokens.layout import left_pad, right_pad
from torch import Tensor

Example = tuple[list[int], list[int]]  # (prompt ids, response ids)


def example_rows(examples: Sequence[Example], pad_id: int) -> tuple[Tensor, Tensor, int]:
    """([B, T] ids, [B, T] attention mask, L) of ``examples`` in the backends' row layout: the prompts left-padded to
    the longest, the responses right-padded to the longest (L columns)."""
    if not examples:
        raise ValueError("examples: expected at least one (prompt, response) example")
    for i, (p, r) in enumerate(examples):
        if not p or not r:
            raise ValueError(f"examples[{i}]: the prompt and the response need a token each ({len(p)}, {len(r)})")
    lp = max(len(p) for p, _ in examples)
    length = max(len(r) for _, r in examples)
    p_ids, p_mask = left_pad([p for p, _ in examples], lp, pad_id)
    r_ids, r_mask = right_pad([r for _, r in examples], length, int(pad_id))
    return torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1), length


def rank_share(batch: Sequence[Example], policy: PolicyBackend) -> list[Example]:
    """The examples of ``batch`` this data-parallel rank scores (the same on every rank of a tensor-parallel
    group)."""
    lay = policy.layout
    check_split(len(batch), lay.dp_size, key="--batch-size", items="examples")
    return list(batch[lay.dp_rank :: lay.dp_size])


def supervised_step(
    policy: PolicyBackend,
    batch: Sequence[Example],
    *,
    pad_id: int,
    max_grad_norm: float,
    fused: bool = True,
    trial: PackingTrial | None = None,
    token_budget: int = 0,
) -> dict:
    """One optimizer step on ``batch`` (every rank passes the whole batch; see the module doc): through the fused
    head loss where ``fused`` and the backend has one (``trainer.ppo.fused_head_loss``, as the PPO update), else
    autograd through the log-probs (``policy.response_logprobs(grad=True)``). ``trial``: the warm start's measurement of
    packed against padded rows (engine/step/packing_trial.py: while it runs, the step's rows go through both ways at
    half scale). ``token_budget`` > 0: this rank's examples go forward and backward in micro-batches of at most that
    many computed positions (longest first; the update's ``pack_by_tokens``), their gradients summed, so the
    activations' memory is bounded (the gradient is the whole batch's). Returns {"loss": the batch's mean
    response-token cross entropy (summed over the data-parallel ranks), "tokens": response tokens of the batch,
    "grad_norm", "skipped", "lr"}."""
    n_tokens = sum(len(r) for _, r in batch)
    mine = rank_share(batch, policy)
    scale = policy.layout.dp_size / n_tokens

    def forward_backward(m: MicroBatch) -> Tensor:
        ids_BT, mask_BT, length = example_rows([mine[i] for i in m.rows], pad_id)

        def loss_fn(logp_BL: Tensor, ent_BL: Tensor | None) -> Tensor:
            return -logp_BL.float().sum() * (scale * m.scale)  # masked-out positions hold 0: response tokens only

        if fused and policy.supports_fused_loss:
            logp_BL, _, carrier = policy.response_loss(ids_BT, mask_BT, length, loss_fn)
            carrier.backward()
            return logp_BL
        logp_BL, _ = policy.response_logprobs(ids_BT, mask_BT, length, grad=True)
        loss_fn(logp_BL, None).backward()
        return logp_BL.detach()

    nll = 0.0
    micros = example_micro_batches(mine, token_budget)
    for j, rows in enumerate(micros):
        mb = MicroBatch(rows, 1.0)
        sync = contextlib.nullcontext if j == len(micros) - 1 else policy.no_sync
        if trial is not None:
            logp_BL = trial.run(forward_backward, mb, sync)[0][1]
        else:
            with sync():
                logp_BL = forward_backward(mb)
        nll += float(-logp_BL.float().sum())
    lay = policy.layout
    loss = all_reduce([nll / n_tokens], "sum", lay.dp_size, lay.dp_group)[0]
    out = policy.optimizer_step(max_grad_norm)
    return {"loss": loss, "tokens": n_tokens, **out}


def example_micro_batches(examples: Sequence[Example], token_budget: int) -> list[list[int]]:
    """Indices of ``examples`` in micro-batches of at most ``token_budget`` computed positions (rows x the longest
    prompt and response of the micro-batch; longest first, an example over the budget alone); one micro-batch of
    all of them when ``token_budget`` is 0."""
    if token_budget <= 0:
        return [list(range(len(examples)))]
    _, p_mask = left_pad([p for p, _ in examples], max(len(p) for p, _ in examples), 0)
    _, r_mask = right_pad([r for _, r in examples], max(len(r) for _, r in examples), 0)
    return pack_by_tokens(list(range(len(examples))), RowGeometry.of(p_mask, r_mask), token_budget)
