"""Row scoring for the rescoring engine (engine/step/rescoring.py): ``[prompt | response]`` rows, plainly or with
shared prompt prefixes.

Legend: M = turns, P = cross pairs, R = scored rows, S = distinct prompts, Lp = padded student-prompt length,
Lt = padded teacher-prompt length (both left-padded), L = padded response length (right-padded),
D = hidden size, H = key/value heads, Dh = head dim.

What is scored (ALGORITHM.md §2.6):
- student row t: ``[student prompt of t | response of t]`` -> ``old_logp[t]``;
- diagonal row t: ``[teacher prompt of t | response of t]`` -> ``diag[t]``;
- cross pair (s, t): ``[teacher prompt of s | response of t]`` -> ``cross[p]`` (scored tokens: t's response).
Every result is [rows, L] fp32, the log-prob of each response token under logits / temperature, 0 on
masked-out positions, computed with the fused log-prob head on response positions only.

Two modes:
- ``plain`` (the reference): every row is its own ``[prompt | response]`` forward.
- ``shared_prefix`` (default): rows are grouped by prompt. Identical prompts are merged (sibling episodes
  share their first observation, so their turn-0 prompts coincide), each distinct prompt is pushed through
  the model once, in left-padded batches, and its key/value cache is kept; every response scored under that
  prompt (the diagonal of its turn and every cross pair whose source it is) is then pushed alone, attached to
  that cache (each layer gathers its rows' prefix keys/values only while that layer runs), with the attention
  mask ``[prompt mask | response mask]`` and position ids continuing from the prompt's length. The log-prob
  of response token 0 comes from the prompt's last hidden state, so the prompt forward also serves the first
  token. Results equal the plain mode up to floating-point reassociation (tested at max |delta| <= 1e-5 in
  fp32 on a tiny model). A policy backend that scores its own rows (Megatron shards, :func:`backend_scorer`)
  shares prefixes by packing each prompt's responses behind one copy of it in one sequence instead.
Both modes never push a response's last token (it predicts nothing that is scored) and trim all-padding
columns per forward. Forwards are sized by ``max_tokens`` (tokens of context per forward: rows x (prompt
+ response) for a row forward, prompts x prompt length for a prompt forward), which bounds peak memory.

Counts reported in ``stats``: ``prompt_tokens`` / ``response_tokens`` pushed through the model (padded
positions included: that is what costs FLOPs), their sum ``token_forwards``, ``real_tokens`` (those of them that
carry a token: ``1 - real_tokens / token_forwards`` is the pass's padding fraction), and ``forwards``.

``by_length`` (both modes; ``trainer.ppo.max_token_len_per_gpu`` on): rows are taken longest first instead of in
batch order (plain: by prompt + response; shared_prefix: the responses of each prompt group by length, the groups
as before, since ordering prompts by length alone was measured to pad more where a short prompt carries a long
response), so each forward holds rows of like length and pads less; the results are the same, in batch order.
"""

from __future__ import annotations

import functools
import logging

import torch
from alignopsd.engine.parallel import devices
from alignopsd.engine.policy.lm_head import logprob_head, scatter_response, score_rows, transformer_body
from alignopsd.engine.tokens.layout import position_ids
from torch import Tensor, nn

log = logging.getLogger(__name__)

RESCORING_MODES = ("shared_prefix", "plain")


# ----------------------------------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------------------------------


def as_pairs(pairs, m: int) -> Tensor:
    """[P, 2] long (source, target) pairs, validated against M turns."""
    if pairs is None:
        return torch.zeros(0, 2, dtype=torch.long)
    t = torch.as_tensor(pairs, dtype=torch.long) if not isinstance(pairs, Tensor) else pairs.long()
    if t.numel() == 0:
        return torch.zeros(0, 2, dtype=torch.long, device=t.device)
    if t.dim() != 2 or t.shape[1] != 2:
        raise ValueError(f"pairs: expected [P, 2] (source, target), got shape {tuple(t.shape)}")
    if bool((t < 0).any()) or bool((t >= m).any()):
        raise ValueError(f"pairs: indices must be in [0, {m}), got min {int(t.min())} max {int(t.max())}")
    return t


