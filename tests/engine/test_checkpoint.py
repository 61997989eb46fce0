"""Atomic checkpoints: layout, transformers-loadable weights, keep-last-N, interrupted saves, RNG restore; and
trust: nothing unpickled, every file verified against the manifest, fallback, no non-finite weights saved."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from alignopsd.engine.checkpoint import checkpoint as ck
from alignopsd.engine.checkpoint.trainer_state import TrainerState


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
        trainer_state=TrainerState(step, data_position={"step": step}), hf_config=model.config, **kw,
    )  # fmt: skip


def test_layout_and_transformers_load(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _tiny_llama()
    path = _save(tmp_path, 3, model)
    assert path.name == "step_000003" and ck.is_complete(path)
    names = ("model.safetensors", "config.json", "optimizer.safetensors", "rng_rank0.safetensors", "trainer_state.json")
    for f in (*names, "manifest.json"):
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


def _crash_after(monkeypatch, name: str) -> None:
    """The checkpoint module's writer of file ``name`` writes it, then the process "dies" (raises)."""
    writer = {"model.safetensors": "save_weights", "optimizer.safetensors": "save_state"}.get(
        name, "write_trainer_state"
    )
    real = getattr(ck, writer)

    def crash(where, *args, **kw):
        real(where, *args, **kw)
        if writer != "save_state" or Path(where).name == name:  # save_state writes the RNG files too
            raise RuntimeError(f"simulated crash after writing {name}")

    monkeypatch.setattr(ck, writer, crash)


@pytest.mark.parametrize("fail_after", ["model.safetensors", "optimizer.safetensors", "trainer_state.json"])
def test_interrupted_save_leaves_previous_checkpoint(tmp_path, monkeypatch, fail_after):
    model = _tiny_llama()
    first = _save(tmp_path, 1, model)
    before = ck.load_checkpoint(first, restore_rng=False).model_state
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with monkeypatch.context() as patch, pytest.raises(RuntimeError, match="simulated crash"):
        _crash_after(patch, fail_after)
        _save(tmp_path, 2, model)
    assert ck.latest_checkpoint(tmp_path) == first  # the half-written step 2 is not picked
    assert (tmp_path / ".tmp-step_000002").exists()
    again = ck.load_checkpoint(first, restore_rng=False).model_state
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
        from alignopsd.engine.checkpoint import checkpoint as ck
        big = {{f"w{{i}}": torch.randn(512, 512) for i in range(96)}}
        print("ready", flush=True)
        while True:
            ck.save_checkpoint({str(tmp_path)!r}, 2, model_state=big, optimizer_state=None, keep_last=5)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    proc.kill()
    proc.wait()
    latest = ck.latest_checkpoint(tmp_path)
    assert latest is not None and latest.name in ("step_000001", "step_000002")
    state = ck.load_checkpoint(first, restore_rng=False)
    assert set(state.model_state) == set(model.state_dict())


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
        ck.save_checkpoint(tmp_path, -1, model_state={}, optimizer_state=None)
    with pytest.raises(ValueError, match="keep_last"):
        ck.save_checkpoint(tmp_path, 1, model_state={}, optimizer_state=None, keep_last=0)
    with pytest.raises(ValueError, match="checkpoint"):
        ck.load_checkpoint(tmp_path / "step_000009")


# ---------------------------------------------------------------------------------------------------------------------
# trust: nothing unpickled, every file verified, fallback, never start over, no non-finite weights


def _flip(path, start, n, mask=0xFF):
    raw = bytearray(path.read_bytes())
    raw[start : start + n] = bytes(b ^ mask for b in raw[start : start + n])
    path.write_bytes(bytes(raw))


def test_loading_unpickles_nothing(tmp_path, monkeypatch):
    import pickle

    model = _tiny_llama()
    path = _save(tmp_path, 1, model)

    def refuse(*a, **k):
        raise AssertionError("a checkpoint file was unpickled")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    st = ck.load_checkpoint(path, restore_rng=False)
    assert set(st.optimizer_state["optimizer"]) == {"state", "param_groups"}


