"""Resume: the config is compared with the checkpoint's, bad checkpoints are skipped, bad states never saved."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import learn_helpers as lh
import pytest
import torch
from alignopsd.engine.checkpoint import checkpoint as ck
from alignopsd.engine.checkpoint.trainer_state import TrainerState
from alignopsd.engine.config.arch_check import ArchitectureMismatchError
from alignopsd.engine.config.schema import load_config
from alignopsd.engine.run.resume import ResumeConfigError, check_resume, read_span_lengths, stored_config

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


def _tiny_state() -> dict[str, torch.Tensor]:
    """Zero weights of the shapes of configs/tiny.yaml's model (the tied output layer left out)."""
    from alignopsd.engine.models.loading import tiny_config
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in LlamaForCausalLM(tiny_config()).state_dict().items() if k != "lm_head.weight"}
    return {k: torch.zeros(s) for k, s in shapes.items()}


def _checkpoint(out: Path, cfg, step: int = 2, world_size: int = 1, model_state=None) -> Path:
    """A checkpoint of ``cfg``'s run as the trainer writes it (stand-in weights unless given; the config is what
    matters here)."""
    return ck.save_checkpoint(
        out / "checkpoints",
        step,
        model_state=model_state or {"w": torch.zeros(2)},
        optimizer_state=None,
        trainer_state=TrainerState(step, run_config=stored_config(cfg)),
        world_size=world_size,
    )


def test_changes_that_alter_training_are_refused_with_the_list(tmp_path):
    path = _checkpoint(tmp_path, load_config(TINY))
    changed = load_config(
        TINY,
        [
            "trainer.optimizer.lr=0.01",
            "algorithm.estimator=grpo",
            "trainer.seed=7",
            "env.group_n=8",
            "env.name=alfworld",
            "model.name=smollm2-135m",
            "algorithm.rectify.gamma=0.5",
        ],
    )
    with pytest.raises(ResumeConfigError) as err:
        check_resume(path, changed)
    msg = str(err.value)
    for line in ("trainer.optimizer.lr: 0.0001 -> 0.01", "algorithm.estimator: 'alignopsd' -> 'grpo'",
                 "trainer.seed: 0 -> 7", "env.group_n: 4 -> 8", "env.name: 'codeword' -> 'alfworld'",
                 "model.name: 'tiny' -> 'smollm2-135m'", "algorithm.rectify.gamma: 0.3 -> 0.5",
                 "--allow-config-change"):  # fmt: skip
        assert line in msg, line
    with pytest.raises(ArchitectureMismatchError, match="'model.embed_tokens.weight' .* is missing"):
        check_resume(path, changed, allow_changes=True)  # let through, but the weights must fit the model
    fits = _checkpoint(tmp_path / "fits", load_config(TINY), model_state=_tiny_state())
    lines = check_resume(
        fits, load_config(TINY, ["trainer.optimizer.lr=0.01", "algorithm.estimator=grpo"]), allow_changes=True
    )
    assert any(line.startswith("trainer.optimizer.lr: 0.0001 -> 0.01 (overridden") for line in lines)


def test_changes_that_keep_the_trajectory_are_listed(tmp_path):
    path = _checkpoint(tmp_path, load_config(TINY))
    same = check_resume(path, load_config(TINY), world_size=1)
    assert same == []
    lines = check_resume(
        path,
        load_config(
            TINY,
            [
                "output_dir=elsewhere",
                "trainer.checkpoint.save_freq=5",
                "trainer.total_steps=10",
                "env.workers=2",
                "env.step_timeout_s=5",
                "trainer.checkpoint.keep_last=4",
                "trainer.logging.report=true",
            ],
        ),
        world_size=2,
    )
    assert "trainer.total_steps: 3 -> 10" in lines and "env.workers: 0 -> 2" in lines
    assert "world_size (data-parallel ranks): 1 -> 2" in lines and len(lines) == 8


def test_total_steps_rules(tmp_path):
    path = _checkpoint(tmp_path, load_config(TINY, ["trainer.optimizer.warmup_ratio=0.5"]), step=2)
    with pytest.raises(ResumeConfigError, match="trainer.total_steps: 3 -> 10 .*warm-up"):
        check_resume(path, load_config(TINY, ["trainer.optimizer.warmup_ratio=0.5", "trainer.total_steps=10"]))
    with pytest.raises(ResumeConfigError, match="trainer.total_steps: 1 is below the checkpoint's step 2"):
        check_resume(path, load_config(TINY, ["trainer.total_steps=1"]), allow_changes=True)


def test_a_checkpoint_without_its_config_needs_the_override(tmp_path):
    path = ck.save_checkpoint(tmp_path, 1, model_state=_tiny_state(), optimizer_state=None)
    with pytest.raises(ResumeConfigError, match="stores no run config"):
        check_resume(path, load_config(TINY))
    assert "not compared" in check_resume(path, load_config(TINY), allow_changes=True)[0]


def test_span_lengths_side_file(tmp_path):
    p = tmp_path / "span_lengths.json"
    p.write_text("[3, 1, 4, 1, 5]")
    assert read_span_lengths(p, 3) == ([3, 1, 4], None)
    assert read_span_lengths(p, 0) == ([], None)
    spans, warning = read_span_lengths(p, 9)
    assert spans == [] and "holds 5 of the 9" in warning
    p.write_text("")  # what a kill during the old non-atomic write left
    spans, warning = read_span_lengths(p, 2)
    assert spans == [] and "unreadable" in warning


