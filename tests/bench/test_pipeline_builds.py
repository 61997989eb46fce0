"""The quickstart pipeline builds each part once (one session): counted by bench/pipeline_builds.py on the tiny
model (the counts are the pipeline's structure, the same as ``make run``'s)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import pipeline_builds  # noqa: E402


@pytest.mark.slow
def test_the_pipeline_reads_its_config_once_and_builds_each_part_once(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # the default arguments name configs/quickstart_cpu.yaml
    assert pipeline_builds.main([]) == 0
    counts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["counts"]
    # one parse; two causal LMs: the calibration's and the one policy that is evaluated as the base model,
    # warm-started, evaluated again and continued into RL in memory; one Trainer, the RL run's (the evaluations build
    # none); one environment (expert episodes, RL episodes, the three evaluations) and one generator for all of them
    assert counts == {
        "config file reads": 1,
        "config parses (load_config)": 1,
        "causal LM loads": 2,
        "Trainer constructions": 1,
        "environment builds": 1,
        "generator builds": 1,
    }
    from alignopsd.engine.models import loading
    from alignopsd.engine.run import components

    # the counters are gone after the run
    assert components.load_causal_lm is loading.load_causal_lm and not hasattr(loading.load_causal_lm, "__wrapped__")
    from alignopsd.engine.envs.manager import EnvManager

    assert not hasattr(components.build_generator, "__wrapped__") and not hasattr(EnvManager.__init__, "__wrapped__")
