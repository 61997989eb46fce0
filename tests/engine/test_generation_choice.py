"""The candidate-choice generation backend (``generation.backend: choice``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from alignopsd.engine.generation.base import SamplingParams
from alignopsd.engine.generation.choice import ChoiceGenerator, candidate_texts

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def test_candidates_come_from_the_last_action_list():
    text = "Actions: [walk on, look around].\nStep 1 ...\nActions: [say apple, say river]."
    assert candidate_texts(text) == [
        "<think>i will say apple</think><action>say apple</action>",
        "<think>say apple looks good</think><action>say apple</action>",
        "<think>i will say river</think><action>say river</action>",
        "<think>say river looks good</think><action>say river</action>",
    ]
    assert len(candidate_texts("Admissible actions: ['wait', 'say x'].")) == 4


def test_prompt_without_action_list_is_refused():
    with pytest.raises(ValueError, match="no admissible actions listed"):
        candidate_texts("Task: search the web.\nQuestion: who?")


def test_config_selects_the_backend_and_it_samples_the_policy():
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.envs.prompts import chat_text
    from alignopsd.engine.run.components import build_components

    torch.set_num_threads(1)
    cfg = load_config(str(TINY), ["generation.backend=choice", "env.name=credit", "algorithm.estimator=grpo"])
    parts = build_components(cfg, device=torch.device("cpu"))
    try:
        gen = parts.generator
        assert isinstance(gen, ChoiceGenerator) and gen.model is parts.policy.model
        tok = parts.tokenizer
        prompt = tok(chat_text(tok, "Observation: here.\nActions: [take red key, take blue key]."))["input_ids"]
        sp = SamplingParams(max_new_tokens=4, seed=7)
        a, b = gen.generate([prompt] * 3, sp), gen.generate([prompt] * 3, sp)
        assert a.texts == b.texts and all(
            t in candidate_texts("Actions: [take red key, take blue key]") for t in a.texts
        )
        for ids, lps in zip(a.token_ids, a.logprobs):
            assert ids[-1] == tok.eos_token_id and len(lps) == len(ids) and all(x < 0 for x in lps)
        # scoring in chunks (here one row at a time) samples the same responses with the same log-probs
        c = ChoiceGenerator(gen.model, tok, max_batch_tokens=1).generate([prompt] * 3, sp)
        assert c.texts == a.texts and all(x == pytest.approx(y, abs=1e-5) for x, y in zip(c.logprobs, a.logprobs))
        # the probability of each sampled candidate is the policy's: its log-probs equal a direct scoring
        from alignopsd.engine.policy.lm_head import score_rows

        ids = torch.tensor([a.token_ids[0]])
        lp = score_rows(gen.model, torch.tensor([prompt]), torch.ones(1, len(prompt)), ids, torch.ones_like(ids)).logp
        assert lp[0].tolist() == pytest.approx(a.logprobs[0], abs=1e-5)
    finally:
        parts.close()