_MAIN = (
    "import sys\n"
    "from alignopsd.engine.commands.train import main\n"
    "rc = main(sys.argv[1:])\n"
    "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    "sys.exit(rc)\n"
)


@pytest.mark.parametrize(
    ("setup", "extra", "match"),
    [
        ("ok", ["--set", "trainer.optimizer.lr=0.01"], "trainer.optimizer.lr: 0.0001 -> 0.01"),
        ("ok", ["--set", "trainer.total_steps=1"], "trainer.total_steps: 1 is below the checkpoint's step 2"),
        ("bad", [], "refusing to start over"),
    ],
)
def test_train_refuses_before_loading_anything(tmp_path, setup, extra, match):
    """The resume checks run in the CLI before the trainer loads a model: exit code 2, one message, no traceback."""
    path = _checkpoint(tmp_path, load_config(TINY, [f"output_dir={tmp_path}"]))
    (tmp_path / "config.yaml").write_text("original")
    if setup == "bad":
        (path / "model.safetensors").write_bytes(b"\0" * (path / "model.safetensors").stat().st_size)
    args = ["--config", TINY, "--set", f"output_dir={tmp_path}", "--resume", "auto", *extra]
    r = subprocess.run([sys.executable, "-c", _MAIN, *args], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert match in r.stderr and "Traceback" not in r.stderr
    assert (tmp_path / "config.yaml").read_text() == "original"


@pytest.mark.slow
def test_trainer_falls_back_past_a_corrupt_checkpoint_and_never_saves_nan(tmp_path):
    """A real run: step 3's weights corrupted and span_lengths.json emptied -> --resume auto says so, resumes from
    step 2, ends at step 4; then a NaN in the weights stops the save with a message naming the last good checkpoint."""
    import io

    from alignopsd.engine.observe.metrics import read_metrics

    torch.set_num_threads(1)
    ov = [
        *lh.GUESS_OVERRIDES,
        "algorithm.estimator=alignopsd",
        "trainer.checkpoint.save_freq=1",
        "trainer.checkpoint.keep_last=3",
        f"output_dir={tmp_path}",
    ]
    lh.build_trainer(TINY, [*ov, "trainer.total_steps=3"]).fit()
    weights = tmp_path / "checkpoints" / "step_000003" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-4096:] = bytes(b ^ 0xFF for b in raw[-4096:])
    weights.write_bytes(bytes(raw))
    state = json.loads((tmp_path / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    assert state["span_lengths_count"] > 0
    (tmp_path / "span_lengths.json").write_text("")
    tr = lh.build_trainer(TINY, [*ov, "trainer.total_steps=4"])
    tr.stream = io.StringIO()
    tr.fit(resume="auto")
    said = tr.stream.getvalue()
    assert "'model.safetensors' is corrupted" in said and "falling back to" in said and "step_000002" in said
    assert "span_lengths.json unreadable" in said  # a report-only side file: a warning, not a crash
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert ck.latest_checkpoint(tmp_path / "checkpoints").name == "step_000004"
    with torch.no_grad():
        next(tr.parts.policy.model.parameters()).view(-1)[0] = float("nan")
    tr.step = 5
    with pytest.raises(ck.UnsafeStateError, match="not finite.*last good checkpoint is .*step_000004"):
        tr.save()
    assert not (tmp_path / "checkpoints" / "step_000005").exists()


def test_a_resume_takes_the_rows_the_run_measured(tmp_path, monkeypatch):
    """Auto rows on a CPU, measured: the first update times packed against padded rows, the checkpoint stores the
    choice (``TrainerState.rows``), and a resumed run takes it again (said in its log) instead of measuring."""
    import io

    from alignopsd.engine.checkpoint.trainer_state import read_trainer_state
    from alignopsd.engine.step import packing_trial

    monkeypatch.delenv("ALIGNOPSD_CPU_PATHS")  # measured, as on a user's machine (the suite pins the torch paths)
    torch.set_num_threads(1)
    ov = [
        *lh.GUESS_OVERRIDES,
        "trainer.checkpoint.save_freq=1",
        f"output_dir={tmp_path}",
        "trainer.ppo.use_remove_padding=auto",
    ]
    tr = lh.build_trainer(TINY, [*ov, "trainer.total_steps=1"])
    assert tr.parts.policy.rows.undecided and tr.parts.rescorer.rows is tr.parts.policy.rows
    timed = []
    monkeypatch.setattr(packing_trial.PackingTrial, "settle", _spy(packing_trial.PackingTrial.settle, timed))
    tr.fit()
    chose = tr.parts.policy.rows.choice
    assert timed and chose is not None and chose.packed_s is not None
    assert read_trainer_state(tmp_path / "checkpoints" / "step_000001").rows == chose
    again = lh.build_trainer(TINY, [*ov, "trainer.total_steps=2"])
    again.stream = io.StringIO()
    timed.clear()
    again.fit(resume="auto")
    assert again.parts.policy.rows.choice == chose and again.parts.policy.rows.packed is chose.packed
    assert f"kernels: {chose.describe()} (as the run that wrote the checkpoint measured)" in again.stream.getvalue()
    assert all(out is None for out in timed)  # the resumed run's trial had nothing to time


def _spy(settle, seen: list):
    def wrapped(self):
        out = settle(self)
        seen.append(out)
        return out

    return wrapped
