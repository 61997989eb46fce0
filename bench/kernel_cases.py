"""Benchmark cases of the kernels: inputs, our call, the plain-torch baseline, and an agreement check.

Legend: N = tokens, H = hidden size, V = vocabulary, M = turns, D = embedding size.

Each builder returns a :class:`Case` whose ``ours``/``base`` callables run the measured work
(inputs are built once, outside the measurement) and whose ``check`` compares their outputs.

- ``logprob_*``: ``alignopsd.kernels.logprob`` (torch path on CPU, Triton on CUDA) against
  ``log_softmax(h @ W.T).gather(...)``; ``fwd`` under ``no_grad`` (rescoring); ``fwdbwd``: a training
  step's head (PPO-clip token loss, gradients to hidden and weight, the weight gradient added into a
  preallocated fp32 buffer) with ``logprob_loss_and_grad`` against autograd through the full logits;
  ``fwdbwd_autograd``: the autograd function ``logprob`` under ``sum(logp).backward()`` (``.grad``
  cleared before each call, so a fresh weight gradient is part of both peaks).
- ``alignment_kernels_d*``: ``sibling_topk`` + ``boundary_scores_blocks`` + ``batch_threshold``
  (selection, profiles, JSD, threshold of a whole batch) against a straightforward torch
  implementation that loops over tasks (and, for the one-per-rollout step, over a task's
  rollouts), vectorised inside each task. Both return the same things: per-target selections,
  per-task profile blocks, profile validity, d, boundary validity and tau.
- ``alignment_kernels_d*_core``: the same kernels against the algorithm core's dense path
  (``similarity_matrix``, ``eligibility``, ``select_sources``, ``correspondence_profiles``,
  ``boundary_scores``, ``segmentation_threshold``), which is vectorised too but works on
  dense M x M matrices.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from alignopsd.kernels import batch_threshold, boundary_scores_blocks, logprob, logprob_loss_and_grad, sibling_topk

GAMMA, TOP_K, T_P, QUANTILE, TAU_MIN, TAU_MAX = 0.7, 3, 0.1, 0.8, 0.01, 0.10


@dataclass
class Case:
    name: str
    ours: Callable[[], object]
    base: Callable[[], object]
    check: Callable[[object, object], str]
    info: dict = field(default_factory=dict)
    reps: int = 5
    warmup: bool = True


# ----------------------------------------------------------------------------------------------
# log-prob
# ----------------------------------------------------------------------------------------------
LOGPROB_SHAPES = {
    # name: (H, V, N full, N quick)
    "smollm2": (576, 49152, 1024, 256),
    "qwen7b": (3584, 152064, 128, 32),
}


def ppo_token_loss(lp, old, adv, clip_low=0.2, clip_high=0.28):
    """Per-token PPO-clip surrogate (the shape of the trainer's policy loss)."""
    ratio = torch.exp(lp - old)
    return -torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)


def _plain_logprob(h, w, t):
    return torch.log_softmax(h @ w.T, dim=-1).gather(-1, t.unsqueeze(-1)).squeeze(-1)


@functools.lru_cache(maxsize=1)
def _logprob_inputs(model: str, quick: bool, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden, weight, targets) of a log-prob case, generated once per (model, size) and shared by its modes
    (the 7B head's weight alone is 2 GiB of random numbers)."""
    H, V, n_full, n_quick = LOGPROB_SHAPES[model]
    N = n_quick if quick else n_full
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g).to(device)
    w = (torch.randn(V, H, generator=g) * (1.0 / math.sqrt(H))).to(device)
    t = torch.randint(0, V, (N,), generator=g).to(device)
    return h, w, t


def _logprob_fwd(h, w, t):
    """(ours, base, check) of the no-grad forward (rescoring)."""

    def ours():
        with torch.no_grad():
            return logprob(h, w, t)

    def base():
        with torch.no_grad():
            return _plain_logprob(h, w, t)

    def check(a, b):
        return f"max|dlogp|={float((a - b).abs().max()):.1e}"

    return ours, base, check


