"""Per-phase wall time of a training step, and the alignment overhead over GRPO.

The step wraps each phase in ``profiler.phase(name)``; the profiler synchronises CUDA at both edges of a phase
and sums the wall time of every phase per step (a phase may be entered several times), also emits a ``torch.profiler``
``record_function`` range of the same name (so a torch.profiler trace shows the phases), and
keeps the history of all steps.

Phases (ALGORITHM.md §4 and the design card's data flow):

=====================  =========================================================  ===========
name                   what                                                       GRPO runs it
=====================  =========================================================  ===========
rollout_generation     student sampling of all turns                              yes
environment            environment steps (workers)                                yes
old_logprob            student log-probs of the sampled responses                 yes
reference              reference-policy log-probs (KL coefficient != 0)           yes
teacher_generation     teacher sampling from privileged prompts                   no
encoding               thinking encoder over student + teacher texts              no
m1_selection           H, eligibility, source selection, action filter            no
teacher_forcing        diagonal + cross teacher scoring                           no
rectify                M1 rectification (§2.7): aggregation, confidence, blend    no
advantage              GRPO outcome advantage (+ invalid-action residual)         yes
m2                     Mechanism 2 credit allocation                              no
update                 PPO forward/backward and optimiser steps                   yes
weight_sync            pushing updated weights to the generation engine           yes
=====================  =========================================================  ===========

The names (:data:`PHASES`), their labels (:func:`phase_label`) and the alignment set (:data:`ALIGNMENT_PHASES`) are
written here only: the report, the efficiency table (engine/lab/efficiency.py) and the plan
(engine/commands/plan.py) read them from here.

Host synchronisations (the host waiting for the device: ``.item()``, ``.tolist()``, copies to the host,
data-dependent output sizes) are counted per phase when a sync counter is registered
(:func:`register_sync_counter`: engine/observe/cuda_syncs.py on a CUDA device, or the test suite's fake CUDA device,
tests/engine/fake_cuda.py): each step's counts come
back as ``host_syncs/<phase>`` metrics and the profile summary reports their mean per step. The profiler's own
synchronisations at the phase edges are not counted.

Memory: each step and each phase records the process's peak resident memory while it ran (engine/observe/memory.py:
the process's high-water mark, reset at each edge, so nested scopes stay exact): ``memory/peak_rss_gib`` for the step
(shown on the progress line) and ``memory/phase_peak_rss_gib/<phase>`` for each phase that ran, both the maximum over
ranks (not ``memory/peak_rss_gib/<phase>``: MLflow stores a metric as a file, which cannot also be a folder); the
profile summary keeps each phase's largest peak.

``overhead_vs_grpo = alignment_seconds / (step_seconds - alignment_seconds)``, where the
alignment phases are those a GRPO step does not run. The ``alignopsd profile`` command that prints these
tables lives in engine/commands/profile.py.
"""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
from alignopsd.engine.observe.memory import GIB, PeakScope

from alignopsd.reduction import extreme_max, slowest, summed

PHASES = (
    "rollout_generation",
    "environment",
    "old_logprob",
    "reference",
    "teacher_generation",
    "encoding",
    "m1_selection",
    "teacher_forcing",
    "rectify",
    "advantage",
    "m2",
    "update",
    "weight_sync",
)
ALIGNMENT_PHASES = ("teacher_generation", "encoding", "m1_selection", "teacher_forcing", "rectify", "m2")
LABELS = {
    "rollout_generation": "rollout generation",
    "environment": "environment",
    "old_logprob": "old log-prob",
    "reference": "reference log-prob",
    "teacher_generation": "teacher generation",
    "encoding": "thinking encoding",
    "m1_selection": "M1 selection",
    "teacher_forcing": "teacher forcing",
    "rectify": "rectification",
    "advantage": "GRPO advantage",
    "m2": "M2 credit",
    "update": "PPO update",
    "weight_sync": "weight sync",
}


def phase_label(name: str, *, mark: bool = False) -> str:
    """The tables' label of phase ``name``; ``mark``: followed by `` *`` when it is an alignment phase (the tables'
    footnote)."""
    return LABELS[name] + (" *" if mark and name in ALIGNMENT_PHASES else "")