def _unique_prompts(prompt_ids_SL: Tensor, prompt_mask_SL: Tensor) -> tuple[Tensor, Tensor]:
    """Merge identical prompts (same attended tokens). Returns (representative index [U], inverse map [S])."""
    keys: dict[tuple, int] = {}
    rep: list[int] = []
    inv: list[int] = []
    ids = prompt_ids_SL.tolist()
    mask = prompt_mask_SL.bool().tolist()
    for i, (row, mk) in enumerate(zip(ids, mask)):
        key = tuple(tok for tok, keep in zip(row, mk) if keep)
        j = keys.get(key)
        if j is None:
            j = len(rep)
            keys[key] = j
            rep.append(i)
        inv.append(j)
    dev = prompt_ids_SL.device
    return torch.tensor(rep, dtype=torch.long, device=dev), torch.tensor(inv, dtype=torch.long, device=dev)


# ----------------------------------------------------------------------------------------------------------------------
# the two scorers
# ----------------------------------------------------------------------------------------------------------------------


def new_stats() -> dict:
    return {"prompt_tokens": 0, "response_tokens": 0, "token_forwards": 0, "real_tokens": 0, "forwards": 0, "rows": 0}


def _left_starts(mask: Tensor) -> list[int]:
    """Per row: its first attended column (the width if none), in one host transfer (row loops take minima)."""
    m, n = mask.bool(), int(mask.shape[1])
    return torch.where(m, torch.arange(n, device=m.device), n).amin(1).tolist() if n else [0] * int(m.shape[0])


def right_extents(mask: Tensor) -> list[int]:
    """Per row: 1 + its last attended column (0 if none), in one host transfer (row loops take maxima)."""
    m, n = mask.bool(), int(mask.shape[1])
    return (m * torch.arange(1, n + 1, device=m.device)).amax(1).tolist() if n else [0] * int(m.shape[0])