def _logprob_fwdbwd(h, w, t, device: str):
    """(ours, base, check) of a training step's LM head.

    PPO-clip token-mean loss over the log-probs, gradients to hidden and weight, the weight gradient added into a
    preallocated fp32 buffer (a data-parallel main_grad, or .grad after the first micro-batch). Ours:
    logprob_loss_and_grad (three matmuls, accumulates in place). Plain torch: autograd through the full logits,
    then buffer += weight.grad.
    """
    N, H = h.shape
    V = w.shape[0]
    g = torch.Generator().manual_seed(1)
    old = torch.randn(N, generator=g) - math.log(V)
    adv = torch.randn(N, generator=g)
    h.requires_grad_()
    w.requires_grad_()
    buf_o = torch.zeros(V, H, device=device)
    buf_b = torch.zeros(V, H, device=device)

    def token_loss(lp, _ent, idx):
        return ppo_token_loss(lp, old[idx], adv[idx]) / N

    def ours():
        buf_o.zero_()
        r = logprob_loss_and_grad(h, w, t, token_loss, grad_weight=buf_o)
        return r.grad_hidden, buf_o, r.loss

    def base():
        buf_b.zero_()
        h.grad = None
        w.grad = None
        loss = token_loss(_plain_logprob(h, w, t), None, torch.arange(N, device=device)).sum()
        loss.backward()
        buf_b.add_(w.grad)
        w.grad = None
        return h.grad, buf_b, loss.detach()

    def check(a, b):
        return (
            f"max|dh|={float((a[0] - b[0]).abs().max()):.1e} max|dW|={float((a[1] - b[1]).abs().max()):.1e} "
            f"|dloss|={float((a[2] - b[2]).abs()):.1e}"
        )

    return ours, base, check


def _logprob_fwdbwd_autograd(h, w, t):
    """(ours, base, check) of the autograd function (logprob) under sum(logp).backward().

    Its backward recomputes each logits tile, four matmuls against plain autograd's three; the weight gradient is
    a fresh [V, H] on both sides, so at the 7B head it dominates both peaks.
    """
    h.requires_grad_()
    w.requires_grad_()

    def _run(fn):
        h.grad = None
        w.grad = None
        fn(h, w, t).sum().backward()
        return h.grad, w.grad

    def ours():
        return _run(logprob)

    def base():
        return _run(_plain_logprob)

    def check(a, b):
        return f"max|dh|={float((a[0] - b[0]).abs().max()):.1e} max|dW|={float((a[1] - b[1]).abs().max()):.1e}"

    return ours, base, check


def logprob_case(model: str, mode: str, quick: bool, device: str = "cpu") -> Case:
    H, V, n_full, n_quick = LOGPROB_SHAPES[model]
    N = n_quick if quick else n_full
    h, w, t = (x.detach() for x in _logprob_inputs(model, quick, device))  # fresh leaves over cached storage
    if mode == "fwd":
        ours, base, check = _logprob_fwd(h, w, t)
    elif mode == "fwdbwd":
        ours, base, check = _logprob_fwdbwd(h, w, t, device)
    elif mode == "fwdbwd_autograd":
        ours, base, check = _logprob_fwdbwd_autograd(h, w, t)
    else:
        raise ValueError(f"mode: expected 'fwd', 'fwdbwd' or 'fwdbwd_autograd', got {mode!r}")

    big = model == "qwen7b"
    reps = (1 if big else 3) if quick else (3 if big else 5)
    return Case(
        f"logprob_{model}_{mode}",
        ours,
        base,
        check,
        dict(N=N, H=H, V=V, dtype="float32"),
        reps,
        warmup=not (quick and big),
    )


