"""Estimator cases: the names under which commands and benchmarks set an estimator (and an AlignOPSD ablation) up.

A case is a name and the dotted overrides that make a config run it: ``grpo``, ``opsd``, ``grpo_opsd``, ``sdar``,
``rlsd``, ``alignopsd_m1``, ``alignopsd_A`` … ``alignopsd_D`` (ALGORITHM.md §3.11) and ``alignopsd``, the full method
(ablation E); any other registered estimator is a case under its own name. ``alignopsd ablate`` reads its
``--estimators`` as cases, and the credit benchmarks (bench/credit.py) name their runs by them.
"""

from __future__ import annotations

from alignopsd.estimators import ESTIMATORS

__all__ = ["BASELINE", "ESTIMATOR_CASES", "FULL_METHOD", "case_overrides", "case_names"]

BASELINE = "grpo"
"""The case every other is compared with first: plain GRPO."""

FULL_METHOD = "alignopsd"
"""The full method, AlignOPSD with ablation E."""

ESTIMATOR_CASES: dict[str, tuple[str, ...]] = {
    "grpo": ("algorithm.estimator=grpo",),
    "opsd": ("algorithm.estimator=opsd",),
    "grpo_opsd": ("algorithm.estimator=grpo_opsd",),
    "sdar": ("algorithm.estimator=sdar",),
    "rlsd": ("algorithm.estimator=rlsd",),
    "alignopsd_m1": ("algorithm.estimator=alignopsd_m1",),
    **{f"alignopsd_{ab}": ("algorithm.estimator=alignopsd", f"algorithm.ablation={ab}") for ab in "ABCD"},
    "alignopsd": ("algorithm.estimator=alignopsd", "algorithm.ablation=E"),
}
"""The built-in cases, in the order the benchmarks' tables list them."""


def case_names() -> list[str]:
    """Every case: the built-in ones, then every other registered estimator (a plug-in's) under its name."""
    return [*ESTIMATOR_CASES, *(n for n in ESTIMATORS if n not in ESTIMATOR_CASES)]


def case_overrides(name: str) -> list[str]:
    """The dotted overrides of case ``name`` (ValueError naming the known cases)."""
    if name in ESTIMATOR_CASES:
        return list(ESTIMATOR_CASES[name])
    if name in case_names():
        return [f"algorithm.estimator={name}"]
    raise ValueError(f"estimator case: unknown {name!r}; known: {', '.join(case_names())}")
