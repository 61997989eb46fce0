"""Run configuration: strict loading, --set overrides, validation before anything loads (incl. §6 case 48)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from alignopsd.engine.config.dump import config_to_dict, dump_config
from alignopsd.engine.config.schema import ConfigError, RunConfig, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PAPER = ["alfworld_3b", "alfworld_7b", "webshop_3b", "webshop_7b", "search_3b", "search_7b"]


def _write(tmp_path, data, name="run.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def test_every_shipped_config_loads():
    names = sorted(p.stem for p in CONFIGS.glob("*.yaml"))
    assert {"tiny", "quickstart_cpu", *PAPER} <= set(names)
    for n in names:
        cfg = load_config(CONFIGS / f"{n}.yaml")
        assert cfg.name == n and cfg.out_dir == Path("runs") / n


@pytest.mark.parametrize("name", PAPER)
def test_paper_profiles_match_section5(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    a, env, tr = cfg.algorithm, cfg.env, cfg.trainer
    assert cfg.model.name.startswith("Qwen/Qwen2.5-") and cfg.encoder.name == "Qwen/Qwen3-Embedding-0.6B"
    assert env.group_n == 8 and tr.total_steps == 150 and tr.optimizer.lr == 1e-6 and cfg.generation.backend == "vllm"
    assert a.estimator == "alignopsd" and a.ablation == "E"
    paper_tp = {"alfworld_3b": 2, "alfworld_7b": 2, "webshop_3b": 2, "webshop_7b": 4, "search_3b": 1, "search_7b": 1}
    assert cfg.policy.backend == "megatron" and cfg.policy.tensor_parallel_size == paper_tp[name]
    table = {  # gamma, K, alpha_max, mode, scope, kl, penalty, tasks, mini, micro, max_turns, history, prompt
        "alfworld_3b": (0.65, 2, 0.8, "probability_mixture", "turn", 0.01, 0.1, 16, 256, 16, 50, 2, 2048),
        "alfworld_7b": (0.80, 3, 0.8, "probability_mixture", "turn", 0.01, 0.1, 16, 256, 32, 50, 2, 2048),
        "webshop_3b": (0.80, 3, 0.8, "probability_mixture", "turn", 0.01, 0.1, 16, 64, 8, 15, 2, 4096),
        "webshop_7b": (0.80, 2, 0.8, "probability_mixture", "turn", 0.01, 0.1, 16, 64, 8, 15, 2, 4096),
        "search_3b": (0.70, 3, 0.2, "log_mean", "trajectory", 0.001, 0.01, 128, 256, 4, 4, 4, 4096),
        "search_7b": (0.70, 3, 0.8, "probability_mixture", "turn", 0.001, 0.01, 128, 256, 16, 4, 4, 4096),
    }[name]
    got = (a.rectify.gamma, a.rectify.top_k, a.rectify.alpha_max, a.rectify.mode, a.grpo_scope, a.kl_coef,
           a.invalid_penalty, env.tasks_per_step, tr.ppo.mini_batch_size, tr.ppo.micro_batch_size, env.max_turns,
           env.history_length, env.max_prompt_length)  # fmt: skip
    assert got == table
    assert a.sdar.enabled == (name == "alfworld_3b")
    assert a.rectify.action_filter == (name in ("alfworld_3b", "webshop_3b"))
    assert cfg.teacher_budget == (512 if name == "search_3b" else 2048)
    # validation (§5): ALFWorld/WebShop sample at 0.4 and validate before training; Search decodes greedily,
    # no pre-training validation, Search-3B every 5 steps from step 70, Search-7B at 150
    search = name.startswith("search")
    assert cfg.generation.val_do_sample == (not search) and cfg.generation.val_temperature == 0.4
    assert tr.validation.before_train == (not search)
    val = tr.validation
    assert (val.freq, val.start_step) == {"search_3b": (5, 70), "search_7b": (150, 0)}.get(name, (val.freq, 0))
    from alignopsd.engine.step.episodes import sampling_params as _sampling

    assert _sampling(cfg, validation=True).do_sample == (not search) and _sampling(cfg, validation=False).do_sample


def test_overrides_and_round_trip(tmp_path):
    cfg = load_config(CONFIGS / "tiny.yaml", ["algorithm.estimator=grpo", "trainer.optimizer.lr=0.5", "env.group_n=3"])
    assert cfg.algorithm.estimator == "grpo" and cfg.trainer.optimizer.lr == 0.5 and cfg.env.group_n == 3
    again = load_config(_write(tmp_path, yaml.safe_load(dump_config(cfg))))
    assert config_to_dict(again) == config_to_dict(cfg)
    cfg2 = load_config(CONFIGS / "tiny.yaml", ["algorithm.preset=search_3b"])
    r = cfg2.algorithm.rectify
    assert r.mode == "log_mean" and r.alpha_max == 0.2 and cfg2.algorithm.grpo_scope == "trajectory"
    assert r.gamma == 0.3 and cfg2.algorithm.kl_coef == 0.01  # keys written in the file win over the preset


@pytest.mark.parametrize(
    "override, key, allowed",
    [
        (["trainer.nope=1"], "trainer.nope", "total_steps"),
        (["bogus=1"], "bogus", "algorithm"),
        (["policy.backend=deepspeed"], "policy.backend", "'megatron'"),
        (["generation.backend=tgi"], "generation.backend", "'vllm'"),
        (["env.name=atari"], "env.name", "'alfworld'"),
        (["trainer.rescoring_mode=fast"], "trainer.rescoring_mode", "'plain'"),
        (["algorithm.estimator=ppo"], "estimator", "'grpo'"),
        (["algorithm.ablation=F"], "ablation", "'E'"),
        (["algorithm.rectify.gama=0.5"], "algorithm.rectify.gama", "top_k"),
        (["algorithm.preset=alfworld_1b"], "algorithm.preset", "'alfworld_7b'"),
        (["trainer.optimizer.lr=abc"], "trainer.optimizer.lr", "number"),
        (["trainer.total_steps=1.5"], "trainer.total_steps", "integer"),
        (["trainer.ppo.epochs=2"], "trainer.ppo.epochs", "1"),
        (["policy.tensor_parallel_size=2"], "policy.tensor_parallel_size", "megatron"),
        (["generation.teacher_do_sample=false"], "generation.teacher_do_sample", "do_sample"),
        (["env.group_n=1"], "env.group_n", ">= 2"),
        (["trainer.ppo.micro_batch_size=128"], "trainer.ppo.micro_batch_size", "mini"),
        (["trainer"], "trainer", "key=value"),
        (["trainer.optimizer.lr.x=1"], "trainer.optimizer.lr", "not a section"),
    ],
)
def test_bad_keys_and_values_are_named(override, key, allowed):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "tiny.yaml", override)
    msg = str(err.value)
    assert key in msg and allowed in msg, msg


def test_case48_config_consistency():
    """§6 case 48: mechanism2 must match the consumer; token-mean aggregation; SDAR coef >= 0 and beta > 0."""
    ok = load_config(CONFIGS / "tiny.yaml", ["algorithm.mechanism2_enabled=true"])
    assert ok.algorithm.mechanism2_enabled
    bad = [
        (["algorithm.mechanism2_enabled=false"], "mechanism2_enabled"),
        (["algorithm.estimator=alignopsd_m1", "algorithm.mechanism2_enabled=true"], "mechanism2_enabled"),
        (["algorithm.loss_agg_mode=seq-mean-token-sum"], "loss_agg_mode"),
        (["algorithm.sdar.coef=-0.01"], "coef"),
        (["algorithm.sdar.beta=0"], "beta"),
        (["algorithm.credit.gamma=0.9"], "credit.gamma"),
    ]
    for ov, key in bad:
        with pytest.raises(ConfigError, match=key):
            load_config(CONFIGS / "tiny.yaml", ov)


def test_vllm_length_budget_checked(tmp_path):
    with pytest.raises(ConfigError, match="max_model_len"):
        load_config(CONFIGS / "alfworld_7b.yaml", ["generation.max_model_len=3000"])


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="--config"):
        load_config(tmp_path / "missing.yaml")
    p = tmp_path / "list.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(p)


def test_cli_rejects_before_loading_anything(tmp_path, capsys):
    """A bad key fails in the CLI with exit code 2 before transformers/torch models are imported."""
    import subprocess

    code = (
        "import sys\n"
        "from alignopsd.engine.commands.train import main\n"
        "rc = main(['--config', sys.argv[1], '--set', 'trainer.bogus=1'])\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
        "sys.exit(rc)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(CONFIGS / "tiny.yaml")], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert "trainer.bogus: unknown key" in r.stderr


def test_defaults_are_valid():
    cfg = RunConfig().validate()
    assert cfg.algorithm.estimator == "alignopsd" and cfg.teacher_budget == 2048


def test_dumped_config_reloads_with_overrides(tmp_path):
    from alignopsd.engine.config.dump import dump_config

    cfg = load_config(CONFIGS / "quickstart_cpu.yaml")
    path = tmp_path / "dumped.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path).algorithm == cfg.algorithm
    again = load_config(path, ["algorithm.rectify.gamma=0.77"])
    assert again.algorithm.rectify.gamma == 0.77 and again.algorithm.credit.gamma == 0.77


@pytest.mark.parametrize(
    "override",
    [
        "trainer.optimizer.lr=.nan",
        "trainer.optimizer.lr=.inf",
        "generation.temperature=.inf",
        "generation.val_temperature=.nan",
        "trainer.optimizer.grad_clip=.nan",
        "trainer.optimizer.weight_decay=.nan",
        "trainer.optimizer.warmup_ratio=.nan",
        "env.step_timeout_s=.inf",
        "generation.top_p=.nan",
        "trainer.optimizer.betas=[0.9, .nan]",
        "env.options={scale: -.inf}",
    ],
)
def test_non_finite_values_are_rejected(override):
    import re

    key = re.escape(override.split("=")[0])
    with pytest.raises(ConfigError, match=rf"^{key}.*(finite|must be in)"):
        load_config(CONFIGS / "tiny.yaml", [override])


@pytest.mark.parametrize("seed", ["-1", "4294967296", "99999999999999999999999", "true"])
def test_seed_range(seed):
    with pytest.raises(ConfigError, match="trainer.seed"):
        load_config(CONFIGS / "tiny.yaml", [f"trainer.seed={seed}"])
    assert load_config(CONFIGS / "tiny.yaml", ["trainer.seed=4294967295"]).trainer.seed == 2**32 - 1


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("trainer:\n  lr: [1\n", r"run\.yaml:3:1: YAML syntax error"),
        ("trainer:\n\tlr: 1\n", r"run\.yaml:2:1: YAML syntax error.*tabs"),
        ("trainer: !!python/object/apply:os.system [echo hi]\n", r"run\.yaml:1:10: YAML tag refused"),
        ("", r"run\.yaml: the file is empty"),
        ("# only a comment\n", "the file is empty"),
    ],
)
def test_yaml_errors_are_one_clear_message(tmp_path, text, match):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(p)


def test_non_utf8_file(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_bytes(b"name: x\ntrainer:\n  lr: 1e-4 # \xe9t\xe9\n")
    with pytest.raises(ConfigError, match=r"run\.yaml:3: not UTF-8 text \(byte 0xe9"):
        load_config(p)


def test_student_skills_baselines():
    """Skill-Prompt (validation) and Skill-GRPO (always, with an estimator without a teacher pass) load; 'always'
    with a teacher estimator is refused (the privileged view would be the student's own)."""
    from alignopsd.engine.config.schema import ConfigError, load_config

    tiny = CONFIGS / "tiny.yaml"
    assert load_config(tiny, ["env.student_skills=validation"]).env.student_skills == "validation"
    assert load_config(tiny, ["env.student_skills=always", "algorithm.estimator=grpo"]).env.student_skills == "always"
    with pytest.raises(ConfigError, match="env.student_skills"):
        load_config(tiny, ["env.student_skills=always", "algorithm.estimator=alignopsd"])
    with pytest.raises(ConfigError, match="env.student_skills"):
        load_config(tiny, ["env.student_skills=sometimes"])


def test_a_bare_yaml_off_is_the_quantize_setting_off(tmp_path):
    """YAML 1.1 reads `quantize: off` as false; the setting still means off, and a bool True is refused."""
    src = (CONFIGS / "tiny.yaml").read_text()
    p = tmp_path / "c.yaml"
    p.write_text(src.replace("generation:\n", "generation:\n  quantize: off\n", 1))
    assert load_config(p).generation.quantize == "off"
    p.write_text(src.replace("generation:\n", "generation:\n  quantize: on\n", 1))
    with pytest.raises(ConfigError, match="generation.quantize"):
        load_config(p)
