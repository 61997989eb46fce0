"""Suite-wide setting: every ``dtype: auto`` model of the suite resolves as on a CPU without native bf16 or fp16
(float32), whatever CPU runs the suite, so the recorded numbers (golden traces, exact-resume comparisons, and the
subprocesses that inherit the environment) do not depend on the machine. Tests of the choice itself pass the CPU's
flags in (tests/engine/test_hardware.py)."""

import os

os.environ["ALIGNOPSD_CPU_FLAGS"] = ""
