"""The credit benchmark's model: a small vocabulary of the environments' words, equal-length options per turn, a
near-uniform random initial policy, and the same files on every build."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import credit_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return credit_model.ensure_model(tmp_path_factory.mktemp("credit-model"))


def test_every_candidate_of_a_turn_has_the_same_token_count_and_text_round_trips(model_dir):
    from alignopsd.engine.envs.credit import env as credit
    from alignopsd.engine.generation.choice import candidate_texts
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert 300 < len(tok) < 1000  # bytes + the environments' words, not a 49k vocabulary
    lists = [list(credit.CORRIDOR), [f"say {w}" for w in credit.WORDS], [f"take {c} key" for c in credit.COLOURS]]
    lists += [[f"paint {c}" for c in credit.COLOURS], [f"cross {c} bridge" for c in credit.COLOURS]]
    for acts in lists:
        lengths = {
            len(tok(t, add_special_tokens=False)["input_ids"]) for t in candidate_texts(f"Actions: [{', '.join(acts)}]")
        }
        assert len(lengths) == 1, (acts, lengths)
    assert tok.tokenize(" lantern") == ["Ġlantern"]  # a word of the environments is one token
    text = credit_model.corpus(1)[-1] + " unseen wörds {} 123"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_random_initial_policy_is_near_uniform_over_a_decisive_turn(model_dir):
    from alignopsd.engine.envs.prompts import chat_text
    from alignopsd.engine.generation.base import SamplingParams
    from alignopsd.engine.generation.choice import ChoiceGenerator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    user = "Task: cross the hall.\nObservation: Four keys lie on the floor.\nActions: [take red key, take blue key, "
    user += "take green key, take yellow key]."
    prompt = tok(chat_text(tok, user), add_special_tokens=False)["input_ids"]
    out = ChoiceGenerator(model, tok).generate([prompt] * 400, SamplingParams(max_new_tokens=8, seed=3))
    picks = [t.split("<action>")[1] for t in out.texts]
    shares = [picks.count(f"take {c} key</action>") / len(picks) for c in ("red", "blue", "green", "yellow")]
    assert all(0.15 < s < 0.35 for s in shares), shares  # chance is 0.25 each


def test_the_model_is_the_same_on_every_build(model_dir, tmp_path):
    again = credit_model.ensure_model(tmp_path)
    assert credit_model.ensure_model(tmp_path) == again  # the second call reads the first one's files
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name