def test_crafted_optimizer_file_runs_no_code(tmp_path):
    """A pickle that executes code, put in place of the optimizer file with a matching manifest: refused, not run."""
    import os
    import pickle

    from alignopsd.engine.checkpoint.manifest import write_manifest

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    model = _tiny_llama()
    path = _save(tmp_path, 1, model)
    for name in ("optimizer.safetensors", "optimizer.pt"):
        (path / name).write_bytes(pickle.dumps(Evil()))
    write_manifest(path)  # the attacker also rewrites the manifest
    with pytest.raises(ValueError, match="optimizer.safetensors: not a readable safetensors file"):
        ck.load_checkpoint(path, restore_rng=False)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        ("weights_4k", "'model.safetensors' is corrupted"),
        ("optimizer_xor", "'optimizer.safetensors' is corrupted"),
        ("delete_optimizer", "'optimizer.safetensors' is missing"),
        ("delete_rng", "'rng_rank0.safetensors' is missing"),
        ("state_garbage", "'trainer_state.json' has"),
    ],
)
def test_corrupt_checkpoint_is_refused_and_auto_falls_back(tmp_path, damage, match):
    model = _tiny_llama()
    first = _save(tmp_path, 1, model, keep_last=3)
    second = _save(tmp_path, 2, model, keep_last=3)
    if damage == "weights_4k":
        _flip(second / "model.safetensors", 8192, 4096)
    elif damage == "optimizer_xor":
        _flip(second / "optimizer.safetensors", 200, 256, 0x5A)
    elif damage == "delete_optimizer":
        (second / "optimizer.safetensors").unlink()
    elif damage == "delete_rng":
        (second / "rng_rank0.safetensors").unlink()
    else:
        (second / "trainer_state.json").write_text("")
    with pytest.raises(ValueError, match=match):
        ck.load_checkpoint(second, restore_rng=False)
    with pytest.raises(ValueError, match="--resume: .*not a complete, intact checkpoint"):
        ck.resolve_resume(str(second), tmp_path)  # an explicit path does not fall back
    said = []
    assert ck.resolve_resume("auto", tmp_path, say=said.append) == first
    assert match.split("'")[1] in said[0] and "falling back" in said[1] and "step_000001" in said[1]
    ck.load_checkpoint(first, restore_rng=False)


def test_auto_refuses_to_start_over_on_top_of_bad_checkpoints(tmp_path):
    model = _tiny_llama()
    for s in (1, 2):
        (_save(tmp_path, s, model, keep_last=3) / "trainer_state.json").write_text("{")
    with pytest.raises(ValueError, match="refusing to start over"):
        ck.resolve_resume("auto", tmp_path)
    old_format = tmp_path / "other" / "step_000003"  # an unverifiable folder under a checkpoint name
    old_format.mkdir(parents=True)
    (old_format / "optimizer.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match="no manifest.json"):
        ck.resolve_resume("auto", tmp_path / "other")
    assert ck.resolve_resume("auto", tmp_path / "empty") is None


def test_nonfinite_weights_are_never_saved(tmp_path):
    model = _tiny_llama()
    good = _save(tmp_path, 1, model)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("inf")
    with pytest.raises(ck.UnsafeStateError, match=r"step 2 are not finite .*last good checkpoint is .*step_000001"):
        _save(tmp_path, 2, model)
    assert ck.list_checkpoints(tmp_path) == [good] and not (tmp_path / ".tmp-step_000002").exists()


def test_other_ranks_files_are_checksummed_by_their_writers(tmp_path):
    """gather: each rank's manifest entry reaches the writer of the manifest (here rank 0 of one process)."""
    model = _tiny_llama()
    calls = []

    def gather(obj):
        calls.append(obj)
        return [obj]

    path = _save(tmp_path, 1, model, gather=gather)
    assert list(calls[0]) == ["rng_rank0.safetensors"]
    files = ck.verify_checkpoint(path)
    assert files["rng_rank0.safetensors"] == calls[0]["rng_rank0.safetensors"]


def test_a_resume_hashes_each_checkpoint_once(tmp_path, monkeypatch):
    """Choosing, checking and loading a checkpoint verify it three times; the checksums are computed once, and again
    as soon as any of its files changes."""
    from alignopsd.engine.checkpoint import manifest

    model = _tiny_llama()
    path = _save(tmp_path, 1, model)
    hashed = []
    real = manifest.file_crc32
    monkeypatch.setattr(manifest, "file_crc32", lambda p, size=None: hashed.append(p) or real(p, size))
    assert ck.resolve_resume("auto", tmp_path) == path
    n = len(hashed)
    assert n == len(ck.verify_checkpoint(path))
    ck.load_checkpoint(path, restore_rng=False)
    assert len(hashed) == n
    _flip(path / "optimizer.safetensors", 300, 8)  # same size, new bytes
    with pytest.raises(ValueError, match="'optimizer.safetensors' is corrupted"):
        ck.load_checkpoint(path, restore_rng=False)
