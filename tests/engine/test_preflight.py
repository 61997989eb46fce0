"""Pre-flight check: devices, launch, paths and env.options, before anything heavy loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from alignopsd.engine.config import ConfigError, load_config
from alignopsd.engine.preflight import env_option_names, preflight

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
TORCHRUN = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}


def _cfg(*overrides):
    return load_config(TINY, list(overrides))


def test_tiny_config_passes():
    preflight(_cfg(), env={})
    preflight(_cfg("env.options={startup_timeout: 30}"), env={})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda():
    with pytest.raises(ConfigError, match="trainer.device: 'cuda' requested but CUDA is not available"):
        preflight(_cfg("trainer.device=cuda"), env={})


def test_megatron_needs_torchrun():
    cfg = _cfg("policy.backend=megatron")
    with pytest.raises(ConfigError, match="policy.backend: 'megatron' needs the distributed environment.*torchrun"):
        preflight(cfg, env={})
    with pytest.raises(ConfigError, match="WORLD_SIZE=2 without the rest"):
        preflight(_cfg(), env={"WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="policy.tensor_parallel_size: 2 does not divide the number of processes 3"):
        preflight(_cfg("policy.backend=megatron", "policy.tensor_parallel_size=2"), env={**TORCHRUN, "WORLD_SIZE": "3"})
    preflight(_cfg("policy.backend=megatron", "policy.tensor_parallel_size=2"), env=TORCHRUN)


def test_paths_that_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="model.name: .*no such directory"):
        preflight(_cfg(f"model.name={tmp_path / 'nope'}"), env={})
    with pytest.raises(ConfigError, match="model.name: .*not in the local Hugging Face cache"):
        preflight(_cfg("model.name=nobody-here/no-such-model-xyz"), env={})
    with pytest.raises(ConfigError, match="model.tokenizer: .*no such directory"):
        preflight(_cfg(f"model.tokenizer={tmp_path / 'tok'}"), env={})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="model.name: .*no config.json"):
        preflight(_cfg(f"model.name={tmp_path / 'empty'}"), env={})
    with pytest.raises(ConfigError, match="env.data_dir: no such directory"):
        preflight(_cfg(f"env.data_dir={tmp_path / 'data'}"), env={})


def test_encoder_path_checked_when_the_estimator_uses_it(tmp_path):
    missing = f"encoder.name={tmp_path / 'enc'}"
    with pytest.raises(ConfigError, match="encoder.name: "):
        preflight(_cfg(missing), env={})  # tiny.yaml runs alignopsd (Mechanism 1 encodes thinking)
    preflight(_cfg(missing, "algorithm.estimator=grpo"), env={})  # GRPO never builds the encoder


def test_unknown_env_options():
    with pytest.raises(ConfigError, match="env.options.scale: unknown option of environment 'codeword'"):
        preflight(_cfg("env.options={scale: 2}"), env={})
    with pytest.raises(ConfigError, match="env.options.max_steps: set by env.max_turns"):
        preflight(_cfg("env.options={max_steps: 3}"), env={})
    assert {"retriever_url", "topk", "mp_context"} <= set(env_option_names("search"))
    assert "cache_dir" in env_option_names("alfworld") and "cache_dir" not in env_option_names("search")
