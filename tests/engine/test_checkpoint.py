"""Atomic checkpoints: layout, transformers-loadable weights, keep-last-N, interrupted saves, RNG restore."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from alignopsd.engine import checkpoint as ck


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    return LlamaForCausalLM(cfg)


def _save(d, step, model, **kw):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return ck.save_checkpoint(
        d, step, model_state=model.state_dict(), optimizer_state={"optimizer": opt.state_dict()},
        trainer_state={"data_position": {"step": step}}, hf_config=model.config, **kw,
    )  # fmt: skip


def test_layout_and_transformers_load(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _tiny_llama()
    path = _save(tmp_path, 3, model)
    assert path.name == "step_000003" and ck.is_complete(path)
    for f in ("model.safetensors", "config.json", "optimizer.pt", "rng_rank0.pt", "trainer_state.json"):
        assert (path / f).is_file(), f
    loaded = AutoModelForCausalLM.from_pretrained(str(path))
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    st = json.loads((path / "trainer_state.json").read_text())
    assert st["step"] == 3 and st["complete"] and st["data_position"] == {"step": 3}


def test_keep_last_and_latest(tmp_path):
    model = _tiny_llama()
    for s in (1, 2, 3, 4):
        _save(tmp_path, s, model, keep_last=2)
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["step_000003", "step_000004"]
    assert ck.latest_checkpoint(tmp_path).name == "step_000004"
    assert ck.resolve_resume("auto", tmp_path).name == "step_000004"
    assert ck.resolve_resume(None, tmp_path) is None
    assert ck.resolve_resume("auto", tmp_path / "nothing") is None
    with pytest.raises(ValueError, match="--resume"):
        ck.resolve_resume(str(tmp_path / "step_000001"), tmp_path)


@pytest.mark.parametrize("fail_after", ["model.safetensors", "optimizer.pt", "trainer_state.json"])
def test_interrupted_save_leaves_previous_checkpoint(tmp_path, fail_after):
    model = _tiny_llama()
    first = _save(tmp_path, 1, model)
    before = ck.load_checkpoint(first, restore_rng=False)["model_state"]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _save(tmp_path, 2, model, _fail_after=fail_after)
    assert ck.latest_checkpoint(tmp_path) == first  # the half-written step 2 is not picked
    assert (tmp_path / ".tmp-step_000002").exists()
    again = ck.load_checkpoint(first, restore_rng=False)["model_state"]
    assert all(torch.equal(before[k], again[k]) for k in before)
    # the next save cleans the stale temp dir and succeeds
    path = _save(tmp_path, 2, model)
    assert ck.latest_checkpoint(tmp_path) == path and not (tmp_path / ".tmp-step_000002").exists()


def test_killed_process_mid_write_keeps_previous(tmp_path):
    """A real kill (SIGKILL) while a large save is in flight leaves the previous checkpoint loadable."""
    import subprocess
    import sys
    import textwrap
    import time

    model = _tiny_llama()
    first = _save(tmp_path, 1, model)
    code = textwrap.dedent(f"""
        import torch, sys
        from alignopsd.engine import checkpoint as ck
        big = {{f"w{{i}}": torch.randn(512, 512) for i in range(96)}}
        print("ready", flush=True)
        while True:
            ck.save_checkpoint({str(tmp_path)!r}, 2, model_state=big, optimizer_state=None,
                               trainer_state={{}}, keep_last=5)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    proc.kill()
    proc.wait()
    latest = ck.latest_checkpoint(tmp_path)
    assert latest is not None and latest.name in ("step_000001", "step_000002")
    state = ck.load_checkpoint(first, restore_rng=False)
    assert set(state["model_state"]) == set(model.state_dict())


def test_rng_state_round_trip(tmp_path):
    model = _tiny_llama()
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    path = _save(tmp_path, 1, model)
    expect = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    ck.load_checkpoint(path)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expect


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="step"):
        ck.save_checkpoint(tmp_path, -1, model_state={}, optimizer_state=None, trainer_state={})
    with pytest.raises(ValueError, match="keep_last"):
        ck.save_checkpoint(tmp_path, 1, model_state={}, optimizer_state=None, trainer_state={}, keep_last=0)
    with pytest.raises(ValueError, match="checkpoint"):
        ck.load_checkpoint(tmp_path / "step_000009")
