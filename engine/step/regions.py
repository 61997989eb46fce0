"""Thinking / action token regions of sampled responses (ALGORITHM.md §4.3, §6 cases 17 and 19).

Legend: M = turn rows, L = response length.

Regions come from an **exact token round-trip with offsets**, never from guessing:

1. the response tokens (policy part) are decoded with special tokens kept;
2. the text is re-encoded with character offsets; if the re-encoded ids differ from the sampled
   ids the row is a *round-trip mismatch*; if the tokenizer cannot give offsets the row has
   *missing offsets* (both counted, masks left empty);
3. in the text, the thinking block is the inner text of ``<think>…</think>`` and the action block
   the inner text of the first tag type, in the fixed order ``action``, ``search``, ``answer``,
   that occurs (tags case-insensitive); a block that is unclosed, duplicated or nested makes the
   row *malformed* (counted, masks empty);
4. a token belongs to a region iff its character span lies entirely inside the region's inner
   text; a token straddling a tag boundary belongs to no region.

Everything is detached; nothing here changes its inputs.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch
from alignopsd.engine.envs.parsing import ACTION_TAGS
from alignopsd.engine.observe.strict import reraise_if_strict
from torch import Tensor

from alignopsd.reduction import summed

log = logging.getLogger(__name__)


@dataclass
class Regions:
    """Per-row region masks and the counters of rows whose regions could not be determined."""

    thinking: Tensor  # [M, L] bool
    action: Tensor  # [M, L] bool
    counts: dict[str, int] = field(default_factory=dict)  # regions/* counters


def _find_block(text: str, tag: str) -> tuple[int, int] | None | str:
    """Inner (start, end) of the single <tag>…</tag> block; None if absent; 'malformed' otherwise."""
    opens = [m for m in re.finditer(rf"<{tag}(?:\s[^>]*)?>", text, flags=re.IGNORECASE)]
    closes = [m for m in re.finditer(rf"</{tag}\s*>", text, flags=re.IGNORECASE)]
    if not opens and not closes:
        return None
    if len(opens) != 1 or len(closes) != 1:
        return "malformed"  # unclosed, stray close, duplicated or nested
    o, c = opens[0], closes[0]
    if c.start() < o.end():
        return "malformed"
    return o.end(), c.start()


def text_regions(text: str) -> tuple[tuple[int, int] | None, tuple[int, int] | None, bool]:
    """(thinking span, action span, malformed) as character ranges of the inner texts."""
    think = _find_block(text, "think")
    if think == "malformed":
        return None, None, True
    action = None
    for tag in ACTION_TAGS:
        blk = _find_block(text, tag)
        if blk is None:
            continue
        if blk == "malformed":
            return None, None, True
        action = blk
        break
    if think is not None and action is not None:
        (a0, a1), (b0, b1) = think, action
        if a0 < b1 and b0 < a1:  # one block inside the other
            return None, None, True
    return think, action, False


def _offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]] | None:
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):
        return None
    ids = enc["input_ids"]
    offs = enc.get("offset_mapping") if hasattr(enc, "get") else None
    if offs is None:
        return None
    return list(ids), [tuple(o) for o in offs]


def token_regions(response_ids: Tensor, response_mask: Tensor, tokenizer) -> Regions:
    """Thinking and action token masks of each row (see the module docstring).

    Args:
        response_ids: [M, L] sampled response token ids.
        response_mask: [M, L] sampled response tokens (the regions are found in their text; intersect the
            result with the policy-loss mask for per-region statistics).
        tokenizer: needs ``decode(ids, skip_special_tokens=False)`` and
            ``__call__(text, add_special_tokens=False, return_offsets_mapping=True)``.
    """
    if response_ids.dim() != 2:
        raise ValueError(f"response_ids: expected [M, L], got {tuple(response_ids.shape)}")
    if response_mask.shape != response_ids.shape:
        raise ValueError(f"response_mask: expected shape {tuple(response_ids.shape)}, got {tuple(response_mask.shape)}")
    m, length = response_ids.shape
    thinking = torch.zeros(m, length, dtype=torch.bool)
    action = torch.zeros(m, length, dtype=torch.bool)
    counts = {"malformed_region_rows": 0, "round_trip_mismatch_rows": 0, "missing_offsets_rows": 0, "rows": m}
    mask = response_mask.bool().cpu()
    ids_all = response_ids.cpu()
    for r in range(m):
        pos = torch.nonzero(mask[r]).flatten().tolist()
        if not pos:
            continue
        ids = ids_all[r, pos].tolist()
        text = tokenizer.decode(ids, skip_special_tokens=False)
        enc = _offsets(tokenizer, text)
        if enc is None:
            counts["missing_offsets_rows"] += 1
            continue
        re_ids, offs = enc
        if re_ids != ids or len(offs) != len(ids):
            counts["round_trip_mismatch_rows"] += 1
            continue
        think, act, malformed = text_regions(text)
        if malformed:
            counts["malformed_region_rows"] += 1
            continue
        for j, (s, e) in enumerate(offs):
            if e <= s:
                continue
            if think is not None and think[0] <= s and e <= think[1]:
                thinking[r, pos[j]] = True
            if act is not None and act[0] <= s and e <= act[1]:
                action[r, pos[j]] = True
    return Regions(thinking=thinking.to(response_ids.device), action=action.to(response_ids.device), counts=counts)


def region_token_counts(regions: Regions, policy_mask: Tensor, rows: Tensor | None = None) -> dict[str, int]:
    """Policy-token counts per region ('other' = policy tokens in neither region) over ``rows`` (bool [M])."""
    pm = policy_mask.bool()
    if rows is not None:
        pm = pm & rows.bool().view(-1, 1)
    th = regions.thinking & pm
    ac = regions.action & pm
    n = int(pm.sum())
    return {"response": n, "thinking": int(th.sum()), "action": int(ac.sum()), "other": n - int((th | ac).sum())}


def paired_region_stats(
    diag_gap: Tensor,
    cross_gap: Tensor,
    corrected_gap: Tensor,
    policy_mask: Tensor,
    regions: Regions,
    matched: Tensor,
    *,
    eps: float = 1e-4,
) -> dict[str, float]:
    """Paired token diagnostics per region (``paired/{response,thinking,action}/…``, ALGORITHM.md §4.3).

    diag_gap, cross_gap, corrected_gap: [M, L] δ^diag, c - ℓ^old and δ̃. policy_mask: [M, L].
    matched: [M] bool, turns with at least one kept source (the scope of the statistics). The statistics of
    each scope are the core's ``paired_sign_flips`` (strict and tolerance bands). Inputs are not modified.
    """
    from alignopsd.diagnostics import paired_sign_flips

    shape = tuple(policy_mask.shape)
    if tuple(matched.shape) != shape[:1]:
        raise ValueError(f"matched: expected shape {shape[:1]}, got {tuple(matched.shape)}")
    base = policy_mask.bool() & matched.bool().view(-1, 1)
    out: dict[str, float] = {}
    for region, rmask in (("response", None), ("thinking", regions.thinking), ("action", regions.action)):
        scope = base if rmask is None else base & rmask.bool().to(base.device)
        out.update(paired_sign_flips(diag_gap, cross_gap, corrected_gap, scope, eps=eps, prefix=f"paired/{region}/"))
    return out


def response_regions(response_ids: Tensor, response_mask: Tensor, tokenizer) -> Regions | None:
    """The step's thinking/action regions of the canonical responses; None (logged) when finding them fails."""
    try:
        return token_regions(response_ids, response_mask, tokenizer)
    except Exception as exc:  # noqa: BLE001 - diagnostics never abort a step (outside strict mode)
        reraise_if_strict(exc)
        log.warning("token regions failed: %s", exc)
        return None


def region_metrics(regions: Regions | None, policy_mask: Tensor, old_logp: Tensor, rect) -> dict[str, float]:
    """Region counts and the paired statistics per region (§4.3) of the step's regions; never raises.

    rect: the step's ``Rectified`` (diag, cross score, corrected, matched), or None without Mechanism 1."""
    if regions is None:
        return {"regions/errors": summed(1)}
    out: dict[str, float] = {}
    try:
        out.update({f"regions/{k}": summed(v) for k, v in regions.counts.items()})
        for k, v in region_token_counts(regions, policy_mask).items():
            out[f"regions/{k}_token_count"] = summed(v)
        if rect is not None:  # on the rectification's device (the policy's); the batch's tensors live on the host
            dev = rect.diag.device
            old = old_logp.float().to(dev)
            gaps = (rect.diag - old, rect.cross_score - old, rect.corrected - old)
            out.update(paired_region_stats(*gaps, policy_mask.to(dev), regions, rect.matched.to(dev)))
    except Exception as exc:  # noqa: BLE001 - diagnostics never abort a step (outside strict mode)
        reraise_if_strict(exc)
        log.warning("region diagnostics failed: %s", exc)
        out["regions/errors"] = summed(1)
    return out