# ----------------------------------------------------------------------------------------------
# alignment kernels
# ----------------------------------------------------------------------------------------------
def alignment_batch(tasks: int, rollouts: int, turns: int, dim: int, *, seed: int = 0, phases: int = 8):
    """Realistic thinking embeddings: each task has a few phase prototypes; every rollout walks through
    them with random dwell times; teacher/student embeddings are noisy unit vectors around the phase
    (the student with a per-rollout offset). ~3% invalid thinking on each side. Turns are shuffled."""
    g = torch.Generator().manual_seed(seed)
    m = tasks * rollouts * turns
    task = torch.arange(tasks).repeat_interleave(rollouts * turns)
    rollout = torch.arange(rollouts).repeat_interleave(turns).repeat(tasks)
    turn = torch.arange(turns).repeat(tasks * rollouts)
    proto = torch.nn.functional.normalize(torch.randn(tasks, phases, dim, generator=g), dim=-1)
    cuts = torch.rand(tasks, rollouts, turns, generator=g) < (phases / turns)
    phase = torch.cumsum(cuts.long(), -1).clamp_max(phases - 1).reshape(-1)
    base = proto[task, phase]

    def noise(n, scale):
        return scale * torch.nn.functional.normalize(torch.randn(n, dim, generator=g), dim=-1)

    offset = noise(tasks * rollouts, 0.3).repeat_interleave(turns, 0)
    student = torch.nn.functional.normalize(base + offset + noise(m, 0.55), dim=-1)
    teacher = torch.nn.functional.normalize(base + noise(m, 0.55), dim=-1)
    sv = torch.rand(m, generator=g) > 0.03
    tv = torch.rand(m, generator=g) > 0.03
    perm = torch.randperm(m, generator=g)
    return dict(
        teacher=teacher[perm] * sv[perm, None],
        student=student[perm] * tv[perm, None],
        task=task[perm],
        rollout=rollout[perm],
        turn=turn[perm],
        sv=sv[perm],
        tv=tv[perm],
    )


def alignment_ours(b: dict) -> dict:
    r = sibling_topk(
        b["teacher"],
        b["student"],
        b["task"],
        b["rollout"],
        b["turn"],
        b["sv"],
        b["tv"],
        gamma=GAMMA,
        top_k=TOP_K,
        profile_temperature=T_P,
    )
    d, bv = boundary_scores_blocks(r.P_BTS, r.E_BTS, r.profile_valid, r.blocks)
    tau = batch_threshold(d, bv, quantile=QUANTILE, tau_min=TAU_MIN, tau_max=TAU_MAX)
    return dict(selected=r.selected_lists(), valid=r.profile_valid, d=d, bv=bv, tau=tau)


