"""trainer.ppo.rollout_is*: the rollout–trainer mismatch correction's config keys (off by default, validated),
and their meaning for alignopsd.losses.rollout_is_weights (``<level>_<mode>``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from alignopsd.engine.config.schema import ConfigError, load_config

from alignopsd.losses import rollout_is_weights


def test_defaults_are_off():
    cfg = load_config(None)
    assert cfg.trainer.ppo.rollout_is == "off"
    assert cfg.trainer.ppo.rollout_is_threshold == 2.0 and cfg.trainer.ppo.rollout_is_lower is None


@pytest.mark.parametrize("value", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_each_mode_is_a_level_and_mode_of_rollout_is_weights(value):
    cfg = load_config(
        None,
        [f"trainer.ppo.rollout_is={value}", "trainer.ppo.rollout_is_threshold=3", "trainer.ppo.rollout_is_lower=0.25"],
    )
    t = cfg.trainer.ppo
    level, mode = t.rollout_is.split("_")
    lp = torch.log(torch.tensor([[0.5, 0.2], [0.1, 0.3]]))
    w, keep, _ = rollout_is_weights(lp, lp + 0.1, torch.ones(2, 2), level=level, mode=mode,
                                    threshold=t.rollout_is_threshold, lower=t.rollout_is_lower)  # fmt: skip
    assert keep.all() and bool((w > 1).all())


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.ppo.rollout_is=tis", "trainer.ppo.rollout_is"),
        ("trainer.ppo.rollout_is_threshold=1.0", "trainer.ppo.rollout_is_threshold"),
        ("trainer.ppo.rollout_is_threshold=0.5", "trainer.ppo.rollout_is_threshold"),
        ("trainer.ppo.rollout_is_lower=1.0", "trainer.ppo.rollout_is_lower"),
        ("trainer.ppo.rollout_is_lower=-0.1", "trainer.ppo.rollout_is_lower"),
        ("trainer.ppo.rollout_is_lower=low", "rollout_is_lower"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, [override])


def test_logprob_reuse_with_rollout_is_is_refused_naming_both_keys(tmp_path):
    """With reused log-probs the old log-probs are the rollout's own: every weight would be 1, silently."""
    sets = ["generation.backend=hf", "trainer.ppo.logprob_reuse=true", "trainer.ppo.rollout_is=token_truncate"]
    with pytest.raises(ConfigError, match=r"trainer\.ppo\.rollout_is.*trainer\.ppo\.logprob_reuse"):
        load_config(None, sets)
    assert load_config(None, sets[:2]).trainer.ppo.logprob_reuse  # each alone is accepted
    assert load_config(None, [sets[0], sets[2]]).trainer.ppo.rollout_is == "token_truncate"
    import subprocess
    import sys

    code = "import sys\nfrom alignopsd.engine.commands.train import main\nsys.exit(main(sys.argv[1:]))\n"
    tiny = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")
    argv = ["--config", tiny, *[x for s in sets for x in ("--set", s)]]
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert "trainer.ppo.logprob_reuse" in r.stderr and "trainer.ppo.rollout_is" in r.stderr
