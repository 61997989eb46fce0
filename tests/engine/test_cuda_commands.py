"""Every command on CUDA, without a GPU: the strict fake-CUDA mode (tests/engine/fake_cuda.py) with
``trainer.device=cuda``.

Two training steps of every registered estimator and AlignOPSD ablation (tiny config, candidate-choice sampler), both
rescoring modes, the fused head loss on and off, rollout correction on and the reference KL on; then ``eval``,
``sft``, ``profile`` and ``compare`` for one step each. Under the mode a CPU tensor of one or more dimensions beside
a CUDA tensor raises as on a GPU, and strict mode (tests/conftest.py) makes every keep-alive diagnostic raise, so a
step that completes met no device mismatch anywhere; every step also asserts ``regions/errors == 0``. The engine
takes the kernel branches a GPU takes, their launches served on the host (tests/engine/fake_cuda.py); one
AlignOPSD step trains with the Hugging Face sampler.

Cost: one trainer (model, tokenizer, encoder, reference) is built once and shared by the training cases, each of
which gets its own config, estimator and rescorer (the parts a config change touches), on the smallest batch that
exercises every phase (2 tasks x 2 siblings, one turn).
"""

from __future__ import annotations

import dataclasses
import json

import learn_helpers as lh
import pytest
import torch
from alignopsd.engine.commands import cli
from alignopsd.engine.config.schema import load_config
from alignopsd.engine.observe.profiler import StepProfiler
from alignopsd.engine.run.policy_builders import hf_model_of
from alignopsd.engine.step.rescoring import Rescorer
from fake_cuda import FakeCuda

from alignopsd.estimators import ESTIMATORS, get_estimator

pytestmark = pytest.mark.slow

TINY = str(lh.TINY_CONFIG)
SMALL = ["env.group_n=2", "env.tasks_per_step=2", "env.max_turns=1", "trainer.ppo.mini_batch_size=8",
         "trainer.ppo.micro_batch_size=4", "trainer.ppo.skip_no_signal=false", "trainer.device=cuda"]  # fmt: skip
CASES = [
    *lh.ESTIMATOR_CASES,  # every registered estimator, ablations A-E, reference KL + SDAR
    ("alignopsd_plain_rescoring", ["algorithm.estimator=alignopsd", "trainer.rescoring_mode=plain"]),
    ("alignopsd_autograd_head", ["algorithm.estimator=alignopsd", "trainer.ppo.fused_head_loss=false"]),
    ("grpo_rollout_is", ["algorithm.estimator=grpo", "trainer.ppo.rollout_is=token_truncate"]),
    ("alignopsd_m1_rollout_is_seq", ["algorithm.estimator=alignopsd_m1", "trainer.ppo.rollout_is=sequence_mask"]),
]


@pytest.fixture(scope="module")
def fake():
    with FakeCuda() as fc:
        yield fc


