"""Helpers for the learning / resume / golden tests: a learnable two-turn task and a candidate-choice generator.

``GuessEnv``: two turns; each turn the admissible actions are ``left`` and ``right``; the episode is won
(reward 10) when the second action repeats the first one and both are ``right``. A uniformly random policy
wins 1 in 4 episodes; the turn-level pattern is learnable by a tiny model in a few updates.

``ChoiceGenerator``: a generation backend for random-weight models that cannot yet write the tag format. For
each prompt it scores a fixed list of candidate responses (``<think>...</think><action>...</action>`` plus EOS)
under the policy and samples one with probability proportional to exp(log p(candidate) / temperature). The
sampled tokens are a real sample of the policy restricted to the candidate set, so PPO on them moves exactly
the probabilities this generator samples from.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from alignopsd.engine.envs.base import StepResult, TaskSpec
from alignopsd.engine.envs.prompts import PromptBuilder
from alignopsd.engine.generation.base import GenerationOutput, SamplingParams
from alignopsd.engine.generation.hf import HFGenerator

ACTIONS = ("left", "right")


def load_tasks(split: str = "train", n: int | None = None, seed: int = 0, **_: Any) -> list[TaskSpec]:
    n = 8 if not n or n <= 0 else int(n)
    return [TaskSpec(key=f"guess-{split}-{i}", env="guess", category=("even" if i % 2 == 0 else "odd"))
            for i in range(n)]  # fmt: skip


class GuessEnv:
    name = "guess"
    max_steps = 2

    def __init__(self, **_: Any) -> None:
        self.t = 0
        self.first = ""

    def _info(self, won=False):
        return {"won": won, "admissible_actions": list(ACTIONS), "task": "go right twice."}

    def reset(self, task: TaskSpec, seed: int):
        self.t, self.first = 0, ""
        return "You stand at a fork.", self._info()

    def step(self, action: str) -> StepResult:
        self.t += 1
        if self.t == 1:
            self.first = action
            return StepResult(f"You went {action or 'nowhere'}.", 0.0, False, self._info())
        won = self.first == "right" and action == "right"
        return StepResult("The end.", 10.0 if won else 0.0, True, self._info(won))


def guess_prompt(history_length: int = 1) -> PromptBuilder:
    return PromptBuilder(
        "Task: {task_description}\nObservation: {current_observation}\nActions: [{admissible_actions}].\n",
        "Task: {task_description}\n{action_history}\n"
        "Observation: {current_observation}\nActions: [{admissible_actions}].\n",
        history_length,
        history_item="Step {index}: {action}",
        action_sep=", ",
    )


def register_guess_env() -> None:
    from alignopsd.engine.envs import registry

    if "guess" not in registry.env_names():
        registry.register_env(
            registry.EnvEntry(
                "guess",
                f"{__name__}:GuessEnv",
                f"{__name__}:load_tasks",
                f"{__name__}:guess_prompt",
                lowercase_actions=True,
                history_length=1,
            )
        )


_ACTIONS_RE = re.compile(r"(?:Admissible actions|Actions): \[(.*?)\]")


def candidate_texts(prompt_text: str) -> list[str]:
    """Two responses per admissible action listed in the prompt (the last 'Actions: [...]' list)."""
    found = _ACTIONS_RE.findall(prompt_text)
    actions = [a.strip().strip("'\"") for a in found[-1].split(",") if a.strip()] if found else list(ACTIONS)
    out = []
    for a in actions:
        for t in (f"i will {a}", f"{a} looks good"):
            out.append(f"<think>{t}</think><action>{a}</action>")
    return out


class ChoiceGenerator:
    """Samples one of the candidate responses of each prompt, ∝ exp(log p / temperature) under the policy."""

    def __init__(self, model, tokenizer) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = {tokenizer.eos_token_id}

    # the Hugging Face backend's weight push into ``model`` (a no-op for the trainer's own tensors)
    load_weights = HFGenerator.load_weights

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        from alignopsd.engine import devices
        from alignopsd.engine.policy.hf import score_rows
        from alignopsd.engine.rollout import left_pad, right_pad

        tok = self.tokenizer
        eos = tok.eos_token_id
        cands = [candidate_texts(tok.decode(p, skip_special_tokens=False)) for p in prompts]
        rows_p, rows_c, owner = [], [], []
        for i, (p, cs) in enumerate(zip(prompts, cands)):
            for text in cs:
                rows_p.append(p)
                rows_c.append(tok(text, add_special_tokens=False)["input_ids"] + [eos])
                owner.append(i)
        p_ids, p_mask = left_pad(rows_p, max(len(p) for p in rows_p), eos)
        c_ids, c_mask = right_pad(rows_c, max(len(c) for c in rows_c), 0)
        was = self.model.training
        self.model.eval()
        dev = devices.module_device(self.model)
        moved = [devices.to_device(t, dev) for t in (p_ids, p_mask, c_ids, c_mask)]
        lp, _, _ = score_rows(self.model, *moved, temperature=sampling.temperature)
        lp = lp.cpu()  # the generation backend hands host lists back
        self.model.train(was)
        seq = (lp * c_mask).sum(1)
        gen = torch.Generator().manual_seed(int(sampling.seed or 0))
        out = GenerationOutput(token_ids=[], texts=[], logprobs=[], finish_reasons=[])
        start = 0
        for cs in cands:
            k = len(cs)
            j = int(torch.multinomial(torch.softmax(seq[start : start + k], 0), 1, generator=gen))
            r = start + j
            n = len(rows_c[r])
            out.token_ids.append(list(rows_c[r]))
            out.texts.append(cs[j])
            out.logprobs.append(lp[r, :n].tolist())
            out.finish_reasons.append("stop")
            start += k
        return out


def build_trainer(config: str, overrides: list[str]):
    """A Trainer whose generator is the ChoiceGenerator on the trainer's own model (guess env registered)."""
    from alignopsd.engine.config import load_config
    from alignopsd.engine.train import Trainer

    register_guess_env()
    tr = Trainer(load_config(config, overrides))
    tr.parts.generator = ChoiceGenerator(tr.parts.policy.model, tr.parts.tokenizer)
    return tr


