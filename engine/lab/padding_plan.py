"""The share of padded positions a config's scoring and training forwards compute, for the cost plan.

The counts of engine/lab/step_plan.py are real positions. The forwards compute every position of their
micro-batches, padded ones included, unless the rows are padding-free (a Hugging Face policy with
``trainer.ppo.use_remove_padding`` true, or auto on CUDA; the Megatron backend pads its plain rows).
:func:`update_padding` plans a synthetic batch of the config's row lengths (:func:`synthetic_row_masks`) with the
update's own planner (``micro_batches.plan_update``) and reads the share from its footprint; :func:`planned_counts` is
the plan's counts with that share, what ``alignopsd plan`` and the run's estimate read.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from alignopsd.engine.lab.cost_model import StepCounts
from alignopsd.engine.lab.step_plan import QUICKSTART_MEANS, Layout, group_rows, plan_counts
from alignopsd.engine.step.micro_batches import RowGeometry, plan_footprint, plan_update

if TYPE_CHECKING:
    from alignopsd.engine.config.schema import RunConfig

__all__ = ["planned_counts", "rows_padding_free", "synthetic_row_masks", "update_padding"]

# The synthetic batch's spread around the means (fixed before any result): prompts grow turn by turn with the
# history, then are cut at the maximum; responses vary more. Lengths are clipped to [64, max] and [8, max].
PROMPT_SPREAD, RESPONSE_SPREAD = 0.35, 0.5
PADDING_ROWS = 2048  # at most this many synthetic rows per group (the share is a property of the length spread)


def synthetic_row_masks(
    cfg: RunConfig, rows: int, seed: int = 0, means: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of ``rows`` turn rows with ``cfg``'s lengths: [rows, max prompt] left-padded prompt masks and [rows,
    max response] right-padded response masks. Means: the config's maxima scaled by the quickstart's measured means
    (as :func:`plan_counts`); spread: normals of standard deviation :data:`PROMPT_SPREAD` and
    :data:`RESPONSE_SPREAD` of the mean, clipped to [64, max] and [8, max]."""
    q = QUICKSTART_MEANS if means is None else means
    lp, lr = cfg.env.max_prompt_length, cfg.generation.max_response_length
    p_mean, r_mean = lp * q["prompt_mean"] / q["max_prompt_length"], lr * q["response_mean"] / q["max_response_length"]
    g = torch.Generator().manual_seed(seed)
    p = (p_mean * (1 + PROMPT_SPREAD * torch.randn(rows, generator=g))).round().clamp(min(64, lp), lp).long()
    r = (r_mean * (1 + RESPONSE_SPREAD * torch.randn(rows, generator=g))).round().clamp(min(8, lr), lr).long()
    pmask = (torch.arange(lp)[None] >= (lp - p)[:, None]).long()
    rmask = (torch.arange(lr)[None] < r[:, None]).long()
    return pmask, rmask


def update_padding(cfg: RunConfig, lay: Layout, rows: float, packed: bool, means: dict | None = None) -> float:
    """The share of the update's computed positions that carry no token, for ``rows`` turn rows per group in
    padded (``packed`` False) or padding-free rows: the update's own plan (engine/step/micro_batches.py
    ``plan_update``: mini-batches per rank, micro-batches by ``trainer.ppo.max_token_len_per_gpu`` or fixed rows)
    over :func:`synthetic_row_masks` (at most :data:`PADDING_ROWS` rows, the mini-batch scaled alike)."""
    n = max(1, min(PADDING_ROWS, round(rows)))
    mini = max(1, round(cfg.trainer.ppo.mini_batch_size / lay.data_parallel * n / max(rows, 1.0)))
    pmask, rmask = synthetic_row_masks(cfg, n, means=means)
    geo = RowGeometry.of(pmask, rmask)
    plan = plan_update(
        rmask, mini, cfg.trainer.ppo.micro_batch_size, 1, geometry=geo, token_budget=cfg.update_token_budget
    )
    return plan_footprint(plan, geo, packed=packed).padding_fraction


def rows_padding_free(cfg: RunConfig, device_type: str = "cuda") -> bool:
    """Whether the config's training and scoring forwards run padding-free on ``device_type``: a Hugging Face
    policy with ``trainer.ppo.use_remove_padding`` true, or auto on CUDA (on a CPU auto is measured at startup: padded
    rows assumed here); the Megatron backend pads its plain rows."""
    return cfg.policy.backend == "hf" and cfg.remove_padding_on(device_type) is True


def planned_counts(
    cfg: RunConfig, lay: Layout, means: dict | None = None, device_type: str = "cuda"
) -> tuple[StepCounts, list[str]]:
    """``step_plan.plan_counts`` with the share of padded positions of ``cfg``'s forwards on ``device_type``
    devices, and the assumptions made (one line each, the padding's included)."""
    q = QUICKSTART_MEANS if means is None else means
    counts, notes = plan_counts(cfg, lay, q)
    rows = group_rows(cfg, lay, q)[0]
    padding_free = rows_padding_free(cfg, device_type)
    padding = update_padding(cfg, lay, rows, padding_free, q)
    notes.append(
        f"rows {'padding-free' if padding_free else 'padded'} (policy.backend {cfg.policy.backend}, "
        f"trainer.ppo.use_remove_padding {cfg.trainer.ppo.use_remove_padding}): {padding:.1%} of the scoring and "
        f"update forwards' positions are padding (the update's plan over {min(PADDING_ROWS, max(1, round(rows)))} "
        f"synthetic rows, prompts {PROMPT_SPREAD:.0%} and responses {RESPONSE_SPREAD:.0%} spread about the means)",
    )
    return replace(counts, padding_fraction=padding), notes