def score_plain(
    model: nn.Module,
    prompt_ids_SP: Tensor,
    prompt_mask_SP: Tensor,
    row_prompt_R: Tensor,
    response_ids_RL: Tensor,
    response_mask_RL: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    max_tokens: int = 16384,
    impl: str = "auto",
    stats: dict | None = None,
    by_length: bool = False,
    packed: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Reference scorer: row r is the forward of ``[prompt row_prompt_R[r] | response r]``.

    prompt_ids_SP/prompt_mask_SP: [S, Lp] left-padded prompts; row_prompt_R: [R] prompt index of each row;
    response_ids_RL/response_mask_RL: [R, L]. Returns ([R, L] fp32 log-probs, [R, L] entropy or None).
    Rows are taken in order (``by_length``: longest first), as many per forward as fit in ``max_tokens``;
    ``packed``: each forward in padding-free rows (``score_rows``).
    """
    stats = new_stats() if stats is None else stats
    r, lr = response_ids_RL.shape
    out = torch.zeros(r, lr, dtype=torch.float32, device=response_ids_RL.device)
    ent = torch.zeros_like(out) if with_entropy else None
    lp_cols, right = int(prompt_mask_SP.shape[1]), right_extents(response_mask_RL)
    left = _left_starts(prompt_mask_SP[row_prompt_R])  # per row: its prompt's first attended column
    if by_length and r > 1:  # longest first; the results are written back in batch order
        order = sorted(range(r), key=lambda k: (left[k] - right[k], k))
        idx = torch.tensor(order, dtype=torch.long, device=response_ids_RL.device)
        row_prompt_R, response_ids_RL, response_mask_RL = row_prompt_R[idx], response_ids_RL[idx], response_mask_RL[idx]
        left, right = [left[k] for k in order], [right[k] for k in order]
    else:
        idx = None
    attended = prompt_mask_SP.long().sum(1).tolist()
    resp_cum = response_mask_RL.long().cumsum(1) if lr else None
    i = 0
    while i < r:
        j, lo, hi = i + 1, left[i], right[i]
        while j < r:
            lo, hi = min(lo, left[j]), max(hi, right[j])
            if (j + 1 - i) * ((lp_cols - lo) + hi) > max_tokens:
                break
            j += 1
        src = row_prompt_R[i:j]
        lp, en, pushed = score_rows(
            model,
            prompt_ids_SP[src],
            prompt_mask_SP[src],
            response_ids_RL[i:j],
            response_mask_RL[i:j],
            temperature=temperature,
            with_entropy=with_entropy,
            impl=impl,
            packed=packed,
        )
        dst = idx[i:j] if idx is not None else slice(i, j)
        out[dst] = lp
        if with_entropy:
            ent[dst] = en
        p_cols, h = lp_cols - min(left[i:j]), max(right[i:j])
        real_prompt = sum(attended[int(k)] for k in src.tolist())
        padded = pushed == (j - i) * (p_cols + h - 1)  # else packed: only the attended positions were pushed
        stats["prompt_tokens"] += (j - i) * p_cols if padded else real_prompt
        stats["response_tokens"] += pushed - ((j - i) * p_cols if padded else real_prompt)
        stats["token_forwards"] += pushed
        if pushed:  # the attended prompt positions and the response tokens before the forward's last column
            resp = int(resp_cum[i:j, h - 2].sum()) if h >= 2 else 0
            _add(stats, real_tokens=real_prompt + resp)
        stats["forwards"] += 1 if pushed else 0
        stats["rows"] += j - i
        i = j
    return out, ent


def _prefix_cache(cache, index: Tensor):
    """A read-only cache in which row r sees the keys/values of prompt ``index[r]``.

    Each layer gathers its prefix rows only when the model reaches it and keeps nothing afterwards, so at most
    one layer's gathered copy [R, H, lt + l, Dh] exists at a time (a plain ``DynamicCache`` of the gathered rows
    would hold all layers at once, and its ``update`` would store the concatenation too).
    """
    from transformers import DynamicCache  # noqa: PLC0415
    from transformers.cache_utils import DynamicLayer  # noqa: PLC0415

    class _SharedPrefixLayer(DynamicLayer):
        def __init__(self, k_src: Tensor, v_src: Tensor) -> None:
            super().__init__()
            self.k_src, self.v_src = k_src, v_src
            self.keys, self.values = k_src, v_src  # for get_seq_length / get_mask_sizes
            self.dtype, self.device = k_src.dtype, k_src.device
            self.is_initialized = True

        def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
            k = torch.cat([self.k_src.index_select(0, index), key_states], dim=-2)
            v = torch.cat([self.v_src.index_select(0, index), value_states], dim=-2)
            return k, v

    out = DynamicCache()
    out.layers = [_SharedPrefixLayer(entry[0], entry[1]) for entry in cache]
    return out


def score_shared_prefix(
    model: nn.Module,
    prompt_ids_SP: Tensor,
    prompt_mask_SP: Tensor,
    row_prompt_R: Tensor,
    response_ids_RL: Tensor,
    response_mask_RL: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    max_tokens: int = 16384,
    impl: str = "auto",
    dedupe: bool = True,
    max_prefix_tokens: int | None = None,
    stats: dict | None = None,
    by_length: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Shared-prefix scorer: same contract and results as ``score_plain``, each distinct prompt forwarded once.

    Prompts are grouped (as many per prompt forward as fit in ``max_prefix_tokens``, default ``max_tokens // 4``:
    the group's key/value cache is held for all layers while its rows are scored, and per token it costs more
    than the one-layer-at-a-time activations of a plain forward, so the group is kept smaller than a plain
    micro-batch to keep the peak memory at or below the plain mode's); for each group the prompt forward keeps
    the key/value cache [g, H, lt, Dh] per layer and the last hidden state [g, D]; then the group's rows go
    through response forwards of at most ``max_tokens`` context tokens each, every row attached to its
    prompt's cache.
    """
    stats = new_stats() if stats is None else stats
    r, lr = response_ids_RL.shape
    dev = response_ids_RL.device
    out = torch.zeros(r, lr, dtype=torch.float32, device=dev)
    ent = torch.zeros_like(out) if with_entropy else None
    if r == 0:
        return out, ent
    if prompt_ids_SP.shape[1] == 0 or not bool(prompt_mask_SP[row_prompt_R.unique(), -1].bool().all()):
        raise ValueError("prompt_mask: every prompt must be non-empty and left-padded (last column attended)")
    if dedupe:
        rep_U, inv_S = _unique_prompts(prompt_ids_SP, prompt_mask_SP)
        prompt_ids_SP, prompt_mask_SP = prompt_ids_SP[rep_U], prompt_mask_SP[rep_U]
        row_prompt_R = inv_S[row_prompt_R]
    rows_of: dict[int, list[int]] = {}
    for k, s in enumerate(row_prompt_R.tolist()):
        rows_of.setdefault(s, []).append(k)
    used = sorted(rows_of)
    if by_length:  # each group's responses longest first (the groups stay in batch order: siblings' prompts)
        right = right_extents(response_mask_RL)
    prefix_budget = max(1, max_tokens // 4) if max_prefix_tokens is None else int(max_prefix_tokens)
    groups = _prompt_groups(used, prompt_mask_SP, prefix_budget)
    head = (transformer_body(model), logprob_head(model, temperature=temperature, with_entropy=with_entropy, impl=impl))
    rows = (row_prompt_R, response_ids_RL, response_mask_RL)
    kw = dict(with_entropy=with_entropy, max_tokens=max_tokens)
    for grp in groups:
        rows_l = [k for s in grp for k in rows_of[s]]
        if by_length:
            rows_l.sort(key=lambda k: (-right[k], k))
        rows_g = torch.tensor(rows_l, dtype=torch.long, device=dev)
        _score_group(head, prompt_ids_SP, prompt_mask_SP, grp, rows_g, rows, out, ent, stats, **kw)
        stats["rows"] += int(rows_g.numel())
    return out, ent


def _prompt_groups(used: list[int], prompt_mask_SP: Tensor, prefix_budget: int) -> list[list[int]]:
    """Consecutive groups of prompts whose padded cache (g prompts x trimmed width) fits ``prefix_budget``."""
    lp_full, left = prompt_mask_SP.shape[1], _left_starts(prompt_mask_SP)
    groups: list[list[int]] = []
    cur: list[int] = []
    for s in used:
        cand = cur + [s]
        w = lp_full - min(left[c] for c in cand)
        if cur and len(cand) * w > prefix_budget:
            groups.append(cur)
            cand = [s]
        cur = cand
    if cur:
        groups.append(cur)
    return groups


def _score_group(
    head, prompt_ids_SP, prompt_mask_SP, grp, rows_g, rows, out, ent, stats, *, with_entropy, max_tokens
) -> None:
    """One prompt forward of group ``grp`` (cache kept), then its rows ``rows_g`` attached to that cache; writes
    the rows' log-probs (and entropies) into ``out`` / ``ent``."""
    body, head_fn = head

    row_prompt_R, response_ids_RL, response_mask_RL = rows
    dev = response_ids_RL.device
    rmask = response_mask_RL.bool()
    g_idx = torch.tensor(grp, dtype=torch.long, device=dev)
    start = min(_left_starts(prompt_mask_SP[g_idx]))
    p_ids = prompt_ids_SP[g_idx, start:]
    p_mask = prompt_mask_SP[g_idx, start:].long()
    lt = int(p_ids.shape[1])
    res = body(input_ids=p_ids, attention_mask=p_mask, position_ids=position_ids(p_mask), use_cache=True)
    cache = res.past_key_values
    last_GD = res.last_hidden_state[:, -1]
    stats["prompt_tokens"] += int(p_ids.numel())
    stats["token_forwards"] += int(p_ids.numel())
    _add(stats, real_tokens=int(p_mask.sum()))
    stats["forwards"] += 1
    local = {s: i for i, s in enumerate(grp)}
    n_rows = int(rows_g.numel())
    right, rp = right_extents(rmask[rows_g]), row_prompt_R[rows_g].tolist()  # one host transfer each
    i = 0
    while i < n_rows:
        j = i + 1
        while j < n_rows and (j + 1 - i) * (lt + max(right[i : j + 1])) <= max_tokens:
            j += 1
        sub = rows_g[i:j]
        loc = torch.tensor([local[s] for s in rp[i:j]], dtype=torch.long, device=dev)
        l_used, i = max(right[i:j]), j
        sel = rmask[sub]
        if l_used == 0:
            continue
        h_rows = [last_GD.index_select(0, loc)[:, None]]
        if l_used > 1:
            r_ids = response_ids_RL[sub, : l_used - 1]
            r_mask = response_mask_RL[sub, : l_used - 1].long()
            full_mask = torch.cat([p_mask.index_select(0, loc), r_mask], dim=1)
            pos = position_ids(full_mask)[:, lt:]
            rc = _prefix_cache(cache, loc)
            hr = body(input_ids=r_ids, attention_mask=full_mask, position_ids=pos, past_key_values=rc, use_cache=True)
            h_rows.append(hr.last_hidden_state)
            del rc, hr
            stats["response_tokens"] += int(r_ids.numel())
            stats["token_forwards"] += int(r_ids.numel())
            _add(stats, real_tokens=int(r_mask.sum()))
            stats["forwards"] += 1
        h_rLD = torch.cat(h_rows, dim=1)
        lp_rL, en_rL = scatter_response(h_rLD, response_ids_RL[sub], sel, head_fn)
        out[sub] = lp_rL
        if with_entropy:
            ent[sub] = en_rL
    del cache, res


def backend_row_logprobs(
    policy,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    row_prompt: Tensor,
    resp_ids: Tensor,
    resp_mask: Tensor,
    with_entropy: bool,
    stats: dict | None = None,
    *,
    temperature: float,
    device: torch.device,
    max_tokens: int = 16384,
) -> tuple[Tensor, Tensor | None]:
    """([R, L] log-probs, [R, L] entropy or None) of rows ``[prompt_ids[row_prompt] | resp_ids]`` scored by the policy
    backend itself, no grad, in row chunks of at most ``max_tokens`` token positions (the ``plain`` ``scorer`` of a
    :class:`~alignopsd.engine.step.rescoring.Rescorer`). Every tensor-parallel rank calls it with the same rows.

    prompt_ids/prompt_mask: [P, Lp] left-padded; row_prompt: [R] indices into them; resp_ids/resp_mask: [R, L]
    right-padded. Masked-out response positions get 0. stats: counts added in place (module legend; also
    ``attention_scores``, query-key pairs: rows x (Lp + L - 1)^2 per chunk).
    """
    stats = new_stats() if stats is None else stats
    rows, length = int(resp_ids.shape[0]), int(resp_ids.shape[1])
    width = int(prompt_ids.shape[1]) + length
    per = max(1, max_tokens // max(1, width))
    rp = row_prompt.long().cpu()
    p_ids, p_mask = prompt_ids.cpu(), prompt_mask.cpu().long()
    r_ids, r_mask = resp_ids.cpu(), resp_mask.cpu().long()
    lps, ents = [], []
    for s in range(0, rows, per):
        idx = rp[s : s + per]
        ids = torch.cat([p_ids[idx], r_ids[s : s + per]], dim=1)
        attn = torch.cat([p_mask[idx], r_mask[s : s + per]], dim=1)
        lp, en = policy.response_logprobs(
            devices.to_device(ids, device),
            devices.to_device(attn, device),
            length,
            temperature=temperature,
            with_entropy=with_entropy,
            grad=False,
        )
        lps.append(lp.float().cpu())
        if with_entropy:
            ents.append(en.float().cpu())
        n = int(idx.numel())  # the forward pushes every column but the last
        _add(
            stats,
            prompt_tokens=n * int(prompt_ids.shape[1]),
            response_tokens=n * (length - 1),
            token_forwards=n * (width - 1),
            real_tokens=int(attn[:, :-1].sum()),
            forwards=1,
            attention_scores=n * (width - 1) ** 2,
        )
    stats["rows"] += rows
    lp = torch.cat(lps) if lps else torch.zeros(0, length)
    ent = (torch.cat(ents) if ents else torch.zeros(0, length)) if with_entropy else None
    out_dev = resp_ids.device
    return lp.to(out_dev) * resp_mask.float(), (ent.to(out_dev) * resp_mask.float() if ent is not None else None)


def backend_prefix_logprobs(
    policy,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    row_prompt: Tensor,
    resp_ids: Tensor,
    resp_mask: Tensor,
    with_entropy: bool,
    stats: dict | None = None,
    *,
    temperature: float,
    max_tokens: int = 16384,
    dedupe: bool = True,
    max_pack_tokens: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`backend_row_logprobs` with shared prefixes (the ``shared_prefix`` ``scorer`` of a ``Rescorer`` whose
    policy scores packed rows itself, a Megatron shard: ``policy.prefix_logprobs``): identical prompts are merged
    (``dedupe``, as in :func:`score_shared_prefix`) and each prompt's rows are scored in packed sequences behind one
    copy of it, at most ``max_pack_tokens`` tokens each. Same contract and results as the plain rows."""
    if not policy.scores_itself:
        raise ValueError(f"policy: {type(policy).__name__} cannot score packed shared-prefix rows (no prefix_logprobs)")
    stats = new_stats() if stats is None else stats
    p_ids, p_mask, rp = prompt_ids.cpu(), prompt_mask.cpu().long(), row_prompt.long().cpu()
    if dedupe:
        rep_U, inv_S = _unique_prompts(p_ids, p_mask)
        p_ids, p_mask, rp = p_ids[rep_U], p_mask[rep_U], inv_S[rp]
    lp, ent, counts = policy.prefix_logprobs(
        p_ids,
        p_mask,
        rp,
        resp_ids.cpu(),
        resp_mask.cpu().long(),
        temperature=temperature,
        with_entropy=with_entropy,
        max_tokens=max_tokens,
        max_pack_tokens=max_pack_tokens,
    )
    _add(stats, **counts, rows=int(rp.numel()))
    keep = resp_mask.float()
    return lp.to(resp_ids.device) * keep, (ent.to(resp_ids.device) * keep if ent is not None else None)


def backend_scorer(policy, mode: str, *, temperature: float, device: torch.device, **kw):
    """A :class:`Rescorer`'s ``scorer`` for a policy backend that scores its own rows: ``plain`` rows (on ``device``)
    by :func:`backend_row_logprobs`, ``shared_prefix`` by :func:`backend_prefix_logprobs`; kw: their sizes."""
    if mode not in RESCORING_MODES:
        raise ValueError(f"mode: expected one of {RESCORING_MODES}, got {mode!r}")
    if mode == "plain":
        return functools.partial(backend_row_logprobs, policy, temperature=temperature, device=device, **kw)
    return functools.partial(backend_prefix_logprobs, policy, temperature=temperature, **kw)


def _add(stats: dict, **counts: int) -> None:
    for k, v in counts.items():  # the backends' counts (module legend) into ``stats``
        stats[k] = stats.get(k, 0) + int(v)