def check_phase(name: str) -> None:
    """Refuse a phase name the profiler does not know, naming the allowed ones."""
    if name not in PHASES:
        raise ValueError(f"phase: unknown name {name!r}; allowed: {', '.join(PHASES)}")


_PHASE: list[str] = []  # the phases being timed, innermost last
_SYNC_COUNTERS: list[SyncCounts] = []  # the registered sync counters, the newest last
OUTSIDE = "(outside a phase)"  # where a sync made outside every phase is booked


def register_sync_counter(counter: SyncCounts) -> None:
    """Count host syncs per phase with ``counter`` (the newest registered counts; its totals are read per step)."""
    _SYNC_COUNTERS.append(counter)


def unregister_sync_counter(counter: SyncCounts) -> None:
    _SYNC_COUNTERS.remove(counter)


def _sync_totals() -> dict[str, int] | None:
    return _SYNC_COUNTERS[-1].syncs_by_phase(exclude=("synchronize",)) if _SYNC_COUNTERS else None


def current_phase() -> str | None:
    """The innermost phase being timed now (None outside every phase): where host syncs are booked."""
    return _PHASE[-1] if _PHASE else None


class SyncCounts:
    """Host syncs per (phase, kind) in ``syncs``, each booked by :meth:`note_sync` to the phase being timed when it
    happens: what a counter given to :func:`register_sync_counter` keeps (engine/observe/cuda_syncs.py on a CUDA
    device; the test suite's fake CUDA device). Running totals; the profiler reads their growth per step."""

    def __init__(self) -> None:
        self.syncs: Counter = Counter()

    def note_sync(self, kind: str) -> None:
        self.syncs[(current_phase() or OUTSIDE, kind)] += 1

    def total_syncs(self) -> int:
        return sum(self.syncs.values())

    def syncs_by_phase(self, exclude: tuple[str, ...] = ()) -> dict[str, int]:
        """Host syncs per phase, leaving out the kinds in ``exclude`` (the profiler leaves out "synchronize")."""
        out: Counter = Counter()
        for (phase, kind), n in self.syncs.items():
            if kind not in exclude:
                out[phase] += n
        return dict(out)


