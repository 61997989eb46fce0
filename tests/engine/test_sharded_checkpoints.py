"""Sharded (torch.distributed.checkpoint) checkpoints of the trainer under the Megatron backend.

The fast tests drive checkpoint/checkpoint.py and run/resume.py with a stand-in shard writer; the slow ones
launch
their own ``torchrun`` processes (tests/engine/sharded_run.py: the train command line with the guess environment)
on free ports: a run killed after step 1 and resumed with ``--resume auto`` ends bit-identical to a run that was
never stopped (TP=2), a checkpoint written at data-parallel size 2 resumes at size 1 with the exact weights and
optimizer state (TP=1), and a checkpoint is refused, before any model loads, by a run with another
tensor-parallel size.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import learn_helpers as lh
import pytest
import torch
from alignopsd.engine.checkpoint import checkpoint as ck
from alignopsd.engine.checkpoint.manifest import ManifestError, write_manifest
from alignopsd.engine.checkpoint.trainer_state import TrainerState
from alignopsd.engine.config.schema import load_config
from alignopsd.engine.run.resume import ResumeConfigError, check_resume, stored_config

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
RUNNER = str(Path(__file__).with_name("sharded_run.py"))
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _fake_shards(folder: Path) -> None:
    """Stands in for the backend's sharded save: a one-process DCP folder with its own manifest."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(50.0), "steps": 3}, checkpoint_id=str(folder), no_dist=True)
    write_manifest(folder)


def _sharded(out: Path, cfg, step: int, *, export: bool = False, shard_state=None) -> Path:
    return ck.save_checkpoint(
        out / "checkpoints",
        step,
        model_state={"w": torch.ones(2)} if export else None,
        optimizer_state=None,
        trainer_state=TrainerState(step, run_config=stored_config(cfg)),
        shards=_fake_shards,
        shard_state=shard_state or {"w": torch.ones(2)},
    )


def test_sharded_checkpoint_layout_discovery_and_load(tmp_path):
    cfg = load_config(TINY, [f"output_dir={tmp_path}"])
    one = _sharded(tmp_path, cfg, 1)
    two = _sharded(tmp_path, cfg, 2, export=True)
    assert not (one / ck.WEIGHTS_FILE).exists() and (two / ck.WEIGHTS_FILE).exists()
    listed = json.loads((one / "manifest.json").read_text())["files"]
    assert {"shards/.metadata", "shards/__0_0.distcp", "shards/manifest.json", "trainer_state.json"} <= set(listed)
    assert ck.list_checkpoints(tmp_path / "checkpoints") == [one, two]
    got = ck.load_checkpoint(two, restore_rng=False)
    assert got.shards == two / "shards" and got.model_state is None and got.trainer_state.sharded
    # a damaged shard is named, and --resume auto falls back past it
    shard = two / "shards" / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[-8:] = b"SHARDSSS"
    shard.write_bytes(bytes(raw))
    with pytest.raises(ManifestError, match=r"shards/__0_0\.distcp' is corrupted"):
        ck.load_checkpoint(two)
    said: list[str] = []
    assert ck.resolve_resume("auto", tmp_path / "checkpoints", say=said.append) == one
    assert "falling back" in said[-1]
    # neither weights nor shards: not a checkpoint
    (one / "shards" / ".metadata").unlink()
    assert not ck.is_complete(one)


def test_nonfinite_shard_is_never_saved(tmp_path):
    cfg = load_config(TINY, [f"output_dir={tmp_path}"])
    with pytest.raises(ck.UnsafeStateError, match="'w' holds NaN"):
        _sharded(tmp_path, cfg, 1, shard_state={"w": torch.tensor([1.0, float("nan")])})
    assert not (tmp_path / "checkpoints" / "step_000001").exists()
    with pytest.raises(ValueError, match="model_state: required unless the checkpoint is sharded"):
        ck.save_checkpoint(tmp_path, 1, model_state=None, optimizer_state=None)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ("policy.tensor_parallel_size=2", "policy.tensor_parallel_size: 1 -> 2"),
        ("model.dtype=bfloat16", "model.dtype: 'auto' -> 'bfloat16'"),
        ("policy.backend=hf", "policy.backend: 'megatron' -> 'hf'"),
    ],
)
def test_sharded_checkpoint_refuses_another_layout_even_when_overridden(tmp_path, change, key):
    saved = load_config(TINY, [f"output_dir={tmp_path}", "policy.backend=megatron"])
    path = _sharded(tmp_path, saved, 2)
    now = load_config(TINY, [f"output_dir={tmp_path}", "policy.backend=megatron", change])
    with pytest.raises(ResumeConfigError, match="sharded checkpoint") as err:
        check_resume(path, now, allow_changes=True)
    assert key in str(err.value)
    # other changes stay overridable, and the data-parallel size may change
    lr = load_config(TINY, [f"output_dir={tmp_path}", "policy.backend=megatron", "trainer.optimizer.lr=0.01"])
    lines = check_resume(path, lr, world_size=2, allow_changes=True)
    assert any("trainer.optimizer.lr" in line for line in lines) and any("world_size" in line for line in lines)


