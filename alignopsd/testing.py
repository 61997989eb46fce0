"""Testing utilities, shipped but labelled (as ``torch.testing`` is): nothing a run does calls them.

* Slow per-turn loop references of the vectorised functions of ``alignopsd.advantage`` and ``alignopsd.credit``
  (``*_ref``, :class:`CreditRef`). Each restates ALGORITHM.md §3 as directly as possible: one Python loop iteration
  per turn, trajectory, pair or span, with Python floats (float64) for the scalar arithmetic. The tests compare the
  vectorised functions against these; the benchmark (bench/bench_alignment.py) times them as the baseline.
  Segmentation and box projection are sequential by nature: the references call the Python implementations of
  ``alignopsd.credit`` (which the C++ path matches bit for bit). Mechanism 1's oracles are the test suite's own
  (tests/m1_oracle.py).
* The kernels' routing switches (their state is the kernels' dispatch, ``alignopsd.kernels._dispatch.ROUTING``, which
  its routing rule and its launches read; all are process-wide context managers that nest and are not thread-local):
  :func:`force_kernels` (the algorithm core treats CPU tensors as it treats CUDA ones and runs the Triton kernels in
  the interpreter; needs ``TRITON_INTERPRET=1``), :func:`torch_paths_only` (``impl="auto"`` and the core's routing
  pick the torch paths even for CUDA tensors: a CUDA device that cannot launch kernels) and
  :func:`launches_on_host` (every kernel launch runs on the host, on its arguments mapped by a function: a fake CUDA
  device over CPU memory, as the test suite's tests/engine/fake_cuda.py), with the LM head's kernels served by their
  torch paths (:data:`LAUNCH_REFERENCES`) where the interpreter would be too slow.
* The custom CPU kernels' measured choice (``alignopsd.kernels.native_choice``): :func:`record_kernel_choice` sets the
  choice a test wants (a :class:`KernelChoice` of injected times), :func:`forget_kernel_choices` drops them all so the
  next use measures again.

Legend: M = canonical turns, L = response length.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from alignopsd.credit_config import CreditConfig
from alignopsd.kernels import HAS_TRITON, interpret_mode
from alignopsd.kernels._dispatch import ROUTING
from alignopsd.kernels.head.torch_tiles import torch_backward, torch_partials
from alignopsd.kernels.native_choice import KernelChoice
from alignopsd.kernels.native_choice import forget as forget_kernel_choices
from alignopsd.kernels.native_choice import record as record_kernel_choice
from alignopsd.projection import project_one
from alignopsd.segmentation import random_lists, segment_lists

__all__ = [
    "KernelChoice",
    "forget_kernel_choices",
    "record_kernel_choice",
    "LAUNCH_REFERENCES",
    "force_kernels",
    "launches_on_host",
    "torch_paths_only",
    "grpo_advantage_ref",
    "invalid_action_residual_ref",
    "correspondence_profiles_ref",
    "boundary_scores_ref",
    "segmentation_threshold_ref",
    "allocate_credit_ref",
    "CreditRef",
]


# ----------------------------------------------------------------------------------------------------------------------
# the kernels' routing switches
# ----------------------------------------------------------------------------------------------------------------------


@contextmanager
def force_kernels() -> Iterator[None]:
    """Within the block, the algorithm core treats CPU tensors as kernel-eligible (process-wide).

    Normally only CUDA tensors go from the core to the Triton kernels; inside ``with force_kernels():``
    CPU tensors do too, and the kernels run in the Triton interpreter. It requires ``TRITON_INTERPRET=1`` when
    entered (RuntimeError otherwise), nests, and is not thread-local.
    """
    if not HAS_TRITON:
        raise RuntimeError("force_kernels: triton is not importable")
    if not interpret_mode():
        raise RuntimeError("force_kernels: needs the Triton interpreter on CPU; set TRITON_INTERPRET=1 first")
    ROUTING.forced += 1
    try:
        yield
    finally:
        ROUTING.forced -= 1


@contextmanager
def torch_paths_only() -> Iterator[None]:
    """Within the block, ``impl="auto"`` and the core's kernel routing pick the torch paths even for CUDA tensors.

    For a CUDA device that cannot launch kernels (the test suite's fake CUDA device, tests/engine/fake_cuda.py: CUDA
    metadata over CPU memory). Nests; process-wide, not thread-local.
    """
    ROUTING.torch_only += 1
    try:
        yield
    finally:
        ROUTING.torch_only -= 1


def _lp_fwd_reference(h, w, b, t, m, s, u, tz, N, V, H, shn, swv, inv_t, vocab_start, v_per_split, *, HAS_BIAS, **_):
    """The log-prob forward kernel's writes: partials (m, s, u, tz) of every row over each vocabulary split
    ``[k * v_per_split, ...)``, into row k, by the torch tiles."""
    for k, v0 in enumerate(range(0, V, v_per_split)):
        v1 = min(V, v0 + v_per_split)
        parts = torch_partials(h, w[v0:v1], b[v0:v1] if HAS_BIAS else None, t, inv_t, vocab_start + v0)
        for out, part in zip((m, s, u, tz), parts):
            out[k].copy_(part)


def _lp_bwd_reference(*args, HAS_BIAS, HAS_GENT, NEED_H, NEED_W, NEED_B, **_) -> None:
    """The log-prob backward kernel's writes: the gradients added into ``dh``/``dw``/``db`` (the kernel adds them
    atomically into zeroed buffers), by the torch tiles."""
    h, w, b, t, lse, ent, glp, gent, dh, dw, db, _n, _v, _h, _shn, _swv, inv_t, vocab_start = args
    bias, g_ent = (b if HAS_BIAS else None), (gent if HAS_GENT else None)
    grads = torch_backward(h, w, bias, t, inv_t, vocab_start, lse, ent, glp, g_ent, NEED_H, NEED_W, NEED_B)
    for buf, g in zip((dh, dw, db), grads):
        if g is not None:
            buf.add_(g)


# kernel name -> a torch function with the kernel's arguments and writes, run by launches_on_host instead of the
# Triton interpreter (too slow for the LM head's shapes)
LAUNCH_REFERENCES: dict[str, Callable[..., None]] = {
    "_lp_fwd_kernel": _lp_fwd_reference,
    "_lp_bwd_kernel": _lp_bwd_reference,
}


@contextmanager
def launches_on_host(args_map: Callable[[Any], Any], note: Callable[[str], None] | None = None) -> Iterator[None]:
    """Within the block, every kernel launch passes each argument through ``args_map`` and runs on the host: a
    kernel with a :data:`LAUNCH_REFERENCES` entry runs that, any other runs in the Triton interpreter.

    For a device whose launches the host serves: the test suite's fake CUDA device (tests/engine/fake_cuda.py: CUDA
    metadata over CPU memory) maps its fake CUDA tensors to the CPU tensors behind them, so the launch writes the
    memory the caller sees. ``note(kernel name)`` is called at each launch. Nests (the innermost applies);
    process-wide."""

    def serve(fn: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if note is not None:
            note(fn.__name__)
        args = tuple(map(args_map, args))
        kwargs = {k: args_map(v) for k, v in kwargs.items()}
        ref = LAUNCH_REFERENCES.get(fn.__name__)
        if ref is None:
            return args, kwargs
        ref(*args, **kwargs)
        return None

    ROUTING.host_launch.append(serve)
    try:
        yield
    finally:
        ROUTING.host_launch.remove(serve)


def _mean_std(values: list[float], weights: list[float]) -> tuple[float, float]:
    n = sum(weights)
    mean = sum(w * v for v, w in zip(values, weights)) / n
    var = sum(w * (v - mean) ** 2 for v, w in zip(values, weights)) / (n - 1)
    return mean, math.sqrt(var)


def grpo_advantage_ref(outcome, task, rollout, *, scope="trajectory", norm_by_std=True, eps=1e-6) -> Tensor:
    """Loop reference of ``grpo_advantage``: a dict of tasks -> trajectories -> turns."""
    r, tk, ro = outcome.double().tolist(), task.tolist(), rollout.tolist()
    trajs: dict[tuple[int, int], list[int]] = {}
    for u in range(len(r)):
        trajs.setdefault((tk[u], ro[u]), []).append(u)
    by_task: dict[int, list[tuple[int, int]]] = {}
    for key in sorted(trajs):
        by_task.setdefault(key[0], []).append(key)
    out = [0.0] * len(r)
    for keys in by_task.values():
        vals = [r[trajs[k][0]] for k in keys]
        weights = [float(len(trajs[k])) if scope == "turn" else 1.0 for k in keys]
        mean, std = _mean_std(vals, weights)
        for k, v in zip(keys, vals):
            a = 0.0 if max(vals) == min(vals) else ((v - mean) / (std + eps) if norm_by_std else v - mean)
            for u in trajs[k]:
                out[u] = a
    return torch.tensor(out, dtype=torch.float32)


def invalid_action_residual_ref(outcome, invalid, task, *, penalty, norm_by_std=True) -> Tensor:
    """Loop reference of ``invalid_action_residual``."""
    return torch.tensor(_residual_f64(outcome, invalid, task, penalty, norm_by_std), dtype=torch.float32)


def correspondence_profiles_ref(H: Tensor, eligible: Tensor, *, gamma: float, temperature: float = 0.1):
    """Loop over targets: P[t, eligible s] = softmax(H[s, t] / T_p); valid = best eligible H >= gamma."""
    m = H.shape[0]
    P = torch.zeros(m, m, dtype=torch.float32)
    valid = torch.zeros(m, dtype=torch.bool)
    for t in range(m):
        src = torch.nonzero(eligible[:, t]).flatten()
        if src.numel() == 0:
            continue
        col = H[src, t].float()
        P[t, src] = torch.softmax(col / temperature, dim=0)
        valid[t] = bool(col.max() >= gamma)
    return P, valid


def _distance_ref(p: Tensor, q: Tensor, distance: str, m: int) -> float:
    p, q = p.double(), q.double()
    if distance == "cosine":
        return min(max(1.0 - float(p @ q) / (float(p.norm()) * float(q.norm())), 0.0), 1.0)
    if distance == "entropy":

        def ent(x: Tensor) -> float:
            nz = x[x > 0]
            return -float((nz * nz.log()).sum())

        return abs(ent(p) - ent(q)) / math.log(m) if m > 1 else 0.0
    mid = 0.5 * (p + q)
    kl = 0.0
    for x in (p, q):
        nz = x > 0
        kl += 0.5 * float((x[nz] * (x[nz].log() - mid[nz].log())).sum())
    return min(max(kl / math.log(2.0), 0.0), 1.0)


def _trajectories(task: Tensor, rollout: Tensor, turn: Tensor) -> list[list[int]]:
    """Turn indices of each trajectory in sorted (task, rollout) order, each ordered by turn id."""
    tk, ro, tu = task.tolist(), rollout.tolist(), turn.tolist()
    trajs: dict[tuple[int, int], list[int]] = {}
    for u in range(len(tk)):
        trajs.setdefault((tk[u], ro[u]), []).append(u)
    return [sorted(trajs[k], key=lambda u: tu[u]) for k in sorted(trajs)]


def boundary_scores_ref(P, profile_valid, eligible, task, rollout, turn, *, distance="jsd"):
    """Loop over consecutive turn pairs of each trajectory (dense M-dimensional profiles)."""
    m = P.shape[0]
    d = torch.zeros(m, dtype=torch.float32)
    bv = torch.zeros(m, dtype=torch.bool)
    for us in _trajectories(task, rollout, turn):
        for prev, cur in zip(us[:-1], us[1:]):
            if profile_valid[prev] and profile_valid[cur] and torch.equal(eligible[:, prev], eligible[:, cur]):
                bv[cur] = True
                d[cur] = _distance_ref(P[prev], P[cur], distance, m)
    return d, bv


def segmentation_threshold_ref(d, boundary_valid, *, quantile=0.8, tau_min=0.01, tau_max=0.10) -> float:
    """Linear-interpolation quantile written out (numpy's 'linear' method)."""
    vals = sorted(float(x) for x, v in zip(d.tolist(), boundary_valid.tolist()) if v)
    if not vals:
        return math.inf
    pos = quantile * (len(vals) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    q = vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)
    return min(max(q, tau_min), tau_max)


@dataclass
class CreditRef:
    """Main per-turn outputs of ``allocate_credit_ref`` (input order)."""

    advantage: Tensor
    turn_weight: Tensor
    token_advantage: Tensor
    segment_index: Tensor
    threshold: float
    turn_gap: Tensor
    score: Tensor
    raw_density: Tensor
    density: Tensor
    residual: Tensor
    profile_valid: Tensor
    boundary_distance: Tensor
    boundary_valid: Tensor


def _softmax(logits: list[float]) -> list[float]:
    mx = max(logits)
    e = [math.exp(x - mx) for x in logits]
    z = sum(e)
    return [x / z for x in e]


def _sign(x: float) -> float:
    return (x > 0) - (x < 0)


def _token_mode_ref(cfg, trajs, maskb, gap, a, residual, weights, h_out, x_out, token_adv) -> None:
    """Ablation B, loop form: per trajectory, softmax over its policy tokens, projection; fills the outputs."""
    lo, hi = cfg.box
    tc = cfg.credit_temperature
    for us in trajs:
        toks = [(u, j) for u in us for j in torch.nonzero(maskb[u]).flatten().tolist()]
        n_tau = float(len(toks))
        sg = _sign(a[us[0]])
        q = _softmax([sg * float(gap[u, j]) / tc for u, j in toks])
        raw = [n_tau * v for v in q]
        x, err = project_one(
            torch.tensor(raw, dtype=torch.float64), torch.ones(len(raw), dtype=torch.float64), lo, hi, 1e-5
        )
        if x is None:
            raise ValueError(err)
        xl = x.tolist()
        for u in us:
            idx = [k for k, (uu, _) in enumerate(toks) if uu == u]
            weights[u] = sum(xl[k] for k in idx) / len(idx)
            h_out[u] = sum(raw[k] for k in idx) / len(idx)
            x_out[u] = weights[u]
        for k, (u, j) in enumerate(toks):
            token_adv[u, j] = a[u] * xl[k] + residual[u]


def _segments_ref(cfg, trajs, m, H, eligible, task, rollout, turn):
    """Spans of every trajectory (lists of turn indices), the global span index per turn, tau, and the
    profile validity, distances and boundary validity (modes "adaptive" and "random"; "turn": one span)."""
    seg_index = [-1] * m
    tau = math.inf
    pv = torch.zeros(m, dtype=torch.bool)
    d = torch.zeros(m, dtype=torch.float32)
    bv = torch.zeros(m, dtype=torch.bool)
    segments: list[list[list[int]]] = []  # per trajectory: list of spans (turn indices)
    if cfg.mode == "turn":
        segments = [[us] for us in trajs]
    else:
        P, pv = correspondence_profiles_ref(H, eligible, gamma=cfg.gamma, temperature=cfg.profile_temperature)
        d, bv = boundary_scores_ref(P, pv, eligible, task, rollout, turn, distance=cfg.distance)
        tau = segmentation_threshold_ref(d, bv, quantile=cfg.quantile, tau_min=cfg.tau_min, tau_max=cfg.tau_max)
        k = 0
        for j, us in enumerate(trajs):
            dl = [float(d[u]) for u in us]
            vl = [bool(bv[u]) for u in us]
            if cfg.mode == "adaptive":
                res = segment_lists(dl, vl, tau, cfg.min_span_turns, cfg.max_span_turns, cfg.tau_min)
            else:
                res = random_lists(len(us), cfg.min_span_turns, cfg.max_span_turns, cfg.seed + j, dl, vl, cfg.tau_min)
            edges = [0] + sorted(p for p, _ in res) + [len(us)]
            spans = [us[edges[i] : edges[i + 1]] for i in range(len(edges) - 1)]
            segments.append(spans)
            for span in spans:
                for u in span:
                    seg_index[u] = k
                k += 1
    return segments, seg_index, tau, pv, d, bv


def allocate_credit_ref(
    gap, mask, outcome, task, rollout, turn, H, eligible, config: CreditConfig | None = None, *, invalid=None
) -> CreditRef:
    """Loop reference of ``allocate_credit`` (no input validation, no metrics)."""
    cfg = CreditConfig() if config is None else config
    m, L = gap.shape
    maskb = mask.bool()
    lo, hi = cfg.box
    tc = cfg.credit_temperature
    trajs = _trajectories(task, rollout, turn)
    adv = grpo_advantage_ref(outcome, task, rollout, scope=cfg.grpo_scope, norm_by_std=cfg.norm_by_std).double()
    ntok = [0.0] * m
    g = [0.0] * m
    for u in range(m):
        toks = torch.nonzero(maskb[u]).flatten()
        ntok[u] = float(toks.numel())
        g[u] = float(gap[u, toks].double().sum()) / ntok[u]
    a = adv.tolist()
    s = [_sign(a[u]) * g[u] for u in range(m)]
    residual = [0.0] * m
    if invalid is not None and cfg.invalid_penalty > 0:
        residual = _residual_f64(outcome, invalid, task, cfg.invalid_penalty, cfg.norm_by_std)

    seg_index = [-1] * m
    tau = math.inf
    pv = torch.zeros(m, dtype=torch.bool)
    d = torch.zeros(m, dtype=torch.float32)
    bv = torch.zeros(m, dtype=torch.bool)
    weights = [1.0] * m
    h_out = [1.0] * m
    x_out = [1.0] * m
    token_adv = torch.zeros(m, L, dtype=torch.float32)

    if cfg.mode == "token":
        _token_mode_ref(cfg, trajs, maskb, gap, a, residual, weights, h_out, x_out, token_adv)
    else:
        segments, seg_index, tau, pv, d, bv = _segments_ref(cfg, trajs, m, H, eligible, task, rollout, turn)
        for us, spans in zip(trajs, segments):
            n_tau = sum(ntok[u] for u in us)
            b = _softmax([math.log(sum(ntok[u] for u in sp)) + (sum(s[u] for u in sp) / len(sp)) / tc for sp in spans])
            h = {}
            for bk, sp in zip(b, spans):
                q = _softmax([math.log(ntok[u]) + s[u] / tc for u in sp])
                for u, qu in zip(sp, q):
                    h[u] = n_tau * bk * qu / ntok[u]
            x, err = project_one(
                torch.tensor([h[u] for u in us], dtype=torch.float64),
                torch.tensor([ntok[u] for u in us], dtype=torch.float64),
                lo,
                hi,
                1e-5,
            )
            if x is None:
                raise ValueError(err)
            for u, xu in zip(us, x.tolist()):
                h_out[u] = h[u]
                x_out[u] = xu
                weights[u] = (1.0 - cfg.mixing) + cfg.mixing * xu
        for u in range(m):
            coef = float(torch.tensor(a[u] * weights[u] + residual[u], dtype=torch.float64).float())
            for j in torch.nonzero(maskb[u]).flatten().tolist():
                token_adv[u, j] = coef
    f32 = torch.float32
    return CreditRef(
        advantage=adv.float(),
        turn_weight=torch.tensor(weights, dtype=f32),
        token_advantage=token_adv,
        segment_index=torch.tensor(seg_index if cfg.mode in ("adaptive", "random") else [-1] * m),
        threshold=tau,
        turn_gap=torch.tensor(g, dtype=f32),
        score=torch.tensor(s, dtype=f32),
        raw_density=torch.tensor(h_out, dtype=f32),
        density=torch.tensor(x_out, dtype=f32),
        residual=torch.tensor(residual, dtype=f32),
        profile_valid=pv,
        boundary_distance=d,
        boundary_valid=bv,
    )


def _residual_f64(outcome, invalid, task, penalty: float, norm_by_std: bool = True) -> list[float]:
    """Per-task loop of r = norm(R - c * invalid) - norm(R), float64 (unrounded, to compose with A * w);
    norm divides by (std + 1e-6) only when ``norm_by_std``."""
    r, inv, tk = outcome.double().tolist(), invalid.tolist(), task.tolist()
    groups: dict[int, list[int]] = {}
    for u in range(len(r)):
        groups.setdefault(tk[u], []).append(u)
    out = [0.0] * len(r)
    for us in groups.values():

        def norm(v: list[float], us=us) -> list[float]:
            if len(us) == 1:
                return v
            mean, std = _mean_std(v, [1.0] * len(v))
            return [(x - mean) / (std + 1e-6 if norm_by_std else 1.0) for x in v]

        for u, x, y in zip(us, norm([r[u] - penalty * float(inv[u]) for u in us]), norm([r[u] for u in us])):
            out[u] = x - y
    return out
