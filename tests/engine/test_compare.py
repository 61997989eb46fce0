"""The ``alignopsd compare`` command: estimators trained side by side, held-out success table and plot, resume.

The learning runs use tiny.yaml with the guess environment and the candidate-choice generator of
``learn_helpers`` (a random-weight model cannot write the tag format); the command-line run uses the engine's own
trainer and generator on the codeword environment, whose held-out games depend on the seed they are sampled with.
"""

from __future__ import annotations

import io
import json
import shutil
import statistics
from pathlib import Path

import learn_helpers as lh
import pytest
import torch
from alignopsd.engine.commands import cli, compare, compare_plan
from alignopsd.engine.config.schema import ConfigError, load_config
from alignopsd.engine.observe.metrics import read_metrics
from alignopsd.engine.run.components import build_env

TINY = str(lh.TINY_CONFIG)
# the guess task at its smallest: 2 tasks x 2 siblings x 2 turns per step
FAST = [
    *lh.GUESS_OVERRIDES,
    "generation.backend=choice",  # what build_trainer sets, so the stored config of a run is this comparison's
    "env.tasks_per_step=2",
    "env.group_n=2",
    "trainer.ppo.mini_batch_size=8",
    "trainer.ppo.micro_batch_size=8",
    "trainer.logging.audit=false",
]
ESTIMATORS = ("grpo", "alignopsd")
SEEDS = (0, 1)
STEPS = 2


class Factory:
    """learn_helpers.build_trainer, remembering each run it built and the held-out games its validation used."""

    def __init__(self) -> None:
        self.built: list[str] = []
        self.val_keys: dict[str, list[str]] = {}

    def __call__(self, config: str, overrides: list[str]):
        tr = lh.build_trainer(config, overrides)
        name = Path(tr.cfg.output_dir).name
        self.built.append(name)
        fit = tr.fit

        def fit_and_record(**kw):
            out = fit(**kw)
            self.val_keys[name] = [t.key for t in tr.parts.val_tasks]
            return out

        tr.fit = fit_and_record
        return tr


def _compare(out: Path, factory: Factory, overrides=FAST, estimators=ESTIMATORS, seeds=2, first_seed=None):
    stream = io.StringIO()
    res = compare.run(TINY, estimators=estimators, seeds=seeds, first_seed=first_seed, steps=STEPS, eval_every=1,
                      out=out, overrides=overrides, trainer_factory=factory, stream=stream)  # fmt: skip
    return res, stream.getvalue()


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    torch.set_num_threads(1)
    lh.register_guess_env()
    out = tmp_path_factory.mktemp("compare")
    factory = Factory()
    res, text = _compare(out, factory)
    return out, res, text, factory


def _val_success(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["episode/success_rate"] for r in read_metrics(run_dir / "metrics.jsonl", "val")}


@pytest.mark.slow
def test_compare_writes_the_table_of_the_runs_own_metrics(compared):
    out, res, text, factory = compared
    assert factory.built == [f"{e}-seed{s}" for e in ESTIMATORS for s in SEEDS]
    assert res["eval_steps"] == [0, 1, 2]
    assert res["val_tasks"] == [f"guess-test-{i}" for i in range(4)]
    md = (out / "compare.md").read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in md.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()}  # fmt: skip
    assert sorted(map(int, rows)) == [0, 1, 2]
    per_run = {}
    for run in res["runs"]:
        run_dir = out / f"{run['estimator']}-seed{run['seed']}"
        success = _val_success(run_dir)
        per_run[(run["estimator"], run["seed"])] = success
        assert sorted(success) == [0, 1, 2]
        assert run["success"] == {str(k): v for k, v in success.items()}
        # every run evaluated on the same held-out games, one episode each
        assert json.loads((run_dir / "val_tasks.json").read_text()) == res["val_tasks"]
        assert factory.val_keys[run_dir.name] == res["val_tasks"]
        assert all(r["episode/count"] == 4 for r in read_metrics(run_dir / "metrics.jsonl", "val"))
        assert len(read_metrics(run_dir / "metrics.jsonl", "train")) == STEPS
    for seed in SEEDS:  # same starting weights, games and validation seeds: the step-0 passes agree
        assert per_run[("grpo", seed)][0] == per_run[("alignopsd", seed)][0]
    for j, est in enumerate(ESTIMATORS):
        for step in (0, 1, 2):
            vals = [per_run[(est, s)][step] for s in SEEDS]
            cell = res["success"][est][str(step)]
            assert cell["values"] == vals and cell["n"] == len(SEEDS)
            assert cell["mean"] == pytest.approx(statistics.fmean(vals))
            assert cell["std"] == pytest.approx(statistics.stdev(vals))
            want = f"{100 * statistics.fmean(vals):.1f} ± {100 * statistics.stdev(vals):.1f} (n={len(SEEDS)})"
            assert rows[str(step)][j] == want
    diffs = [per_run[("alignopsd", s)][STEPS] - per_run[("grpo", s)][STEPS] for s in SEEDS]
    assert res["paired_vs_first"]["alignopsd"]["values"] == pytest.approx(diffs)
    assert res["final_table"]["grpo"]["Success"]["values"] == pytest.approx(
        [100 * per_run[("grpo", s)][2] for s in SEEDS]
    )
    assert json.loads((out / "compare.json").read_text()) == res
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for e in ESTIMATORS:
        for s in SEEDS:
            assert f"[compare] run {ESTIMATORS.index(e) * 2 + s + 1}/4 {e}-seed{s}: start" in text
            assert f"[{e}-seed{s}] [val] step 1: success" in text
    assert text.count(": done in ") == 4


