"""Suite-wide settings and shared test support.

- This folder is on ``sys.path`` (pytest's default import mode inserts a conftest's folder), so ``m1_oracle`` -- the
  test oracles of Mechanism 1 -- imports from any area; so is the repository root (pyproject.toml's ``pythonpath``),
  which keeps tests/alignopsd/ from being taken for the package (tests/test_pytest_entry.py).
- Strict mode (engine/observe/strict.py): a diagnostic that would swallow an exception to keep a run alive raises it in
  every test instead of counting it.
- Every ``dtype: auto`` model of the suite resolves as on a CPU without native bf16 or fp16 (float32), whatever CPU
  runs the suite, so the recorded numbers (golden traces, exact-resume comparisons, and the subprocesses that
  inherit the environment) do not depend on the machine. Tests of the choice itself pass the CPU's flags in
  (tests/engine/test_hardware.py).
- The custom CPU paths (the C++ kernels, packed rows) are pinned to the torch paths and padded rows
  (``ALIGNOPSD_CPU_PATHS=torch``), as the dtype is, so an exact-resume or golden comparison never meets two
  processes that measured differently; the tests of the choice itself unset it. No choice outlives its test.
"""

from __future__ import annotations

import os

import pytest
from alignopsd.engine.observe.strict import STRICT_ENV

from alignopsd.testing import forget_kernel_choices

os.environ[STRICT_ENV] = "1"  # before any test imports the engine's runs, and inherited by torchrun children
os.environ["ALIGNOPSD_CPU_FLAGS"] = ""
# no measured CPU path choice (kernels/native_choice.py): two runs of a test compute bit-identically on any CPU
os.environ["ALIGNOPSD_CPU_PATHS"] = "torch"


@pytest.fixture(autouse=True)
def _fresh_kernel_choices():
    """Each test starts with no measured custom-kernel choice (kernels/native_choice.py is process-wide state: a
    choice one test records must not route the next)."""
    yield
    forget_kernel_choices()
