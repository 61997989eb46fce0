"""trainer.logging.loggers: the config, the pre-flight check of the trackers, the fan-out of metrics.jsonl to W&B
(offline) and MLflow (a local file store) read back through each library, a logger failing during a run, and a resumed
run continuing the same tracker runs (slow: a tiny training run)."""

from __future__ import annotations

import io
import json
import socket
from pathlib import Path

import learn_helpers as lh
import pytest
import torch
import wandb_records as wr
from alignopsd.engine.checkpoint import checkpoint as ck
from alignopsd.engine.checkpoint.manifest import ManifestError
from alignopsd.engine.checkpoint.trainer_state import STATE_FILE, TrainerState, read_trainer_state
from alignopsd.engine.commands.train import main as train_main
from alignopsd.engine.config import logger_check
from alignopsd.engine.config.logger_check import check_loggers
from alignopsd.engine.config.schema import ConfigError, load_config
from alignopsd.engine.observe.metrics import MetricsLogger, read_metrics
from alignopsd.engine.observe.mlflow_sink import ABANDONED_TAG
from alignopsd.engine.observe.sinks import Sink, series_name
from alignopsd.engine.observe.strict import STRICT_ENV
from alignopsd.engine.run.loggers import open_sinks
from alignopsd.engine.run.resume import config_changes, stored_config, with_loggers

TINY = str(lh.TINY_CONFIG)


