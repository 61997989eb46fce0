"""Regenerate the golden traces (run only when a number changes on purpose, and say so in the commit).

python tests/engine/regen_golden.py               # tests/assets/golden_tiny.json (AlignOPSD, 3 steps)
python tests/engine/regen_golden.py --estimators  # tests/assets/golden_estimators.json (every estimator)
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import learn_helpers as lh  # noqa: E402
from test_golden_estimators import GOLDEN as GOLDEN_EST  # noqa: E402
from test_golden_estimators import STEPS  # noqa: E402
from test_train import GOLDEN, LEARN_STEPS, _run, golden_trace  # noqa: E402

if __name__ == "__main__":
    if "--estimators" in sys.argv[1:]:
        cases = {}
        for case, overrides in lh.ESTIMATOR_CASES:
            with tempfile.TemporaryDirectory() as d:
                _, recs = lh.run_tiny(d, overrides, STEPS)
            cases[case] = {"overrides": overrides, "steps": lh.trace_of(recs)}
            print(case, json.dumps(cases[case]["steps"]))
        out = {"config": "configs/tiny.yaml", "base_overrides": lh.GUESS_OVERRIDES, "cases": cases}
        GOLDEN_EST.write_text(json.dumps(out, indent=2) + "\n")
    else:
        with tempfile.TemporaryDirectory() as d:
            trace = golden_trace(_run(Path(d), "alignopsd", LEARN_STEPS, ["algorithm.kl_coef=0.01"])[1])
        GOLDEN.write_text(json.dumps(trace, indent=2) + "\n")
        print(json.dumps(trace["steps"], indent=2))
