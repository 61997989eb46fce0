"""The rollout–trainer mismatch: its diagnostics and its importance-sampling correction of the policy loss.

Legend: M = rows of a whole batch, L = response length.

The sampler (vLLM with its own kernels, often bf16) and the trainer assign slightly different log-probs to the
same sampled tokens. :func:`rollout_mismatch_metrics` measures the gap with the usual diagnostics (KL estimators
k1 and k3, χ², perplexities); :func:`rollout_is_weights` gives the truncated (TIS) or masked (MIS)
importance-sampling correction at token or sequence level, fed to :func:`alignopsd.losses.ppo_loss` /
:func:`alignopsd.losses.actor_loss` as ``is_weight`` (multiplies the per-token policy loss) and ``is_keep``
(rejected tokens leave the loss and its token-mean denominator). Off by default.
"""

from __future__ import annotations

import torch
from torch import Tensor

from alignopsd._checks import as_tensor, check_choice, check_real, check_tokens
from alignopsd.reduction import extreme_max, extreme_min, pooled, summed, weighted_mean

__all__ = ["IS_LEVELS", "IS_MODES", "rollout_is_weights", "rollout_mismatch_metrics"]

IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")
_LOG_RATIO_CLAMP = 20.0  # log-ratios (token and sequence) are clamped to ±20 before exp, as in the PPO ratio


def _mismatch_inputs(rollout_logp, trainer_logp, mask, trainer_name: str) -> tuple[Tensor, Tensor, Tensor]:
    """(log r = log π_trainer − log π_rollout [M, L] fp64, 0 outside the mask; mask [M, L] bool; tokens per row [M])."""
    ro = check_tokens(rollout_logp, "rollout_logp")
    shape = tuple(ro.shape)
    tr = check_tokens(trainer_logp, trainer_name, shape).to(ro.device)
    m = check_tokens(mask, "mask", shape).to(ro.device).bool()
    log_r = torch.where(m, tr.double() - ro.double(), torch.zeros((), dtype=torch.float64, device=ro.device))
    return log_r, m, m.sum(1)