def test_backend_checks_the_folder_layout_before_reading_shards(tmp_path):
    """Another model under the same name: the backend names every difference from layout.json."""
    from alignopsd.engine.policy.megatron.backend import MegatronPolicy
    from alignopsd.engine.policy.megatron.checkpointing import LAYOUT_FILE

    mine = {"tensor_parallel_size": 1, "dims": {"hidden": 64, "vocab": 512}, "params_dtype": "torch.float32"}
    (tmp_path / LAYOUT_FILE).write_text(json.dumps({**mine, "dims": {"hidden": 32, "vocab": 512}}))
    me = SimpleNamespace(checkpoint_layout=lambda: mine)
    with pytest.raises(ValueError, match=r"does not fit this model.*dims: checkpoint \{'hidden': 32"):
        MegatronPolicy.check_checkpoint_layout(me, str(tmp_path))
    (tmp_path / LAYOUT_FILE).write_text(json.dumps(mine))
    MegatronPolicy.check_checkpoint_layout(me, str(tmp_path))
    (tmp_path / LAYOUT_FILE).unlink()
    with pytest.raises(ValueError, match="layout.json is unreadable"):
        MegatronPolicy.check_checkpoint_layout(me, str(tmp_path))


# ---------------------------------------------------------------------------------------------------------------------
# real runs under torchrun

GUESS = [a for kv in lh.GUESS_OVERRIDES for a in ("--set", kv)]
TIMING = ("wall_time", "audit/seconds", "rollout/generation_tokens_per_s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(nproc: int, out: Path, *args: str, runner: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent)])}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [TORCHRUN, f"--nproc_per_node={nproc}", f"--master_port={_free_port()}", RUNNER, *runner, "--config", TINY,
           *GUESS, "--set", "policy.backend=megatron", "--set", f"output_dir={out}", *args]  # fmt: skip
    # about a minute each on a quiet 2-core machine; far longer when the machine is shared
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)


def _metrics(out: Path, step: int) -> dict:
    from alignopsd.engine.observe.metrics import read_metrics

    (rec,) = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] == step]
    return {k: v for k, v in rec.items() if not k.startswith(("time/", "memory/")) and k not in TIMING}


def _equal_trees(a, b) -> bool:
    from alignopsd.engine.checkpoint.statefile import flatten_state

    (sa, ta), (sb, tb) = flatten_state(a), flatten_state(b)
    return sa == sb and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.slow
def test_tp2_resume_after_a_kill_is_bit_identical(tmp_path):
    """2 steps straight vs killed after step 1's checkpoint and resumed with --resume auto: same weights, same
    metrics; the end of the run leaves a Hugging Face export that ``alignopsd eval`` loads; a TP=1 run refuses
    the TP=2 checkpoint before any model loads, --allow-config-change included."""
    from alignopsd.engine.commands.evaluate import main as eval_main
    from safetensors.torch import load_file

    run = ["--set", "policy.tensor_parallel_size=2", "--set", "trainer.total_steps=2"]
    run += ["--set", "trainer.checkpoint.save_freq=1"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    r = _torchrun(2, straight, *run)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _torchrun(2, killed, *run, runner=("--stop-after", "1"))
    assert r.returncode != 0 and [p.name for p in ck.list_checkpoints(killed / "checkpoints")] == ["step_000001"]
    assert not (killed / "checkpoints" / "step_000001" / ck.WEIGHTS_FILE).exists()  # export: the end of the run only
    r = _torchrun(2, killed, *run, "--resume", "auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "step_000001" in r.stdout
    final = killed / "checkpoints" / "step_000002"
    a, b = load_file(straight / "checkpoints" / "step_000002" / ck.WEIGHTS_FILE), load_file(final / ck.WEIGHTS_FILE)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _metrics(straight, 2) == _metrics(killed, 2) and _metrics(straight, 1) == _metrics(killed, 1)
    assert _metrics(killed, 2)["actor/grad_norm"] > 0  # step 2 trained (the optimizer state mattered)
    assert eval_main(["--config", TINY, "--checkpoint", str(final), "--set", "env.val_tasks=1"]) == 0

    r = _torchrun(1, killed, *run[2:], "--set", "trainer.total_steps=3", "--resume", "auto", "--allow-config-change")
    assert r.returncode != 0 and "exitcode  : 2" in r.stderr  # torchrun reports the command's exit code 2
    assert "config error: --resume:" in r.stderr and "is a sharded checkpoint" in r.stderr
    assert "policy.tensor_parallel_size: 2 -> 1" in r.stderr and "[rank0]: Traceback" not in r.stderr


@pytest.mark.slow
def test_dp2_checkpoint_resumes_at_dp1(tmp_path):
    """TP=1 x DP=2 writes step 1; a TP=1 x DP=1 run resumes it with the exact weights and optimizer state."""
    from alignopsd.engine.checkpoint.statefile import load_state

    out = tmp_path / "run"
    r = _torchrun(2, out, "--set", "trainer.total_steps=1", runner=("--dump-save", str(tmp_path / "saved.st")))
    assert r.returncode == 0, r.stderr[-3000:]
    r = _torchrun(1, out, "--set", "trainer.total_steps=2", "--resume", "auto",
                  runner=("--dump-load", str(tmp_path / "loaded.st")))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "world_size (data-parallel ranks): 2 -> 1" in r.stdout
    saved, loaded = load_state(tmp_path / "saved.st"), load_state(tmp_path / "loaded.st")
    assert saved["optimizer"]["steps"] == 2 and saved["optimizer"]["tp_rank_states"][0]["optimizer"]["state"]
    assert _equal_trees(saved, loaded)
    assert [p.name for p in ck.list_checkpoints(out / "checkpoints")] == ["step_000001", "step_000002"]