def synchronize() -> None:
    """Wait for queued CUDA work (no-op without an initialised CUDA context)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StepProfiler:
    """Accumulates phase wall times per step."""

    def __init__(self) -> None:
        self.history: list[dict[str, float]] = []
        self.step_seconds: list[float] = []
        self.sync_history: list[dict[str, int]] = []  # host syncs per phase of each step (with a sync counter)
        self.peak_history: list[dict[str, int]] = []  # peak resident bytes of each phase that ran ("step": the step's)
        self._current: dict[str, float] = defaultdict(float)
        self._peaks: dict[str, int] = {}
        self._t0: float | None = None
        self._sync0: dict[str, int] | None = None
        self._scope: PeakScope | None = None

    def start_step(self) -> None:
        self._current = defaultdict(float)
        self._peaks = {}
        self._t0 = time.perf_counter()
        self._sync0 = _sync_totals()
        if self._scope is not None:  # a step that raised before its end
            self._scope.__exit__(None, None, None)
        self._scope = PeakScope().__enter__()

    @contextmanager
    def phase(self, name: str):
        """Time the enclosed block as phase ``name``; CUDA work queued inside is waited for at both edges, so
        asynchronous kernels are booked to the phase that launched them."""
        check_phase(name)
        synchronize()
        t = time.perf_counter()
        _PHASE.append(name)
        with torch.profiler.record_function(f"phase/{name}"), PeakScope() as mem:
            try:
                yield
            finally:
                _PHASE.pop()
                synchronize()
                self._current[name] += time.perf_counter() - t
        self._peaks[name] = max(self._peaks.get(name, 0), mem.peak)

    def add(self, name: str, seconds: float) -> None:
        """Account time measured elsewhere (e.g. environment time inside the rollout loop)."""
        check_phase(name)
        self._current[name] += float(seconds)

    def move(self, src: str, dst: str, seconds: float) -> None:
        """Re-attribute ``seconds`` measured inside phase ``src`` to phase ``dst``."""
        seconds = min(float(seconds), self._current.get(src, 0.0))
        self._current[src] -= seconds
        self._current[dst] += seconds

    def end_step(self) -> dict[str, float]:
        total = time.perf_counter() - self._t0 if self._t0 is not None else sum(self._current.values())
        phases = {k: float(self._current.get(k, 0.0)) for k in PHASES}
        self.history.append(phases)
        self.step_seconds.append(total)
        self._t0 = None
        out = {**{f"time/{k}": slowest(v) for k, v in phases.items()}, "time/step": slowest(total)}
        if self._scope is not None:
            self._scope.__exit__(None, None, None)
            self._peaks["step"], self._scope = self._scope.peak, None
            self.peak_history.append(dict(self._peaks))
            out["memory/peak_rss_gib"] = extreme_max(self._peaks["step"] / GIB, 1)
            out.update(
                {
                    f"memory/phase_peak_rss_gib/{k}": extreme_max(v / GIB, 1)
                    for k, v in self._peaks.items()
                    if k != "step"
                }
            )
        now = _sync_totals()
        if self._sync0 is not None and now is not None:
            syncs = {k: now.get(k, 0) - self._sync0.get(k, 0) for k in (*PHASES, OUTSIDE)}
            self.sync_history.append(syncs)
            out.update({f"host_syncs/{k if k != OUTSIDE else 'other'}": summed(v) for k, v in syncs.items()})
            out["host_syncs/step"] = summed(sum(syncs.values()))
        return out


def summarize(
    history: list[dict[str, float]],
    step_seconds: list[float],
    *,
    skip: int = 0,
    counts: list[dict[str, float]] | None = None,
    syncs: list[dict[str, int]] | None = None,
    peaks: list[dict[str, int]] | None = None,
) -> dict:
    """Mean seconds per step of each phase, the step time and the alignment overhead (profile JSON).

    ``peaks``: peak resident bytes per phase of each step (``StepProfiler.peak_history``): the largest over the steps
    (all of them, warm-up included: memory is not a rate) into ``summary["peak_rss_gib"]`` (``"step"``: the steps').
    ``counts``: per-step quantities (rows, token lengths; one dict per step, aligned with ``history``), averaged
    over the same steps into ``summary["counts"]`` (a key missing in a step is averaged over the steps that have it).
    ``syncs``: host syncs per phase of each step (``StepProfiler.sync_history``, aligned with ``history``),
    averaged into ``summary["host_syncs"]`` (phases with none left out) and ``summary["host_syncs_total"]``.
    """
    hist = history[skip:] or history
    steps = step_seconds[skip:] or step_seconds
    if not hist:
        raise ValueError("history: no profiled step")
    if counts is not None and len(counts) != len(history):
        raise ValueError(f"counts: {len(counts)} step(s), history has {len(history)}")
    phases = {k: sum(h.get(k, 0.0) for h in hist) / len(hist) for k in PHASES}
    step = sum(steps) / len(steps)
    align = sum(phases[k] for k in ALIGNMENT_PHASES)
    base = step - align
    out = {
        "phases": phases,
        "step_seconds": step,
        "alignment_seconds": align,
        "overhead_vs_grpo": align / base if base > 0 else float("inf"),
        "steps": len(hist),
    }
    if counts is not None:
        kept = counts[skip:] if history[skip:] else counts
        keys = sorted({k for c in kept for k in c})
        out["counts"] = {k: sum(c[k] for c in kept if k in c) / sum(k in c for c in kept) for k in keys}
    if syncs:
        if len(syncs) != len(history):
            raise ValueError(f"syncs: {len(syncs)} step(s), history has {len(history)}")
        kept_s = syncs[skip:] if history[skip:] else syncs
        mean = {k: sum(s.get(k, 0) for s in kept_s) / len(kept_s) for k in (*PHASES, OUTSIDE)}
        out["host_syncs"] = {k: v for k, v in mean.items() if v}
        out["host_syncs_total"] = sum(mean.values())
    if peaks:
        names = [k for k in ("step", *PHASES) if any(k in p for p in peaks)]
        out["peak_rss_gib"] = {k: max(p.get(k, 0) for p in peaks) / GIB for k in names}
    return out


def format_table(summary: dict, title: str = "") -> str:
    """Markdown table: phase, seconds per step, share of the step."""
    step = summary["step_seconds"]
    lines = []
    if title:
        lines.append(f"**{title}**\n")
    lines += ["| phase | s/step | share |", "|---|---:|---:|"]
    for k in PHASES:
        v = summary["phases"][k]
        lines.append(f"| {phase_label(k, mark=True)} | {v:.3f} | {100 * v / step if step > 0 else 0:.1f}% |")
    other = step - sum(summary["phases"].values())
    lines.append(f"| (other: bookkeeping, logging) | {other:.3f} | {100 * other / step if step > 0 else 0:.1f}% |")
    lines.append(f"| **step** | **{step:.3f}** | 100% |")
    lines.append("")
    lines.append(
        f"alignment phases (*): {summary['alignment_seconds']:.3f} s/step; "
        f"overhead over GRPO = {100 * summary['overhead_vs_grpo']:.1f}% "
        f"(alignment / (step - alignment), {summary['steps']} step(s))"
    )
    if summary.get("counts"):
        lines.append("per step: " + ", ".join(f"{k} {v:g}" for k, v in summary["counts"].items()))
    if "host_syncs_total" in summary:
        per = ", ".join(f"{LABELS.get(k, k)} {v:g}" for k, v in summary["host_syncs"].items())
        lines.append(f"host syncs per step (host waits for the device): {summary['host_syncs_total']:g} ({per})")
    if summary.get("peak_rss_gib"):
        mem = summary["peak_rss_gib"]
        per = ", ".join(f"{LABELS.get(k, k)} {v:.2f}" for k, v in mem.items() if k != "step")
        lines.append(f"peak resident memory (GiB): step {mem.get('step', 0.0):.2f} ({per})")
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    return f"{b / a:.2f}" if a > 0 else "–"


def format_side_by_side(summaries: dict[str, dict], *, ratio: bool = False) -> str:
    """One markdown table with one s/step + share column pair per run (estimator, backend, ...).

    ``ratio`` (exactly two runs): a last column with the second run's value over the first's. Summaries that
    carry ``counts`` add one row per count (share cells empty).
    """
    names = list(summaries)
    if ratio and len(names) != 2:
        raise ValueError(f"ratio: needs exactly two runs, got {len(names)} ({', '.join(names)})")
    end = f" {names[1]} / {names[0]} |" if ratio else ""
    head = "| phase | " + " | ".join(f"{n} s/step | {n} share" for n in names) + " |" + end
    sep = "|---|" + "---:|---:|" * len(names) + ("---:|" if ratio else "")
    lines = [head, sep]

    def row(label: str, cells: list[str], vals: list[float]) -> str:
        return f"| {label} | " + " | ".join(cells) + " |" + (f" {_ratio(*vals)} |" if ratio else "")

    for k in PHASES:
        cells, vals = [], []
        for n in names:
            s = summaries[n]
            v = s["phases"][k]
            vals.append(v)
            cells.append(f"{v:.3f} | {100 * v / s['step_seconds'] if s['step_seconds'] > 0 else 0:.1f}%")
        lines.append(row(phase_label(k, mark=True), cells, vals))
    steps = [summaries[n]["step_seconds"] for n in names]
    lines.append(row("**step**", [f"**{v:.3f}** | 100%" for v in steps], steps))
    over = [summaries[n]["overhead_vs_grpo"] for n in names]
    lines.append(row("alignment overhead vs GRPO", [f"{100 * v:.1f}% | " for v in over], over))
    keys = sorted({k for n in names for k in summaries[n].get("counts", {})})
    for k in keys:
        vals = [summaries[n].get("counts", {}).get(k) for n in names]
        cells = ["– | " if v is None else f"{v:g} | " for v in vals]
        lines.append(row(k, cells, vals) if None not in vals else row(k, cells, [0.0, 0.0]))
    return "\n".join(lines)


SUMMARY_KEYS = ("phases", "step_seconds", "alignment_seconds", "overhead_vs_grpo", "counts", "host_syncs",
                "host_syncs_total", "peak_rss_gib")  # fmt: skip


def write_json(summary: dict, path: str | Path) -> None:
    out = {k: summary[k] for k in SUMMARY_KEYS if k in summary}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
