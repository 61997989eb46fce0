"""The update's micro-batch plan (ALGORITHM.md §3.12): mini-batches of micro-batches, by rows or by tokens.

Legend: M = canonical turns of this rank, Lp = padded prompt length (left-padded), L = padded response length
(right-padded), b = rows of one micro-batch.

A micro-batch's forward pushes ``b x (prompt width + response width - 1)`` positions: the policy trims the columns
that are padding in every row of the micro-batch (``score_rows``), so the widths are the micro-batch's longest
prompt and longest response, and the response's last column predicts nothing. Positions a row does not fill are
padding: :class:`Footprint` counts them, and ``actor/padding_fraction`` is padding / computed positions.

Two ways to cut a mini-batch (``trainer.ppo.max_token_len_per_gpu``, resolved by ``RunConfig.update_token_budget``):

- by rows (budget 0): ``micro_size`` rows each, in batch order (the former plan);
- by tokens: the mini-batch's rows sorted by length (prompt + response, longest first), each micro-batch filled
  while ``rows x (longest prompt + longest response)`` stays within the budget (a row longer than the budget is a
  micro-batch of its own).

Both keep the mini-batches (the rows of each optimiser step) as they were, so the gradient of every optimiser step
is the same up to floating-point reassociation: each micro-batch's token-mean is scaled by its share of the
mini-batch's weighted tokens over all ranks (:func:`alignopsd.losses.microbatch_scales`). Data-parallel lock-step:
the number of micro-batches is the maximum over the ranks (one all-reduce); a rank with fewer halves its
micro-batch with the most computed positions until it has as many (halves hold at least one row each) and only a
rank with fewer rows than micro-batches adds zero-scale dummies (row 0, scale 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from alignopsd.engine.parallel.collectives import all_reduce
from torch import Tensor

from alignopsd.losses import microbatch_scales


@dataclass(frozen=True)
class MicroBatch:
    """Rows of one micro-batch and the scale of its token-mean (0 for a lock-step dummy on row 0)."""

    rows: list[int]
    scale: float
    dummy: bool = False


@dataclass(frozen=True)
class RowGeometry:
    """Per row (host lists, one transfer each): attended prompt width (from its first attended column), response
    extent (1 + last response column) and the cumulative response-token counts [M, L] (CPU tensor)."""

    prompt: list[int]
    response: list[int]
    resp_cum: Tensor

    @classmethod
    def of(cls, prompt_mask: Tensor, response_mask: Tensor) -> RowGeometry:
        pm, rm = prompt_mask.bool().cpu(), response_mask.bool().cpu()
        lp, lr = int(pm.shape[1]), int(rm.shape[1])
        first = torch.where(pm, torch.arange(lp), lp).amin(1) if lp else torch.zeros(pm.shape[0], dtype=torch.long)
        ext = (rm * torch.arange(1, lr + 1)).amax(1) if lr else torch.zeros(rm.shape[0], dtype=torch.long)
        return cls((lp - first).tolist(), ext.tolist(), rm.long().cumsum(1))

    def length(self, r: int) -> int:
        return self.prompt[r] + self.response[r]

    def cost(self, rows: list[int]) -> int:
        """The budget's measure of a micro-batch: rows x (longest prompt + longest response)."""
        return len(rows) * (max(self.prompt[r] for r in rows) + max(self.response[r] for r in rows)) if rows else 0


@dataclass
class Footprint:
    """Positions a pass pushes through the model (``computed``) and those of them that carry a token (``real``)."""

    computed: int = 0
    real: int = 0

    def add(self, geo: RowGeometry, rows: list[int], packed: bool = False) -> None:
        """The positions of one forward of ``rows`` (trimmed like ``score_rows``: no column of padding only, no
        last response column; ``packed``: padding-free rows of several rows push only their real positions)."""
        r_ext = max((geo.response[r] for r in rows), default=0)
        if not rows or r_ext == 0:  # nothing to score: the policy pushes nothing
            return
        p_w = max(geo.prompt[r] for r in rows)
        resp = int(geo.resp_cum[rows, r_ext - 2].sum()) if r_ext >= 2 else 0
        real = sum(geo.prompt[r] for r in rows) + resp
        self.computed += real if packed and len(rows) > 1 else len(rows) * (p_w + r_ext - 1)
        self.real += real

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real / self.computed if self.computed else 0.0