@pytest.fixture(scope="module")
def trainer(fake, tmp_path_factory):
    """One tiny trainer on the fake cuda:0 with every part a case may use (encoder, teacher, reference)."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("cuda_run")
    tr = lh.build_trainer(TINY, [*lh.GUESS_OVERRIDES, *SMALL, "algorithm.kl_coef=0.01", f"output_dir={out}"])
    assert tr.parts.device == torch.device("cuda", 0)
    assert all(p.is_cuda for p in tr.parts.policy.model.parameters())
    assert all(p.is_cuda for p in tr.parts.ref_scorer.model.parameters())
    yield tr
    tr.parts.close()


def test_the_cases_cover_every_registered_estimator():
    names = {o.split("=")[1] for _, ov in CASES for o in ov if o.startswith("algorithm.estimator=")}
    assert names == set(ESTIMATORS)


@pytest.mark.parametrize("case", [c for c, _ in CASES])
def test_two_training_steps_on_cuda(case, trainer, fake, tmp_path):
    from alignopsd.engine.step.recipe import run_step

    cfg = load_config(TINY, [*lh.GUESS_OVERRIDES, *SMALL, *dict(CASES)[case], f"output_dir={tmp_path}"])
    base = trainer.parts
    parts = dataclasses.replace(
        base,
        cfg=cfg,
        estimator=get_estimator(cfg.algorithm.estimator),
        rescorer=Rescorer(hf_model_of(base.policy), mode=cfg.trainer.rescoring_mode,
                          temperature=cfg.generation.temperature, reuse_rollout_logp=cfg.trainer.ppo.logprob_reuse),
        profiler=StepProfiler(),
    )  # fmt: skip
    for step in range(2):
        m = run_step(parts, step).metrics
        assert m.get("regions/errors", 0.0) == 0.0 and m.get("audit/error_count", 0.0) == 0.0
        assert m["update/optimizer_steps"] >= 1 and m["update/skipped"] == 0.0
        assert torch.isfinite(torch.tensor(m["actor/loss"]))
        assert m["update/fused_head_loss"] == (0.0 if "autograd_head" in case else 1.0)
        if parts.estimator.alignment:  # the paired diagnostics (§4.3) are there, on the device
            assert m["paired/response/token_count"] > 0
        if cfg.trainer.ppo.rollout_is != "off":
            assert any(k.startswith("rollout_is/") for k in m) and "rollout_is/unavailable" not in m
        if cfg.algorithm.kl_coef > 0:
            assert "actor/kl_loss" in m
    assert all(p.is_cuda for p in base.policy.model.parameters())


def _cmd(fake, argv: list[str]) -> int:
    """Run a command; the host syncs it made on the fake device (so it did run there)."""
    before = fake.total_syncs()
    assert cli.main(argv) == 0
    return fake.total_syncs() - before


SETS = [x for s in [*SMALL, "env.val_tasks=2", "generation.max_response_length=8",
                    "env.teacher_max_response_length=8", "algorithm.kl_coef=0.01"] for x in ("--set", s)]  # fmt: skip


def test_eval_on_cuda(fake, tmp_path, capsys):
    ej = tmp_path / "eval.json"
    assert _cmd(fake, ["eval", "--config", TINY, *SETS, "--set", f"output_dir={tmp_path}", "--json", str(ej)]) > 0
    assert json.loads(ej.read_text())["episodes"] == 2


def test_profile_on_cuda_reports_host_syncs(fake, tmp_path, capsys):
    js = tmp_path / "prof.json"
    argv = ["profile", "--config", TINY, *SETS, "--set", f"output_dir={tmp_path}", "--steps", "1",
            "--estimators", "alignopsd", "--json", str(js), "--no-trace"]  # fmt: skip
    assert _cmd(fake, argv) > 0
    out = capsys.readouterr().out
    assert "host syncs" in out
    data = json.loads(js.read_text())
    assert data["host_syncs"]["update"] > 0 and data["host_syncs_total"] == sum(data["host_syncs"].values())


def test_compare_on_cuda(fake, tmp_path):
    out = tmp_path / "cmp"
    argv = ["compare", "--config", TINY, *SETS, "--estimators", "alignopsd", "--seeds", "1", "--steps", "1",
            "--eval-every", "0", "--out", str(out), "--set", "trainer.logging.audit=false"]  # fmt: skip
    assert _cmd(fake, argv) > 0
    assert json.loads((out / "compare.json").read_text())["seeds"] == [0]


def test_sft_on_cuda(fake, tmp_path):
    from alignopsd.engine.envs.alfworld.gen import generate_games

    games = tmp_path / "games"
    for split, seed in (("train", 5), ("valid_unseen", 6)):
        generate_games(2, games, seed=seed, split=split, task_types=("pick_and_place_simple",), max_steps=8,
                       small=True)  # fmt: skip
    argv = ["sft", "--config", TINY, "--set", "env.name=alfworld", "--set", f"env.data_dir={games}",
            "--set", "env.num_games=2", "--set", "env.val_tasks=2", "--set", "env.max_turns=8",
            "--set", "trainer.device=cuda",
            "--set", f"output_dir={tmp_path}", "--steps", "1", "--batch-size", "2"]  # fmt: skip
    assert _cmd(fake, argv) > 0  # the loss of the step was read from the device: the model trained there
    assert (tmp_path / "sft").is_dir()


# the loss through the fused log-prob kernel (forward and backward): the fused head loss has no Triton kernel
HF_GEN = ["generation.backend=hf", "generation.max_response_length=6", "env.teacher_max_response_length=6",
          "trainer.ppo.fused_head_loss=false"]  # fmt: skip


def test_training_with_the_hugging_face_generator_and_the_kernels_on_cuda(trainer, fake, tmp_path):
    """AlignOPSD trained with the Hugging Face sampler on the fake device: the teacher seeded on a CUDA generator,
    sibling prompts pushed once (prefix sharing), the teacher pass, and the kernel branches a GPU takes (the fused
    sibling top-K in the pair selection, the fused log-prob in scoring and in the loss with the autograd head),
    their launches served on the host. On CUDA the generator keeps no prompt cache (the shared-prefix decoding
    cache is CPU-only), so the teacher forcing scores the prompts again, as a real GPU run does."""
    from alignopsd.engine.generation.hf import HFGenerator
    from alignopsd.engine.step.recipe import run_step

    cfg = load_config(TINY, [*lh.GUESS_OVERRIDES, *SMALL, *HF_GEN, f"output_dir={tmp_path}"])
    base = trainer.parts
    gen = HFGenerator(hf_model_of(base.policy), base.tokenizer)
    assert not gen.keeps_prompt_cache
    parts = dataclasses.replace(
        base, cfg=cfg, generator=gen, estimator=get_estimator("alignopsd"), profiler=StepProfiler(),
        rescorer=Rescorer(hf_model_of(base.policy), temperature=cfg.generation.temperature),
    )  # fmt: skip
    launches = fake.launches.copy()
    m = run_step(parts, 0).metrics
    assert m.get("regions/errors", 0.0) == 0.0 and m["update/optimizer_steps"] >= 1
    assert gen.tokens_generated > 0 and m["rollout/response_length_mean"] > 0
    assert m["rollout/prefill_token_forwards"] < m["rollout/prefill_token_forwards_unshared"]  # siblings shared
    assert m["m1/teacher_forcing_row_count"] > 0 and m["m1/teacher_forcing_cached_prompts"] == 0.0
    ran = fake.launches - launches
    assert ran["_lp_fwd_kernel"] > 0 and ran["_lp_bwd_kernel"] > 0, ran  # scoring and the loss's backward
    assert ran["_sibling_kernel"] > 0, ran  # the pair selection's fused sibling top-K
