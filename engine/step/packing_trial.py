"""Packed or padded rows for the policy's forwards on a CPU (``trainer.ppo.use_remove_padding: auto``), measured by the
update on its own micro-batches, forward and backward.

A packed forward attends row by row (engine/policy/varlen_attention.py): it computes no padding but makes a call per
row, and its backward differs from its forward in how much the per-row calls cost. A probe of the forward alone
chose packed rows on an AVX2 CPU where the update then ran 12-23 % slower packed than padded
(bench/results/update-avx2-2026-12-06.md). So the choice is timed on what the update runs, at no extra operands:
the first ``TRIAL_MICRO_BATCHES`` micro-batches of the run's first update each run both ways at half of their
token-mean scale (the gradient is the sum of two halves of the same gradient, which the two paths give equal to
1e-5 in fp32; the metrics are their mean), in alternating order so that each path is the first call once, and the
path with fewer seconds in sum is the trial's result (a ``RowsChoice``), set on the policy's ``RowLayout``
(engine/policy/base.py) and so taken by every later forward: the update's, the old-log-prob pass's and the
rescoring's (which take padded rows until the update has chosen). On several data-parallel ranks the seconds are
summed over the ranks before the choice, so every rank takes the same path. The supervised warm start
(engine/run/warm_start.py) runs the same trial on its first steps, and the RL run that follows in the same process is
handed its choice. The trial costs about ``TRIAL_MICRO_BATCHES`` extra micro-batches once per process; a checkpoint
stores the choice (``TrainerState.rows``), a resumed run takes it and measures nothing, and
``ALIGNOPSD_CPU_PATHS=torch`` takes padded rows without timing (engine/run/components.py ``start_rows``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from alignopsd.engine.checkpoint.trainer_state import RowsChoice
from alignopsd.engine.policy.base import PolicyBackend
from alignopsd.engine.step.micro_batches import MicroBatch

log = logging.getLogger(__name__)

TRIAL_MICRO_BATCHES = 2
clock = time.perf_counter  # the trial's clock (a test injects the seconds it wants measured)


class PackingTrial:
    """The update's measurement of packed against padded rows (see the module docstring). ``policy``: the backend
    (measured only where its ``rows`` are undecided: auto on a CPU, and not chosen yet); ``group``: its data-parallel
    group over ``world`` ranks; ``what``: the training it times, for the log line (the update, the warm start).
    :attr:`runs` counts the micro-batches it ran both ways (each a second forward and backward)."""

    def __init__(self, policy: PolicyBackend, group=None, world: int = 1, *, what: str = "update") -> None:
        self.policy, self.group, self.world, self.what = policy, group, world, what
        self.seconds = {True: 0.0, False: 0.0}
        self.runs, self.rows = 0, 0
        self.active = policy.rows.undecided

    def run(
        self, step: Callable[[MicroBatch], tuple], mb: MicroBatch, sync: Callable[[], contextlib.AbstractContextManager]
    ) -> list[tuple[MicroBatch, tuple, bool]]:
        """Forward and backward of ``mb`` by ``step``: once in the policy's rows, or, during the trial, packed and
        padded at half scale each (``sync()``: the gradient synchronisation context of the micro-batch's last
        backward). Returns a (micro-batch as run, ``step``'s output, whether its rows were packed) triple per pass."""
        if not self.active:
            with sync():
                return [(mb, step(mb), self.policy.rows.packs())]
        half = dataclasses.replace(mb, scale=mb.scale / 2)
        order = (True, False) if self.runs % 2 == 0 else (False, True)
        out = []
        for i, packed in enumerate(order):
            with self.policy.no_sync() if i == 0 else sync(), self.policy.rows.forced(packed):
                t = clock()
                out.append((half, step(half), packed))
                self.seconds[packed] += clock() - t
        self.runs += 1
        self.rows += len(mb.rows)
        if self.runs == TRIAL_MICRO_BATCHES:
            self.settle()
        return out

    def settle(self) -> RowsChoice | None:
        """The faster rows from what was timed, set on the policy's ``RowLayout`` (at the update's end when it had
        fewer micro-batches than the trial wants; None when nothing was timed)."""
        if not self.active or not self.runs:
            return None
        t = torch.tensor([self.seconds[True], self.seconds[False]], dtype=torch.float64)
        if self.world > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(t, group=self.group)
        packed_s, padded_s = float(t[0]), float(t[1])
        shape = f"the first {self.runs} micro-batches of the {self.what} ({self.rows} rows), forward and backward"
        choice = self.policy.rows.choose(RowsChoice(packed_s < padded_s, packed_s, padded_s, shape))
        self.active = False
        log.info("kernels: %s", choice.describe())
        return choice