def _split(n: int, size: int) -> list[list[int]]:
    return [list(range(i, min(n, i + size))) for i in range(0, n, size)]


def pack_by_tokens(rows: list[int], geo: RowGeometry, budget: int) -> list[list[int]]:
    """``rows`` sorted by length (longest first, ties in batch order) cut into micro-batches of at most ``budget``
    computed positions (:meth:`RowGeometry.cost`); a row over the budget alone."""
    order = sorted(rows, key=lambda r: (-geo.length(r), r))
    out: list[list[int]] = []
    cur: list[int] = []
    p_w = r_w = 0
    for r in order:
        np_w, nr_w = max(p_w, geo.prompt[r]), max(r_w, geo.response[r])
        if cur and (len(cur) + 1) * (np_w + nr_w) > budget:
            out.append(cur)
            cur, np_w, nr_w = [], geo.prompt[r], geo.response[r]
        cur.append(r)
        p_w, r_w = np_w, nr_w
    if cur:
        out.append(cur)
    return out


def _even_out(micros: list[list[int]], n: int, geo: RowGeometry) -> list[list[int]]:
    """``micros`` brought to ``n`` micro-batches by halving the costliest one that holds 2+ rows (rows stay sorted)."""
    micros = [list(m) for m in micros]
    while len(micros) < n:
        cand = [i for i, m in enumerate(micros) if len(m) > 1]
        if not cand:
            break
        i = max(cand, key=lambda k: (geo.cost(micros[k]), -k))
        m = micros[i]
        micros[i : i + 1] = [m[: len(m) // 2], m[len(m) // 2 :]]
    return micros


def plan_update(
    mask_ML: Tensor,
    mini_size: int,
    micro_size: int,
    world: int,
    group=None,
    *,
    geometry: RowGeometry | None = None,
    token_budget: int = 0,
) -> list[list[MicroBatch]]:
    """Mini-batches of micro-batches with their token-mean scales, equal in count on every data-parallel rank.

    ``mask_ML``: the policy tokens (the token-mean's weights); ``mini_size``: rows per mini-batch on this rank;
    ``micro_size``: rows per micro-batch (``token_budget`` 0); ``token_budget`` > 0: micro-batches by tokens, which
    needs ``geometry`` (the rows' widths). A mini-batch with no policy token on any rank is left out (empty list)."""
    if token_budget > 0 and geometry is None:
        raise ValueError("geometry: micro-batches by tokens (token_budget > 0) need the rows' RowGeometry")
    m = int(mask_ML.shape[0])
    row_tok = mask_ML.sum(1).tolist()  # one host transfer, not one per micro-batch
    minis = _split(m, max(1, mini_size))
    n_mini = int(all_reduce([float(len(minis))], "max", world, group)[0])
    plan: list[list[MicroBatch]] = []
    for i in range(n_mini):
        rows = minis[i] if i < len(minis) else []
        if token_budget > 0:
            micros = pack_by_tokens(rows, geometry, token_budget)
        else:
            micros = [[rows[k] for k in mc] for mc in _split(len(rows), max(1, micro_size))]
        n_micro = int(all_reduce([float(len(micros))], "max", world, group)[0])
        if token_budget > 0:
            micros = _even_out(micros, n_micro, geometry)
        w_tok = [float(sum(row_tok[r] for r in mc)) for mc in micros]
        global_tok = all_reduce([sum(w_tok)], "sum", world, group)[0]
        if global_tok <= 0:
            plan.append([])
            continue
        scales = microbatch_scales(w_tok, global_weighted_tokens=global_tok, world_size=world)
        mbs = [MicroBatch(mc, s) for mc, s in zip(micros, scales)]
        mbs += [MicroBatch([0], 0.0, dummy=True) for _ in range(n_micro - len(micros))]
        plan.append(mbs)
    return plan


def plan_footprint(plan: list[list[MicroBatch]], geo: RowGeometry, packed: bool = False) -> Footprint:
    """The positions the update's forwards push for ``plan`` (dummies included: they are computed too; ``packed``:
    in padding-free rows)."""
    fp = Footprint()
    for mbs in plan:
        for mb in mbs:
            fp.add(geo, mb.rows, packed)
    return fp