def main(argv: list[str]) -> None:
    """``python -c 'import learn_helpers as h; h.main(sys.argv[1:])' CONFIG [--resume auto] [--set k=v ...]``."""
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("--resume", default=None)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    build_trainer(args.config, args.overrides).fit(resume=args.resume)


# ---------------------------------------------------------------------------------------------------------------------
# the per-estimator step fixture shared by the golden traces and the estimator/device tests

GUESS_OVERRIDES = [
    "env.name=guess",
    "env.max_turns=2",
    "env.history_length=1",
    "env.group_n=4",
    "env.tasks_per_step=4",
    "env.num_games=8",
    "algorithm.kl_coef=0.0",
    "trainer.lr=1e-4",
    "trainer.ppo_mini_batch_size=16",
    "trainer.ppo_micro_batch_size=8",
]

# every estimator of the registry and every AlignOPSD ablation: (case name, overrides)
ESTIMATOR_CASES: list[tuple[str, list[str]]] = [
    ("grpo", ["algorithm.estimator=grpo"]),
    ("opsd", ["algorithm.estimator=opsd"]),
    ("grpo_opsd", ["algorithm.estimator=grpo_opsd"]),
    ("sdar", ["algorithm.estimator=sdar"]),
    ("rlsd", ["algorithm.estimator=rlsd"]),
    ("alignopsd_m1", ["algorithm.estimator=alignopsd_m1"]),
    *[(f"alignopsd_{ab}", ["algorithm.estimator=alignopsd", f"algorithm.ablation={ab}"]) for ab in "ABCDE"],
    ("alignopsd_E_kl_sdar", ["algorithm.estimator=alignopsd", "algorithm.kl_coef=0.01", "algorithm.sdar.enabled=true"]),
]


TINY_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def no_region_errors(metrics: dict) -> bool:
    """A step's metrics report no failed region diagnostic (strict mode raises instead; this catches a count)."""
    return metrics.get("regions/errors", 0.0) == 0.0


def run_tiny(out_dir, overrides: list[str], steps: int, config: str | None = None):
    """Train tiny.yaml (guess env, choice generator) for ``steps`` steps; (trainer, metric records)."""
    from pathlib import Path

    from alignopsd.engine.metrics import read_metrics

    torch.set_num_threads(1)
    cfg = config or str(TINY_CONFIG)
    ov = [*GUESS_OVERRIDES, *overrides, f"trainer.total_steps={steps}", f"output_dir={out_dir}"]
    tr = build_trainer(cfg, ov)
    tr.fit()
    recs = read_metrics(Path(out_dir) / "metrics.jsonl")
    assert all(no_region_errors(r) for r in recs)
    return tr, recs


GOLDEN_KEYS = (
    "actor/loss",
    "actor/pg_loss",
    "episode/reward_mean",
    "actor/grad_norm",
    "adv/token_advantage_abs_mean",
)


def trace_of(recs) -> list[dict]:
    """The golden-trace fields of each step's metric record (missing keys are left out)."""
    return [{"step": r["step"], **{k: r[k] for k in GOLDEN_KEYS if k in r}} for r in recs]
