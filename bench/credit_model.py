"""The credit benchmark's policy model: the engine's tiny random Llama with a vocabulary of the environments' words.

The engine's ``tiny`` model carries the SmolLM2 vocabulary (49,152 entries): its output layer is >90 % of a
training step's CPU time on the short texts of the credit environments. :func:`ensure_model` writes a local
Hugging Face-layout directory (which ``model.name`` accepts like any local model) with

* a byte-level BPE tokenizer trained on the text the ``credit`` environments, their prompts, the
  candidate-choice backend's responses and the skill bank produce (:func:`corpus`), so every word of that text is
  one token and the vocabulary has a few hundred entries; byte-level, so any text still encodes and decodes
  exactly (the engine's thinking/action region offsets need the exact round trip); ChatML chat template;
* a random Llama of the engine's tiny shape (``tiny_config``: 2 layers, hidden 64) sized to that vocabulary,
  initialised from a fixed seed, so every run of the benchmark starts from the same weights.

Every admissible action of a turn has the same number of words, so every candidate response of a turn has the
same number of tokens (tested), and the random initial policy does not favour the shortest option.
"""

from __future__ import annotations

import random
from pathlib import Path

MODEL_SEED = 0
# Llama's usual initialisation (the engine's tiny model uses 0.2, far from uniform): the random initial policy is
# close to uniform over a turn's candidates, so learning starts from chance
INIT_RANGE = 0.02
VOCAB_LIMIT = 2048  # an upper bound: the corpus runs out of merges first
TEACHER_HEADER = "[Privileged Skill Information]"  # ALGORITHM.md §1.4


def _skill_texts() -> list[str]:
    from alignopsd.engine.envs.credit import env as credit

    bank = Path(credit.__file__).resolve().parent / "skills"
    return [p.read_text() for p in sorted(bank.glob("*.md"))]


def corpus(episodes_per_kind: int = 8) -> list[str]:
    """Text the benchmark's runs produce: every prompt of a few random-action episodes of each kind (the user
    message of every turn), every candidate response of every turn, the skill texts and the teacher header."""
    from alignopsd.engine.envs.credit import env as credit
    from alignopsd.engine.envs.prompts import PromptContext
    from alignopsd.engine.generation.choice import candidate_texts

    builder = credit.credit_prompt()
    rng = random.Random(MODEL_SEED)
    lines = [TEACHER_HEADER, *_skill_texts()]
    for i in range(episodes_per_kind * len(credit.KINDS)):
        task = credit.load_tasks("corpus", n=i + 1)[i]
        env = credit.CreditEnv()
        obs, info = env.reset(task, 0)
        history: list[tuple[str, str]] = []
        done = False
        while not done:
            text = builder.render(PromptContext(info["task"], obs, info["admissible_actions"], history, info))
            lines += [text, *candidate_texts(text)]
            action = rng.choice(info["admissible_actions"])
            res = env.step(action)
            history.append((obs, action))
            obs, info, done = res.observation, res.info, res.done
    return lines


def build_tokenizer():
    """The engine's byte-level BPE tokenizer (ChatML template) trained on :func:`corpus` (deterministic)."""
    from alignopsd.engine.models.loading import build_bpe_tokenizer

    return build_bpe_tokenizer(corpus(), vocab_size=VOCAB_LIMIT)


def ensure_model(root: str | Path) -> Path:
    """The model directory under ``root`` (written on first use; the same files every time)."""
    import torch
    from alignopsd.engine.checkpoint.weights import publish_folder, save_model_files
    from alignopsd.engine.models.loading import tiny_config
    from transformers import LlamaForCausalLM

    out = Path(root) / "credit-tiny"
    if (out / "config.json").is_file():
        return out
    tok = build_tokenizer()
    cfg = tiny_config(len(tok))
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    cfg.initializer_range = INIT_RANGE
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED)
        model = LlamaForCausalLM(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id

    def fill(tmp: Path) -> None:
        save_model_files(tmp, model)
        tok.save_pretrained(str(tmp))

    return publish_folder(out, fill)  # the engine's model writer: atomic, with a manifest
