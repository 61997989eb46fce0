"""The quickstart pipeline builds each part once: counted by bench/pipeline_builds.py on the tiny model (the counts
are the pipeline's structure, the same as ``make run``'s)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import pipeline_builds  # noqa: E402


@pytest.mark.slow
def test_the_pipeline_reads_its_config_once_and_loads_each_model_once_per_role(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the default arguments name configs/quickstart_cpu.yaml
    assert pipeline_builds.main([]) == 0
    counts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["counts"]
    # one parse; three causal LMs: the calibration's, the base model's (evaluated, warm-started, evaluated again),
    # the RL run's (trained, evaluated); one Trainer, the RL run's (the evaluations build none)
    assert counts == {
        "config file reads": 1,
        "config parses (load_config)": 1,
        "causal LM loads": 3,
        "Trainer constructions": 1,
    }
    from alignopsd.engine.models import loading
    from alignopsd.engine.run import components

    # the counters are gone after the run
    assert components.load_causal_lm is loading.load_causal_lm and not hasattr(loading.load_causal_lm, "__wrapped__")