def rollout_mismatch_metrics(rollout_logp: Tensor, trainer_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """Diagnostics of the gap between the sampler's and the trainer's log-probs of the sampled tokens.

    rollout_logp_ML: [M, L] log π_rollout (the generation engine's); trainer_logp_ML: [M, L] log π_trainer of
    the same tokens (the trainer's old log-probs); mask_ML: [M, L] response tokens to count. With
    log r = log π_trainer − log π_rollout per token (tokens sampled from π_rollout), token-means over the mask:

    - ``mismatch/kl``: k1 = mean(−log r), estimates KL(π_rollout ‖ π_trainer);
    - ``mismatch/k3_kl``: mean(r − 1 − log r), the low-variance, non-negative estimator of the same KL;
    - ``mismatch/chi2_token``: mean(r²) − 1, χ²(π_trainer ‖ π_rollout) per token;
    - ``mismatch/chi2_seq``: mean over rows of (Π_t r_t)² − 1 (row log-ratio clamped to ±20);
    - ``mismatch/rollout_ppl``, ``mismatch/trainer_ppl``: mean over rows of exp(−mean_t logp) of each;
    - ``mismatch/ppl_ratio``: mean over rows of trainer_ppl / rollout_ppl = exp(−mean_t log r);
      ``mismatch/log_ppl_diff``: mean over rows of log trainer_ppl − log rollout_ppl;
    - ``mismatch/abs_diff_mean``, ``mismatch/abs_diff_max``: |log r| over tokens; ``mismatch/tokens``.

    Rows without a masked token are left out of the row means. No token at all: zeros (ratios 1).
    """
    log_r, m, n_M = _mismatch_inputs(rollout_logp, trainer_logp, mask, "trainer_logp")
    ro = as_tensor(rollout_logp, "rollout_logp").double().to(log_r.device)
    n = int(n_M.sum())
    if n == 0:
        zero = ("kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_diff", "abs_diff_mean", "abs_diff_max", "tokens")
        out = {f"mismatch/{k}": weighted_mean(0.0, 0) for k in zero}
        out.update({f"mismatch/{k}": weighted_mean(1.0, 0) for k in ("ppl_ratio", "rollout_ppl", "trainer_ppl")})
        return {**out, "mismatch/abs_diff_max": extreme_max(0.0, 0), "mismatch/tokens": summed(0)}
    mf = m.double()
    ratio = torch.exp(log_r.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    rows = n_M > 0
    n_R = n_M[rows].double()
    ro_mean_R = (ro * mf).sum(1)[rows] / n_R
    log_r_mean_R = log_r.sum(1)[rows] / n_R
    tr_mean_R = ro_mean_R + log_r_mean_R
    seq_log_r_R = log_r.sum(1)[rows].clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    rows_n = int(rows.sum())  # the row means are over the rows holding a token, the rest over the tokens
    return {
        "mismatch/kl": weighted_mean(float(-(log_r.sum() / n)), n),
        "mismatch/k3_kl": weighted_mean(float(((ratio - 1.0 - log_r) * mf).sum() / n), n),
        "mismatch/chi2_token": weighted_mean(float((ratio.square() * mf).sum() / n - 1.0), n),
        "mismatch/chi2_seq": weighted_mean(float(torch.exp(2.0 * seq_log_r_R).mean() - 1.0), rows_n),
        "mismatch/rollout_ppl": weighted_mean(float(torch.exp(-ro_mean_R).mean()), rows_n),
        "mismatch/trainer_ppl": weighted_mean(float(torch.exp(-tr_mean_R).mean()), rows_n),
        "mismatch/ppl_ratio": weighted_mean(float(torch.exp(-log_r_mean_R).mean()), rows_n),
        "mismatch/log_ppl_diff": weighted_mean(float((-log_r_mean_R).mean()), rows_n),
        "mismatch/abs_diff_mean": weighted_mean(float(log_r.abs().sum() / n), n),
        "mismatch/abs_diff_max": extreme_max(float(log_r.abs().max()), n),
        "mismatch/tokens": summed(n),
    }


def rollout_is_weights(
    rollout_logp: Tensor,
    trainer_old_logp: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    threshold: float = 2.0,
    lower: float | None = None,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Importance weights correcting for sampling from π_rollout while the loss assumes π_trainer(old).

    rollout_logp_ML, trainer_old_logp_ML: [M, L] log-probs of the sampled tokens under the sampler and under
    the trainer's old policy; mask_ML: [M, L] policy tokens. The ratio is r = π_trainer / π_rollout: per token
    (``level="token"``), or the row's product Π_t r_t over its masked tokens given to each of its tokens
    (``level="sequence"``); log-ratios are clamped to ±20 before exp.

    - ``mode="truncate"`` (TIS): weight = min(r, threshold); every masked token is kept.
    - ``mode="mask"`` (MIS): tokens (``sequence``: whole rows) with r outside [lower, threshold] are rejected
      (keep False, weight 0); the kept ones have weight r. Rejected tokens must leave the loss's token-mean
      denominator: pass ``keep`` as ``is_keep`` to :func:`ppo_loss` / :func:`actor_loss`.

    threshold > 1; lower in [0, 1), default 1 / threshold. Returns (weight_ML fp32 detached, 0 outside
    ``keep``; keep_ML bool = mask and not rejected; stats): ``rollout_is/mean``, ``/max``, ``/min`` of the
    ratio over masked tokens, ``rollout_is/weight_mean``, ``rollout_is/ess`` (normalised effective sample
    size (Σw)² / (n Σw²) over kept tokens), ``rollout_is/truncated_frac`` (r > threshold) and
    ``rollout_is/rejected_frac`` (masked tokens rejected; ``sequence``: also ``rollout_is/rejected_seq_frac``).
    """
    check_choice(level, "level", IS_LEVELS)
    check_choice(mode, "mode", IS_MODES)
    hi = check_real(threshold, "threshold")
    if not hi > 1.0:
        raise ValueError(f"threshold: must be > 1, got {hi}")
    lo = 1.0 / hi if lower is None else check_real(lower, "lower", lo=0.0)
    if not lo < 1.0:
        raise ValueError(f"lower: must be in [0, 1), got {lo}")
    log_r, m, n_M = _mismatch_inputs(rollout_logp, trainer_old_logp, mask, "trainer_old_logp")
    if level == "sequence":
        log_r = log_r.sum(1, keepdim=True).expand_as(log_r)
    ratio = torch.exp(log_r.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    if mode == "truncate":
        keep = m.clone()
        weight = torch.where(m, ratio.clamp(max=hi), torch.zeros_like(ratio))
    else:
        keep = m & (ratio >= lo) & (ratio <= hi)
        weight = torch.where(keep, ratio, torch.zeros_like(ratio))
    n = int(n_M.sum())
    trunc = mode == "truncate"
    stats = {"rollout_is/rejected_frac": weighted_mean(0.0, 0), "rollout_is/truncated_frac": weighted_mean(0.0, 0)}
    if n > 0:
        r_m, w_k = ratio[m], weight[keep]
        k = w_k.numel()
        ess = float(w_k.sum().square() / (k * w_k.square().sum())) if k else 0.0
        stats.update(
            {
                "rollout_is/mean": weighted_mean(float(r_m.mean()), n),
                "rollout_is/max": extreme_max(float(r_m.max()), n),
                "rollout_is/min": extreme_min(float(r_m.min()), n),
                "rollout_is/weight_mean": weighted_mean(float(weight[m].mean()), n),
                "rollout_is/ess": pooled(ess, "ess", k, w_k.sum(), w_k.square().sum()),
                "rollout_is/truncated_frac": weighted_mean(float((r_m > hi).double().mean()) if trunc else 0, n),
                "rollout_is/rejected_frac": weighted_mean(float(1.0 - keep.sum() / n), n),
            }
        )
    if level == "sequence":
        rows = n_M > 0
        rejected = rows & ~keep.any(1)
        n_rows = int(rows.sum())
        stats["rollout_is/rejected_seq_frac"] = weighted_mean(float(rejected.sum() / n_rows) if n_rows else 0.0, n_rows)
    return weight.float(), keep, stats
