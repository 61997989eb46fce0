"""Regenerate tests/assets/golden_tiny.json (run only when the algorithm intentionally changes).

python tests/engine/regen_golden.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from test_train import GOLDEN, LEARN_STEPS, _run, golden_trace  # noqa: E402

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        trace = golden_trace(_run(Path(d), "alignopsd", LEARN_STEPS, ["algorithm.kl_coef=0.01"])[1])
    GOLDEN.write_text(json.dumps(trace, indent=2) + "\n")
    print(json.dumps(trace["steps"], indent=2))
