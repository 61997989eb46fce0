"""Online-logsumexp partial statistics of the LM head and their exact combination.

Legend: N = tokens (flattened), S = vocabulary splits (Triton's forward grid) or shards (tensor-parallel ranks).

Per row, a sweep over a range of the vocabulary keeps the running maximum ``m``, the rescaled sum
``s = sum exp(z - m)``, the rescaled first moment ``u = sum exp(z - m) (z - m)`` and the target logit ``tz``
(``logprob.py``'s docstring has the algorithm). Partials over disjoint ranges combine exactly: two of them
(:func:`merge_partials`: the torch tiles' sweep), the S splits of the Triton forward (:func:`combine_splits`), the
vocabulary shards of a process group (:func:`all_reduce_partials`); :func:`finish_partials` turns the result into
(logp, lse, entropy).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_reduce_partials", "combine_splits", "finish_partials", "merge_partials"]


def merge_partials(m1, s1, u1, m2, s2, u2):
    """Merge two online-softmax partials (elementwise over rows)."""
    m = torch.maximum(m1, m2)
    a1 = torch.exp(m1 - m)
    a2 = torch.exp(m2 - m)
    s = s1 * a1 + s2 * a2
    u = a1 * (u1 + s1 * (m1 - m)) + a2 * (u2 + s2 * (m2 - m))
    return m, s, u


def combine_splits(m_SN, s_SN, u_SN):
    """Combine S partials (rows of [S, N]) into one [N] partial."""
    m = m_SN.max(dim=0).values
    a = torch.exp(m_SN - m)
    s = (s_SN * a).sum(0)
    u = (a * (u_SN + s_SN * (m_SN - m))).sum(0)
    return m, s, u


def all_reduce_partials(m, s, u, tz, hit, group):
    """Combine per-rank partials across ``group`` (vocab parallel). Returns global (m, s, u, tz, hits)."""
    m_g = m.clone()
    dist.all_reduce(m_g, op=dist.ReduceOp.MAX, group=group)
    a = torch.exp(m - m_g)
    packed = torch.stack([s * a, a * (u + s * (m - m_g)), tz, hit.float()])
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    return m_g, packed[0], packed[1], packed[2], packed[3]


def finish_partials(m, s, u, tz):
    """(logp, lse, entropy) [N] of combined partials."""
    lse = m + torch.log(s)
    logp = tz - lse
    ent = (torch.log(s) - u / s).clamp_min(0.0)
    return logp, lse, ent