@pytest.fixture
def trackers(tmp_path, monkeypatch):
    """W&B offline under tmp_path/wb, MLflow's file store under tmp_path/mlruns (MLflow 3 asks for the opt-in)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    for var in ("WANDB_PROJECT", "WANDB_NAME", "WANDB_TAGS", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------------------
# config and pre-flight


def test_loggers_default_to_jsonl_and_tensorboard_and_jsonl_is_required():
    assert load_config(None).trainer.logging.loggers == ["jsonl", "tensorboard"]
    assert load_config(TINY).trainer.logging.loggers == ["jsonl"]
    assert load_config(None, ["trainer.tensorboard=false"]).trainer.logging.loggers == ["jsonl"]  # the earlier switch
    with pytest.raises(
        ConfigError, match=r"^trainer.logging.tensorboard: True contradicts trainer.logging.loggers \['jsonl'\]"
    ):
        load_config(TINY, ["trainer.tensorboard=true"])  # tiny.yaml sets loggers: [jsonl]
    with pytest.raises(ConfigError, match=r"^trainer.logging.loggers: must hold 'jsonl'"):
        load_config(None, ["trainer.logging.loggers=[wandb]"])
    with pytest.raises(ConfigError, match=r"^trainer.logging.loggers: lists a logger twice"):
        load_config(None, ["trainer.logging.loggers=[jsonl,mlflow,mlflow]"])
    with pytest.raises(ConfigError, match=r"^trainer.logging.loggers\[1\]: unknown value 'comet'"):
        load_config(None, ["trainer.logging.loggers=[jsonl,comet]"])
    with pytest.raises(ConfigError, match=r"^trainer.logging.wandb.mode: unknown value 'cloud'"):
        load_config(None, ["trainer.logging.wandb.mode=cloud"])


def test_a_missing_package_is_named_at_preflight(monkeypatch, tmp_path):
    real = logger_check.importlib.util.find_spec
    monkeypatch.setattr(logger_check.importlib.util, "find_spec", lambda m: None if m == "mlflow" else real(m))
    cfg = load_config(TINY, ["trainer.logging.loggers=[jsonl,mlflow]"])
    with pytest.raises(
        ConfigError, match=r"^trainer.logging.loggers: 'mlflow' needs the mlflow package.*alignopsd\[mlflow\]"
    ):
        check_loggers(cfg.trainer, tmp_path, {})


def test_online_wandb_without_network_ends_train_with_exit_2_and_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_closed_port()}")
    argv = [
        "--config",
        TINY,
        "--set",
        "trainer.logging.loggers=[jsonl,wandb]",
        "--set",
        "trainer.logging.wandb.mode=online",
        "--output-dir",
        str(tmp_path / "run"),
    ]
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "config error: trainer.logging.wandb.mode: online, but the W&B server"
    ), err
    assert not (tmp_path / "run").exists()  # nothing started


def test_mlflow_uris_that_cannot_work_are_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    cases = [
        ("bogus://x", r"trainer.logging.mlflow.tracking_uri: 'bogus://x': .*unsupported URI"),
        (f"http://127.0.0.1:{_closed_port()}", r"the tracking server is out of reach"),
        ((tmp_path / "m").as_uri(), r"MLFLOW_ALLOW_FILE_STORE=true"),  # MLflow 3's own refusal of a file store
    ]
    for uri, message in cases:
        cfg = load_config(
            TINY, ["trainer.logging.loggers=[jsonl,mlflow]", f"trainer.logging.mlflow.tracking_uri={uri}"]
        )
        with pytest.raises(ConfigError, match=message) as err:
            check_loggers(cfg.trainer, tmp_path, {})
        assert "\n" not in str(err.value)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    check_loggers(cfg.trainer, tmp_path, {})  # the same store, opted in
    with pytest.raises(ConfigError, match=r"^MLFLOW_TRACKING_URI: 'bogus://y'"):  # unset in the config: the variable
        check_loggers(load_config(TINY, ["trainer.logging.loggers=[jsonl,mlflow]"]).trainer, tmp_path,
                      {"MLFLOW_TRACKING_URI": "bogus://y"})  # fmt: skip


def test_logger_settings_do_not_block_a_resume():
    old = stored_config(load_config(TINY))
    new = stored_config(load_config(TINY, ["trainer.logging.loggers=[jsonl,wandb]", "trainer.logging.wandb.project=p",
                                           "trainer.logging.mlflow.tags={team: rl}"]))  # fmt: skip
    blocking, neutral = config_changes(old, new, step=2)
    assert blocking == [] and {line.split(":")[0] for line in neutral} == {
        "trainer.logging.loggers",
        "trainer.logging.wandb.project",
        "trainer.logging.mlflow.tags",
        "trainer.logging.mlflow.tags.team",
    }
    logging = old["trainer"].pop("logging")  # a checkpoint of the earlier switch, in the flat layout of its time
    for key in ("loggers", "wandb", "mlflow"):
        del logging[key]
    old["trainer"].update(logging, tensorboard=False)
    assert config_changes(with_loggers(old), stored_config(load_config(TINY)), step=2) == ([], [])


def test_run_ids_in_the_checkpoint_are_typed(tmp_path):
    runs = {"wandb": "abc123", "mlflow": "f" * 32}
    path = ck.save_checkpoint(tmp_path, 1, model_state={"w": torch.zeros(2)}, optimizer_state=None,
                              trainer_state=TrainerState(1, logger_runs=runs))  # fmt: skip
    assert read_trainer_state(path).logger_runs == runs
    state = json.loads((path / STATE_FILE).read_text())
    for bad in ({"wandb": 7}, ["abc"], {"mlflow": ""}):
        (path / STATE_FILE).write_text(json.dumps({**state, "logger_runs": bad}))
        with pytest.raises(ManifestError, match="logger_runs"):
            read_trainer_state(path)


# ---------------------------------------------------------------------------------------------------------------------
# the fan-out, read back through each library


def _rows(logger: MetricsLogger) -> None:
    logger.log(1, {"actor/loss": 0.5, "episode/reward_mean": 1.0, "bad": float("nan")})
    logger.log(2, {"actor/loss": 0.25, "episode/reward_mean": 3.0, "nested": {"x": 2}})
    logger.log(2, {"episode/success_rate": 0.75}, kind="val", echo=False)


def _expected(path: Path) -> dict[int, dict[str, float]]:
    """{step: {logged name: value}} of metrics.jsonl, as every logger must hold it."""
    out: dict[int, dict[str, float]] = {}
    for r in read_metrics(path, None):
        vals = {series_name(r["kind"], k): v for k, v in r.items() if k not in ("kind", "step", "wall_time")}
        out.setdefault(r["step"], {}).update({k: v for k, v in vals.items() if v is not None})
    return out


def _mlflow_rows(client, run_id: str) -> dict[int, dict[str, float]]:
    """The last point of every step of every metric of the run (MLflow's own history)."""
    out: dict[int, dict[str, float]] = {}
    for key in client.get_run(run_id).data.metrics:
        for m in client.get_metric_history(run_id, key):
            out.setdefault(m.step, {})[key] = m.value
    return out


def test_every_row_reaches_wandb_and_mlflow_with_the_names_and_steps_of_metrics_jsonl(trackers):
    from mlflow import MlflowClient

    cfg = load_config(
        TINY,
        [
            "trainer.logging.loggers=[jsonl,wandb,mlflow]",
            "trainer.logging.wandb.tags=[t1]",
            "trainer.logging.mlflow.experiment=exp",
            "trainer.logging.mlflow.tags={team: rl}",
        ],
    )
    config = stored_config(cfg)
    wb, ml = open_sinks(cfg.trainer, trackers / "run", run_name="tiny", config=config)
    logger = MetricsLogger(trackers / "run", total_steps=2, sinks=[wb, ml], stream=io.StringIO())
    _rows(logger)
    (trackers / "run" / "report.md").write_text("# report\n")
    logger.finish([trackers / "run" / "report.md"], {"report/last/actor/loss": 0.25}, 2)
    logger.close()
    want = _expected(trackers / "run" / "metrics.jsonl")
    assert want[2]["val/episode/success_rate"] == 0.75 and "bad" not in want[1]

    (attempt,) = wr.attempts(trackers / "wb", wb.run_id)
    assert wr.history_rows(attempt) == want
    assert wr.config_of(attempt)["trainer"]["optimizer"]["lr"] == config["trainer"]["optimizer"]["lr"]
    assert wr.summary_of(attempt)["report/last/actor/loss"] == 0.25
    assert wr.artifacts_of(attempt) == [(f"report-{wb.run_id}", "report", ["report.md"])]

    client = MlflowClient()
    run = client.get_run(ml.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny" and run.data.tags["team"] == "rl"
    assert client.get_experiment(run.info.experiment_id).name == "exp"
    got = _mlflow_rows(client, ml.run_id)
    assert got == {1: want[1], 2: {**want[2], "report/last/actor/loss": 0.25}}
    assert run.data.params["trainer.optimizer.lr"] == str(config["trainer"]["optimizer"]["lr"])
    assert {a.path for a in client.list_artifacts(ml.run_id)} == {"config.json", "report"}
    assert [a.path for a in client.list_artifacts(ml.run_id, "report")] == ["report/report.md"]


class _Recorder(Sink):
    name = "recorder"

    def __init__(self) -> None:
        self.steps: list[int] = []

    def log(self, step, flat, kind):
        self.steps.append(step)


class _Broken(_Recorder):
    name = "broken"

    def log(self, step, flat, kind):
        raise OSError(28, "No space left on device")


def test_a_logger_failing_during_the_run_is_reported_once_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(STRICT_ENV, "0")
    ok, broken = _Recorder(), _Broken()
    logger = MetricsLogger(tmp_path, total_steps=3, sinks=[broken, ok], stream=io.StringIO())
    for step in (1, 2, 3):
        logger.log(step, {"actor/loss": 0.1})
    logger.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "[broken] logging step 1 failed (OSError: [Errno 28] No space left on device); the run goes on without this "
        "logger"
    ]
    assert ok.steps == [1, 2, 3] and [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    monkeypatch.setenv(STRICT_ENV, "1")  # under the tests the error is raised
    with pytest.raises(OSError, match="No space left"):
        MetricsLogger(tmp_path / "b", total_steps=1, sinks=[_Broken()], stream=io.StringIO()).log(1, {"a": 1.0})


# ---------------------------------------------------------------------------------------------------------------------
# a real run, resumed


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_tracker_runs(trackers):
    """Two steps (checkpoint every step, validation at step 2, report) logged to W&B and MLflow, then resumed from
    step 1: both continue the run the checkpoint names; W&B's history after the rewind and MLflow's last point of
    each step are metrics.jsonl's rows; MLflow keeps the abandoned step's points, tagged, and the report says so."""
    from mlflow import MlflowClient

    out = trackers / "run"
    ov = [
        *lh.GUESS_OVERRIDES,
        "algorithm.estimator=grpo",
        "trainer.checkpoint.save_freq=1",
        "trainer.checkpoint.keep_last=3",
        "trainer.validation.freq=2",
        "env.val_tasks=2",
        "trainer.logging.report=true",
        "trainer.logging.loggers=[jsonl,wandb,mlflow]",
        "trainer.total_steps=2",
        f"output_dir={out}",
    ]
    torch.set_num_threads(1)
    lh.build_trainer(TINY, ov).fit()
    runs = read_trainer_state(out / "checkpoints" / "step_000002").logger_runs
    assert (
        set(runs) == {"wandb", "mlflow"} and runs == read_trainer_state(out / "checkpoints" / "step_000001").logger_runs
    )
    first = _expected(out / "metrics.jsonl")
    lh.build_trainer(TINY, ov).fit(resume=str(out / "checkpoints" / "step_000001"))
    assert read_trainer_state(out / "checkpoints" / "step_000002").logger_runs == runs
    want = _expected(out / "metrics.jsonl")
    assert want[1] == first[1] and "val/episode/success_rate" in want[2]

    fresh, resumed = wr.attempts(trackers / "wb", runs["wandb"])
    assert wr.branch_point(fresh) is None and wr.branch_point(resumed) == (runs["wandb"], 1)
    assert sorted(wr.history_rows(resumed)) == [2]  # the resumed attempt logs step 2 only
    assert wr.live_history(trackers / "wb", runs["wandb"]) == want
    assert wr.config_of(fresh)["algorithm"]["estimator"] == "grpo" and wr.config_of(resumed) == {}  # logged once
    summary = wr.summary_of(resumed)
    assert summary["report/last/actor/loss"] == want[2]["actor/loss"]
    assert summary["report/last_val/episode/success_rate"] == want[2]["val/episode/success_rate"]
    (art,) = wr.artifacts_of(resumed)
    assert art[1] == "report" and "report.md" in art[2] and "reward_success.png" in art[2]

    client = MlflowClient()
    run = client.get_run(runs["mlflow"])
    assert run.info.status == "FINISHED" and run.data.tags[ABANDONED_TAG] == "2"
    assert [m.step for m in client.get_metric_history(runs["mlflow"], "actor/loss")] == [1, 2, 2]
    got = _mlflow_rows(client, runs["mlflow"])
    assert {s: {k: v for k, v in r.items() if not k.startswith("report/")} for s, r in got.items()} == want
    assert got[2]["report/last/actor/loss"] == want[2]["actor/loss"]
    assert {"report/report.md", "report/reward_success.png"} <= {
        a.path for a in client.list_artifacts(runs["mlflow"], "report")
    }
    report = (out / "report.md").read_text()
    assert f"MLflow run {runs['mlflow']}: the metric points of steps 2" in report
    assert f"W&B run {runs['wandb']}: rewound to step 1" in report


def test_only_the_rank_that_writes_metrics_logs(tmp_path):
    rec = _Recorder()
    MetricsLogger(tmp_path / "r1", total_steps=1, sinks=[rec], rank=1, stream=io.StringIO()).log(1, {"a": 1.0})
    assert rec.steps == [] and not (tmp_path / "r1").exists()