def alignment_loop_baseline(b: dict) -> dict:
    """Straightforward torch: a loop over tasks (and over a task's rollouts for one-per-rollout)."""
    te, st, task, roll, turn, sv, tv = (b[k] for k in ("teacher", "student", "task", "rollout", "turn", "sv", "tv"))
    M = task.numel()
    selected: list[list[int]] = [[] for _ in range(M)]
    valid = torch.zeros(M, dtype=torch.bool)
    d = torch.zeros(M)
    bv = torch.zeros(M, dtype=torch.bool)
    profiles = {}
    for tk in torch.unique(task).tolist():
        idx = (task == tk).nonzero().flatten()
        # identity order inside the task: (rollout, turn)
        idx = idx[torch.argsort(roll[idx] * (int(turn.max()) + 1) + turn[idx])]
        r_i = roll[idx]
        Hb = (te[idx] @ st[idx].T).clamp(-1, 1) * (sv[idx][:, None] & tv[idx][None, :])  # [source, target]
        Eb = sv[idx][:, None] & tv[idx][None, :] & (r_i[:, None] != r_i[None, :])
        # profiles P[target, source]
        X = Hb.T.masked_fill(~Eb.T, -1e30)
        has = Eb.T.any(1)
        valid[idx] = has & (X.amax(1) >= GAMMA)
        P = torch.softmax(X / T_P, dim=1) * has[:, None]
        profiles[tk] = P
        # selection: best candidate of each source rollout, then top-K over rollouts
        key = torch.where(Eb & (Hb >= GAMMA), Hb, torch.tensor(-math.inf))
        best_vals, best_src = [], []
        for r in torch.unique(r_i).tolist():
            rows = (r_i == r).nonzero().flatten()
            kb = key[rows]  # [sources of r, targets]
            v = kb.amax(0)
            first = torch.argmax((kb == v).int(), dim=0)  # first = smallest identity among ties
            best_vals.append(v)
            best_src.append(idx[rows[first]])
        best_vals = torch.stack(best_vals, 1)  # [targets, rollouts]
        best_src = torch.stack(best_src, 1)
        order = torch.sort(best_vals, dim=1, descending=True, stable=True).indices[:, :TOP_K]
        vals = best_vals.gather(1, order)
        srcs = best_src.gather(1, order)
        for j, t in enumerate(idx.tolist()):
            selected[t] = srcs[j][vals[j] > -math.inf].tolist()
        # adjacent JSD inside each trajectory
        same = (r_i[1:] == r_i[:-1]).nonzero().flatten()
        prev, cur = same, same + 1
        p, q = P[prev], P[cur]
        m = 0.5 * (p + q)
        xl = torch.special.xlogy
        jsd = ((0.5 * (xl(p, p).sum(1) + xl(q, q).sum(1)) - xl(m, m).sum(1)) / math.log(2)).clamp(0, 1)
        ok = valid[idx[prev]] & valid[idx[cur]] & (Eb[:, prev] == Eb[:, cur]).all(0)
        d[idx[cur]] = torch.where(ok, jsd, 0.0)
        bv[idx[cur]] = ok
    vals = d[bv].double()
    tau = math.inf if vals.numel() == 0 else min(max(float(torch.quantile(vals, QUANTILE)), TAU_MIN), TAU_MAX)
    return dict(selected=selected, valid=valid, d=d, bv=bv, tau=tau)


def alignment_core_dense(b: dict) -> dict:
    """The algorithm core's dense, vectorised path (alignopsd.rectify / alignopsd.credit)."""
    import alignopsd
    from alignopsd.rectification import similarity_matrix

    H = similarity_matrix(b["teacher"], b["student"], b["task"])
    E = alignopsd.eligibility(b["task"], b["rollout"], b["sv"], b["tv"])
    sel = alignopsd.select_sources(H, E, b["task"], b["rollout"], b["turn"], gamma=GAMMA, top_k=TOP_K)
    P, valid = alignopsd.correspondence_profiles(H, E, gamma=GAMMA, temperature=T_P)
    d, bv = alignopsd.boundary_scores(P, valid, E, b["task"], b["rollout"], b["turn"])
    tau = alignopsd.segmentation_threshold(d, bv, quantile=QUANTILE, tau_min=TAU_MIN, tau_max=TAU_MAX)
    return dict(selected=sel, valid=valid, d=d, bv=bv, tau=tau)


def _alignment_check(a: dict, b: dict) -> str:
    same_sel = a["selected"] == b["selected"]
    same_valid = bool(torch.equal(a["valid"], b["valid"])) and bool(torch.equal(a["bv"], b["bv"]))
    dd = float((a["d"] - b["d"]).abs().max())
    return (
        f"selections {'equal' if same_sel else 'DIFFER'}, validity {'equal' if same_valid else 'DIFFERS'}, "
        f"max|dd|={dd:.1e}, tau {a['tau']:.4g}/{b['tau']:.4g}"
    )


def alignment_case(dim: int, quick: bool, *, against: str = "loop") -> Case:
    tasks = 4 if quick else 16
    b = alignment_batch(tasks, 8, 50, dim)
    base = alignment_loop_baseline if against == "loop" else alignment_core_dense
    name = f"alignment_kernels_d{dim}" + ("" if against == "loop" else "_core")
    info = dict(M=tasks * 400, D=dim, tasks=tasks, rollouts=8, turns=50, baseline=against)
    return Case(name, lambda: alignment_ours(b), lambda: base(b), _alignment_check, info, 5)