@pytest.mark.slow
def test_compare_resumes_finished_runs_and_refuses_a_changed_config(compared, tmp_path):
    src, first, _, _ = compared
    out = tmp_path / "again"
    shutil.copytree(src, out)
    keys = ("success", "final_table", "paired_vs_first", "val_tasks", "eval_steps")

    factory = Factory()
    res, text = _compare(out, factory)  # everything finished: read, not redone
    assert factory.built == []
    assert text.count("finished earlier") == 4
    assert {k: res[k] for k in keys} == {k: first[k] for k in keys}

    # a run trained again in a call of its own (a fresh process per run), then the whole table read: same numbers
    shutil.rmtree(out / "alignopsd-seed1")
    factory = Factory()
    one, _ = _compare(out, factory, estimators=("alignopsd",), seeds=1, first_seed=1)
    assert factory.built == ["alignopsd-seed1"]
    assert one["seeds"] == [1] and one["success"]["alignopsd"]["2"]["values"] == [
        first["success"]["alignopsd"]["2"]["values"][1]
    ]
    res, _ = _compare(out, factory)
    assert factory.built == ["alignopsd-seed1"]
    assert {k: res[k] for k in keys} == {k: first[k] for k in keys}

    factory = Factory()
    with pytest.raises(ConfigError, match=r"grpo-seed0: this finished run was trained with another config:\n  "
                                          r"trainer.optimizer.lr: 0.0001 -> 0.0002"):  # fmt: skip
        _compare(out, factory, [*FAST, "trainer.optimizer.lr=2e-4"])
    assert factory.built == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "2", "--set", "trainer.seed=3"], "--set trainer.seed: compare sets it for every run"),
        (["--steps", "2", "--set", "trainer.test_freq=3"], "--set trainer.test_freq: compare sets it"),  # old name
        (["--steps", "0"], "--steps: expected an int >= 1, got 0"),
        (["--steps", "2", "--eval-every", "-1"], "--eval-every: expected an int >= 0"),
        (["--steps", "2", "--seeds", "0"], "--seeds: the number of seeds must be an int >= 1, got 0"),
        (["--steps", "2", "--estimators", "grpo,grpo"], "--estimators: expected distinct"),
        (["--steps", "2", "--estimators", "grpo,nosuch"], "nosuch"),
        (["--steps", "2", "--set", "trainer.nope=1"], "trainer.nope: unknown key"),
    ],
)
def test_compare_rejects_bad_options_before_training(args, message, tmp_path, capsys):
    assert cli.main(["compare", "--config", TINY, "--out", str(tmp_path / "c"), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_eval_schedule():
    assert compare_plan.eval_schedule(10, 3) == [0, 3, 6, 9, 10]
    assert compare_plan.eval_schedule(4, 2) == [0, 2, 4]
    assert compare_plan.eval_schedule(5, 0) == [0, 5]


@pytest.mark.slow
def test_compare_command_pins_the_held_out_games(tmp_path, capsys):
    """The engine's own trainer and generator (codeword, whose held-out games depend on the sampling seed): the
    runs of seeds 0 and 1 are evaluated on the games of --val-seed 0."""
    torch.set_num_threads(1)
    out = tmp_path / "cmp"
    sets = ["env.val_tasks=2", "env.tasks_per_step=1", "env.group_n=2", "trainer.ppo.mini_batch_size=8",
            "trainer.ppo.micro_batch_size=8", "trainer.logging.audit=false"]  # fmt: skip
    argv = ["compare", "--config", TINY, "--estimators", "grpo", "--seeds", "2", "--steps", "1", "--eval-every",
            "0", "--out", str(out)] + [x for s in sets for x in ("--set", s)]  # fmt: skip
    assert cli.main(argv) == 0
    pinned = [t.key for t in build_env(load_config(TINY, [*sets, "trainer.seed=0"]))[2]]
    other = [t.key for t in build_env(load_config(TINY, [*sets, "trainer.seed=1"]))[2]]
    assert pinned != other
    res = json.loads((out / "compare.json").read_text())
    assert res["val_tasks"] == pinned and res["seeds"] == [0, 1] and res["eval_steps"] == [0, 1]
    for s in (0, 1):
        run_dir = out / f"grpo-seed{s}"
        assert json.loads((run_dir / "val_tasks.json").read_text()) == pinned
        val = read_metrics(run_dir / "metrics.jsonl", "val")
        assert [r["step"] for r in val] == [0, 1] and all(r["episode/count"] == 2 for r in val)
        assert res["runs"][s]["success"] == {str(r["step"]): r["episode/success_rate"] for r in val}
    assert "| 1 | " in (out / "compare.md").read_text()
    assert "[compare] run 2/2 grpo-seed1: done in" in capsys.readouterr().out


def test_compare_writes_nothing_into_a_run_folder_another_run_holds(tmp_path):
    """A run folder whose lock a live run holds is refused before compare writes into it (its held-out game keys
    are written once the run's trainer holds the lock)."""
    from alignopsd.engine.run.runlock import OutputLock, OutputLockedError

    lh.register_guess_env()
    locks = [OutputLock(tmp_path / f"{e}-seed{s}").acquire() for e in ESTIMATORS for s in SEEDS]
    try:
        factory = Factory()
        with pytest.raises(OutputLockedError, match="in use by another run"):
            _compare(tmp_path, factory)
        assert factory.built == []
        assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["run.lock"] * len(locks)
    finally:
        for lock in locks:
            lock.release()
