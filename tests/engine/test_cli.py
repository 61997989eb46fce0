"""The ``alignopsd`` console command and the eval / profile subcommands."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from alignopsd.engine.commands import cli
from alignopsd.engine.commands.evaluate import format_table, table_values

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


def test_help_and_unknown_command(capsys):
    assert cli.main([]) == 2
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in cli.COMMANDS:
        assert cmd in out
    assert cli.main(["fly"]) == 2
    assert "unknown command 'fly'" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", ["train", "eval", "profile"])
def test_subcommands_reject_bad_config_keys(cmd, capsys):
    assert cli.main([cmd, "--config", TINY, "--set", "trainer.nope=1"]) == 2
    assert "trainer.nope: unknown key" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", ["train", "eval", "profile"])
@pytest.mark.parametrize(
    ("text", "sets", "match"),
    [
        ("", [], "the file is empty"),
        ("trainer:\n\tlr: 1\n", [], "run.yaml:2:1: YAML syntax error"),
        ("x: !!python/object/new:os.system [echo]\n", [], "YAML tag refused"),
        ("name: run\n", ["trainer.optimizer.lr=.nan"], "trainer.optimizer.lr: expected a finite number"),
    ],
)
def test_config_errors_exit_2_with_one_message(tmp_path, capsys, cmd, text, sets, match):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    overrides = [a for s in sets for a in ("--set", s)]
    assert cli.main([cmd, "--config", str(p), *overrides]) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1


def _hostile(tmp_path, case: str) -> tuple[list[str], str]:
    """The hostile configs of the reliability round: argv after ``train`` and the expected message."""
    head = "name: hostile\nenv:\n  name: codeword\n  options:\n"
    p = tmp_path / f"hostile_{case}.yaml"
    if case == "laughs":  # nested aliases: 10^9 strings once expanded
        rows = ["    a0: &a0 [" + ", ".join(["lol"] * 10) + "]"]
        rows += [f"    a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
        p.write_text(head + "\n".join(rows) + "\n")
        return ["--config", str(p)], "hostile_laughs.yaml:9:14: more than the limit of 20000 values"
    if case == "wide":  # 10 MB, 600,000 keys
        p.write_text(head + "".join(f"    key_{i:07d}: 1\n" for i in range(600_000)))
        assert p.stat().st_size > 10_000_000
        return ["--config", str(p)], f"is {p.stat().st_size} bytes, over the limit of 262144 bytes"
    deep = "[" * 5000 + "]" * 5000
    if case == "deep_file":
        p.write_text(f"{head}    x: {deep}\n")
        return ["--config", str(p)], "deep_file.yaml:5:69: lists and mappings nested deeper than the limit of 64"
    return ["--config", TINY, "--set", f"env.options.x={deep}"], "env.options.x: cannot parse value '[[["


@pytest.mark.parametrize("case", ["laughs", "wide", "deep_file", "deep_set"])
def test_hostile_configs_end_at_once_with_exit_2(tmp_path, capsys, case):
    """Each ends within 5 s (after the train module's imports) with exit 2 and one message."""
    import alignopsd.engine.commands.train  # noqa: F401 (the imports are not the config's time)

    argv, match = _hostile(tmp_path, case)
    start = time.perf_counter()
    assert cli.main(["train", *argv]) == 2
    assert time.perf_counter() - start < 5.0
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and match in err and err.count("\n") == 1, err[:500]


def test_hostile_config_through_the_console_entry(tmp_path):
    """The real entry (a fresh interpreter) on the billion laughs: exit 2, one line on stderr (a hang before)."""
    argv, match = _hostile(tmp_path, "laughs")
    cmd = [sys.executable, "-m", "alignopsd.engine", "train", *argv]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and match in r.stderr and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert r.stdout == ""


def test_train_preflight_exit_2(tmp_path, capsys):
    """Paths and options the run needs are checked before the trainer loads anything."""
    assert cli.main(["train", "--config", TINY, "--set", f"model.name={tmp_path / 'nope'}"]) == 2
    assert "model.name: " in capsys.readouterr().err
    assert cli.main(["train", "--config", TINY, "--set", "env.options={bogus: 1}"]) == 2
    assert "env.options.bogus: unknown option" in capsys.readouterr().err


def test_console_script_entry_point():
    r = subprocess.run([sys.executable, "-m", "alignopsd.engine", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "serve-retriever" in r.stdout


def test_games_argument_errors(capsys):
    with pytest.raises(SystemExit):
        cli.main(["games", "search", "--n", "3", "--out", "x"])
    with pytest.raises(SystemExit):
        cli.main(["games", "alfworld", "--n", "0", "--out", "x"])
    assert "--n: must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["games", "webshop", "--n", "3", "--out", "x"])  # the catalogue has no --n
    with pytest.raises(SystemExit):
        cli.main(["games", "webshop", "--products", "10", "--out", "x"])
    assert "n_products: need at least 40" in capsys.readouterr().err


def test_games_webshop_writes_the_official_layout(tmp_path, capsys):
    """``alignopsd games webshop`` writes the generated catalogue as the files the official-data check and the
    original-data loader read."""
    from alignopsd.engine.envs.webshop.data import get_catalogue
    from alignopsd.engine.envs.webshop.official import webshop_official_data

    assert cli.main(["games", "webshop", "--out", str(tmp_path), "--products", "40", "--goals", "6"]) == 0
    assert "items_shuffle.json" in capsys.readouterr().out
    files = webshop_official_data(str(tmp_path))
    cat = get_catalogue({"kind": "original", **files})
    assert len(cat.products) == 40 and len(cat.goals) == 6


def test_table1_layouts():
    alf = table_values("alfworld", {"episode/success/pick": 0.5, "episode/success/heat": 1.0,
                                    "episode/success_rate": 0.25})  # fmt: skip
    assert list(alf) == ["Pick", "Look", "Clean", "Heat", "Cool", "Pick2", "All"]
    assert alf["Pick"] == 50.0 and alf["Look"] is None and alf["All"] == 25.0
    web = table_values("webshop", {"episode/task_score_mean": 0.625, "episode/success_rate": 0.5})
    assert web == {"Score": 62.5, "Acc": 50.0}
    srch = table_values("search", {"episode/accuracy/nq": 0.5, "episode/accuracy/hotpotqa": 0.25,
                                   "episode/accuracy/kb_onehop": 1.0})  # fmt: skip
    assert srch["NQ"] == 50.0 and srch["HotpotQA"] == 25.0 and srch["kb_onehop"] == 100.0
    assert srch["Avg"] == pytest.approx((50 + 25 + 100) / 3)
    md = format_table("alfworld", alf, row="step_000003")
    assert md.splitlines()[0] == "| Method | Pick | Look | Clean | Heat | Cool | Pick2 | All |"
    assert "| step_000003 | 50.0 | – |" in md


@pytest.mark.slow
def test_profile_and_eval_end_to_end(tmp_path, capsys):
    """`alignopsd profile` (GRPO and AlignOPSD side by side, JSON, trace) and `alignopsd eval` on a checkpoint."""
    sets = ["--set", f"output_dir={tmp_path}", "--set", "env.max_turns=1", "--set", "generation.max_response_length=8",
            "--set", "env.teacher_max_response_length=8", "--set", "env.val_tasks=2",
            "--set", "algorithm.kl_coef=0.0"]  # fmt: skip
    js = tmp_path / "prof.json"
    rc = cli.main(["profile", "--config", TINY, *sets, "--steps", "1", "--estimators", "grpo,alignopsd",
                   "--json", str(js)])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "alignment overhead vs GRPO" in out and "teacher generation *" in out
    data = json.loads(js.read_text())
    assert set(data) == {"grpo", "alignopsd (ablation E)"}
    g, a = data["grpo"], data["alignopsd (ablation E)"]
    assert g["alignment_seconds"] == 0 and a["alignment_seconds"] > 0
    assert a["phases"]["teacher_generation"] > 0 and a["phases"]["encoding"] > 0
    c = a["counts"]  # G=4 siblings share their prompt, the teacher prompts their privileged block
    assert 0 < c["rollout/prefill_token_forwards"] < c["rollout/prefill_token_forwards_unshared"]
    assert 0 < c["m1/teacher_prefill_token_forwards"] < c["m1/teacher_prefill_token_forwards_unshared"]
    assert "m1/teacher_prefill_token_forwards" not in g["counts"]
    rows_positions = c["batch/turns"] * (c["rollout/prompt_length_mean"] + c["rollout/response_length_mean"])
    assert 0 < c["actor/old_logprob_token_forwards"] < rows_positions  # siblings' prompt pushed once
    assert 0 <= c["actor/padding_fraction"] < 1 and 0 <= c["actor/padding_fraction_old_logprob"] < 1
    assert a["overhead_vs_grpo"] == pytest.approx(a["alignment_seconds"] / (a["step_seconds"] - a["alignment_seconds"]))
    trace = tmp_path / "profile" / "trace_alignopsd.json"
    assert trace.is_file() and "phase/teacher_generation" in trace.read_text()
    # eval of a checkpoint in the trainer's layout (the tiny model's weights)
    from alignopsd.engine.checkpoint.checkpoint import save_checkpoint
    from alignopsd.engine.models.loading import build_tiny_model

    model = build_tiny_model()
    ck = save_checkpoint(tmp_path / "checkpoints", 1, model_state=model.state_dict(), optimizer_state=None,
                         hf_config=model.config)  # fmt: skip
    ej = tmp_path / "eval.json"
    assert cli.main(["eval", "--config", TINY, *sets, "--checkpoint", str(ck), "--json", str(ej)]) == 0
    out = capsys.readouterr().out
    assert "| Method | Success | codeword |" in out
    res = json.loads(ej.read_text())
    assert res["episodes"] == 2 and res["table"]["Success"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize(
    "env,columns",
    [
        ("alfworld", ["Pick", "Look", "Clean", "Heat", "Cool", "Pick2", "All"]),
        ("webshop", ["Score", "Acc"]),
        ("search", ["NQ", "TriviaQA", "PopQA", "HotpotQA", "2Wiki", "Musique", "Bamboogle", "Avg"]),
    ],
)
def test_eval_on_each_benchmark_environment(tmp_path, capsys, env, columns):
    """`alignopsd eval` plays the held-out split of ALFWorld, WebShop and Search-QA and prints Table 1's columns."""
    sets = ["--set", f"env.name={env}", "--set", f"output_dir={tmp_path}", "--set", "env.max_turns=1",
            "--set", "generation.max_response_length=8", "--set", "env.teacher_max_response_length=8",
            "--set", "env.val_tasks=2"]  # fmt: skip
    ej = tmp_path / "eval.json"
    assert cli.main(["eval", "--config", TINY, *sets, "--json", str(ej)]) == 0
    out = capsys.readouterr().out
    assert "| Method | " + " | ".join(columns) + " |" in out
    res = json.loads(ej.read_text())
    assert res["env"] == env and res["episodes"] == 2 and list(res["table"]) == columns
    assert res["metrics"]["episode/count"] == 2


def test_profile_refuses_a_warmup_that_leaves_no_measured_step(capsys):
    assert cli.main(["profile", "--config", TINY, "--steps", "2", "--warmup", "1"]) == 2
    assert "--warmup: 1 leaves no measured step of --steps 2 (the last, traced, step" in capsys.readouterr().err
    assert cli.main(["profile", "--config", TINY, "--steps", "1", "--warmup", "1", "--no-trace"]) == 2
