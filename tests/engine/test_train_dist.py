"""Data-parallel training under ``torchrun --nproc_per_node=2`` (gloo on CPU)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import learn_helpers as lh
import pytest
import torch
from test_train import GUESS

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


@pytest.mark.distributed
def test_two_rank_training_keeps_replicas_identical():
    if os.environ.get("WORLD_SIZE") != "2":
        pytest.skip("run under torchrun --nproc_per_node=2")
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(tempfile.gettempdir()) / f"alignopsd-dist-{os.environ.get('MASTER_PORT', '0')}"
    ov = [*GUESS, "algorithm.estimator=grpo", "trainer.total_steps=2",
          f"output_dir={out}", "env.tasks_per_step=4", "trainer.ppo.micro_batch_size=4"]  # fmt: skip
    tr = lh.build_trainer(TINY, ov)
    assert tr.world_size == 2 and tr.parts.policy.distributed
    last = tr.fit()
    sums = [float(sum(v.double().sum() for v in tr.parts.policy.model.state_dict().values()))]
    got: list = [None, None]
    dist.all_gather_object(got, sums)
    assert got[0] == got[1]  # DDP kept both replicas identical
    assert last["update/optimizer_steps"] >= 1
    from alignopsd.engine.checkpoint.checkpoint import latest_checkpoint, verify_checkpoint

    ck = latest_checkpoint(out / "checkpoints")
    assert ck is not None and {"rng_rank0.safetensors", "rng_rank1.safetensors"} <= set(verify_checkpoint(ck))
    # each data-parallel rank writes the audit records of its own batch, its rank in the file name
    from alignopsd.engine.observe.audit import audit_file

    from bench.credit_metrics import read_audit

    rank = dist.get_rank()
    assert all(audit_file(out / "audit", s, rank).is_file() for s in (1, 2))
    dist.barrier()
    heads = read_audit(out / "audit", 2, kind="step")
    assert sorted(h["rank"] for h in heads) == [0, 1] and all(h["world_size"] == 2 for h in heads)


@pytest.mark.distributed
def test_tensor_parallel_eval_counts_each_episode_once():
    """`alignopsd eval` with the Megatron backend at TP=2 loads a Hugging Face checkpoint onto the shards; the two
    ranks of the tensor-parallel group play the same tasks, so the episode count is not doubled."""
    if os.environ.get("WORLD_SIZE") != "2":
        pytest.skip("run under torchrun --nproc_per_node=2")
    import json

    import torch.distributed as dist
    from alignopsd.engine.checkpoint.checkpoint import save_checkpoint
    from alignopsd.engine.commands import cli
    from alignopsd.engine.models.loading import build_tiny_model

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    out = Path(tempfile.gettempdir()) / f"alignopsd-tp-eval-{os.environ.get('MASTER_PORT', '0')}"
    if dist.get_rank() == 0:
        model = build_tiny_model()
        save_checkpoint(out / "checkpoints", 1, model_state=model.state_dict(), optimizer_state=None,
                        hf_config=model.config)  # fmt: skip
    dist.barrier()
    ej = out / f"eval{dist.get_rank()}.json"
    sets = ["--set", "policy.backend=megatron", "--set", "policy.tensor_parallel_size=2", "--set", "env.max_turns=1",
            "--set", "generation.max_response_length=8", "--set", "env.teacher_max_response_length=8",
            "--set", "env.val_tasks=2", "--set", f"output_dir={out}"]  # fmt: skip
    ck = str(out / "checkpoints" / "step_000001")
    assert cli.main(["eval", "--config", TINY, *sets, "--checkpoint", ck, "--json", str(ej)]) == 0
    res = json.loads(ej.read_text())
    assert res["episodes"] == 2 and res["metrics"]["episode/count"] == 2


@pytest.mark.distributed
def test_profile_under_torchrun_with_megatron_tp2(capsys):
    """`alignopsd profile` at TP=2: both ranks run the steps, rank 0 alone prints the table and writes the JSON
    (with the step's counts), each rank writes its own torch.profiler trace, and the caller's process group is left
    open (the command closes only a group it made: destroying the suite's would leave the next module's re-init
    reading the old group's addresses from torchrun's store)."""
    if os.environ.get("WORLD_SIZE") != "2":
        pytest.skip("run under torchrun --nproc_per_node=2")
    import json

    import torch.distributed as dist
    from alignopsd.engine.commands import cli

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    out = Path(tempfile.gettempdir()) / f"alignopsd-tp-profile-{os.environ.get('MASTER_PORT', '0')}"
    js = out / "prof.json"
    sets = ["--set", "policy.backend=megatron", "--set", "policy.tensor_parallel_size=2", "--set", "env.max_turns=1",
            "--set", "generation.max_response_length=8", "--set", "env.teacher_max_response_length=8",
            "--set", "algorithm.kl_coef=0.0", "--set", f"output_dir={out}"]  # fmt: skip
    assert cli.main(["profile", "--config", TINY, *sets, "--steps", "2", "--json", str(js)]) == 0
    assert dist.is_initialized()  # the suite's group, which the command did not make, is still open
    printed = capsys.readouterr().out
    assert ("teacher generation *" in printed) == (rank == 0) and ("(rank 0 of 2)" in printed) == (rank == 0)
    trace = out / "profile" / ("trace_alignopsd.json" if rank == 0 else "trace_alignopsd.rank1.json")
    assert trace.is_file() and "phase/teacher_forcing" in trace.read_text()
    if rank == 0:
        data = json.loads(js.read_text())
        assert data["phases"]["update"] > 0 and data["phases"]["teacher_forcing"] > 0
        assert data["counts"]["batch/rows"] == 8 and data["counts"]["m1/teacher_forcing_token_forwards"] > 0


def test_dist_sets_the_cuda_device_even_in_a_group_it_did_not_make(monkeypatch):
    """NCCL's object collectives and barrier run on ``torch.cuda.current_device()``: the trainer's Dist selects
    its local GPU also when the caller made the process group (profile, compare and the suite do), else every
    rank's all_gather_object would stage on GPU 0."""
    import torch.distributed as dist
    from alignopsd.engine.run.process import Dist

    picked = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    d = Dist("cuda")
    assert picked == [1] and not d.owns_group
    Dist("cpu")
    assert picked == [1]


@pytest.mark.distributed
def test_two_rank_alignopsd_step_reduces_every_percentile_from_samples():
    """Each rank carries the values behind its percentiles (span lengths, per-turn weights, token gaps), so the
    data-parallel reduction recomputes every percentile and std instead of dropping (or averaging) it."""
    if os.environ.get("WORLD_SIZE") != "2":
        pytest.skip("run under torchrun --nproc_per_node=2")
    import torch.distributed as dist
    from alignopsd.engine.parallel.collectives import reduce_metrics
    from alignopsd.engine.step.episodes import run_validation
    from alignopsd.engine.step.recipe import run_step

    from alignopsd.reduction import Reduce

    torch.set_num_threads(1)
    out = Path(tempfile.gettempdir()) / f"alignopsd-dist-samples-{os.environ.get('MASTER_PORT', '0')}"
    ov = [*GUESS, "algorithm.estimator=alignopsd", "trainer.total_steps=1", "trainer.logging.audit=false",
          f"output_dir={out}", "env.tasks_per_step=4", "trainer.ppo.micro_batch_size=4"]  # fmt: skip
    tr = lh.build_trainer(TINY, ov)
    res = run_step(tr.parts, 0)
    reduce_metrics([res.metrics], strict=True)  # every metric of the step declares its reduction (else raises)
    quantiles = [k for k, v in res.metrics.items() if v.how is Reduce.QUANTILE]
    assert "m2/turn_weight_p95" in quantiles and all(res.metrics[k].samples is not None for k in quantiles)
    reduced = tr.reduce_metrics(res.metrics)  # strict mode: an undeclared metric would raise here
    assert "metrics/unreduced" not in reduced and set(reduced) == set(res.metrics)
    val = tr.reduce_metrics(run_validation(tr.parts, 1))  # the validation (and `alignopsd eval`) metrics
    assert val["episode/count"] == float(len(tr.parts.val_tasks) // 2 * 2)
    both: list = [None, None]
    dist.all_gather_object(both, (reduced, val))
    assert both[0] == both[1]  # every rank logs the same reduction


@pytest.mark.distributed
def test_a_leftover_low_precision_grad_is_averaged_with_the_others():
    """A bf16 gradient written into a parameter without a backward pass (rank 0 only) is folded into the fp32
    masters before the data-parallel all-reduce: both ranks step with the average and stay identical."""
    if os.environ.get("WORLD_SIZE") != "2":
        pytest.skip("run under torchrun --nproc_per_node=2")
    import torch.distributed as dist
    from alignopsd.engine.policy.hf import HFPolicy

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    policy = HFPolicy(torch.nn.Linear(4, 4).to(torch.bfloat16), lr=0.1, weight_decay=0.0)
    assert policy.distributed and policy.master
    if dist.get_rank() == 0:
        policy.params[0].grad = torch.ones_like(policy.params[0])
    res = policy.optimizer_step(None)
    got: list = [None, None]
    dist.all_gather_object(got, (res["grad_norm"], [m.clone() for m in policy.optimizer.masters]))
    assert got[0][0] == got[1][0] == pytest.approx(2.0)  # the average (0.5 in 16 entries), on both ranks
    assert all(torch.equal(a, b) for a, b in zip(got[0][1], got[1][1]))


def _timed_gather(group):
    """An all-gather of Python objects over ``group`` (one made with a short timeout: a rank left waiting by a
    failing one errors out in seconds instead of hanging the suite)."""
    import torch.distributed as dist

    def gather(obj):
        out: list = [None, None]
        dist.all_gather_object(out, obj, group=group)
        return out

    return gather


@pytest.mark.distributed
def test_an_io_error_of_rank_0_on_the_run_folder_ends_every_rank_with_its_message(monkeypatch):
    """Rank 0's I/O error while it takes the run lock (here ``run.lock`` is a directory: EISDIR, real even for
    root), and while it sets an earlier run's history aside (here ``abandoned`` is a file), raises on every rank at
    once with that error's message; no rank is left waiting in a collective."""
    if os.environ.get("WORLD_SIZE") != "2":
        pytest.skip("run under torchrun --nproc_per_node=2")
    import shutil
    import time
    from datetime import timedelta

    import torch.distributed as dist
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.run.process import Dist
    from alignopsd.engine.run.runlock import LOCK_FILE, OutputFolderError
    from alignopsd.engine.run.trainer import Trainer

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    base = Path(tempfile.gettempdir()) / f"alignopsd-dist-ioerr-{os.environ.get('MASTER_PORT', '0')}"
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        (base / "locked" / LOCK_FILE).mkdir(parents=True)
        (base / "history").mkdir()
        (base / "history" / "metrics.jsonl").write_text('{"step": 1, "kind": "train"}\n')  # an earlier run's
        (base / "history" / "abandoned").write_text("")
    dist.barrier()
    lh.register_guess_env()
    ov = [*GUESS, "algorithm.estimator=grpo", "trainer.total_steps=1", "env.tasks_per_step=4"]

    def dist_with_timeout() -> Dist:
        d = Dist("cpu")
        monkeypatch.setattr(d, "gather_objects", _timed_gather(group))
        return d

    t0 = time.monotonic()
    with pytest.raises(OutputFolderError, match=r"cannot take the lock of output folder .*Is a directory"):
        Trainer(load_config(TINY, [*ov, f"output_dir={base / 'locked'}"]), dist=dist_with_timeout())
    assert time.monotonic() - t0 < 20

    tr = Trainer(load_config(TINY, [*ov, f"output_dir={base / 'history'}"]), dist=dist_with_timeout())
    t0 = time.monotonic()
    with pytest.raises(OutputFolderError, match=r"cannot set the history of .* aside: .*abandoned"):
        tr.fit()
    assert time.monotonic() - t0 < 20
    tr.release_output()
    dist.barrier()
