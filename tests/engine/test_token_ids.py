"""The end and pad ids of a tokenizer (engine/tokens/special.py): one rule for the generation backend, the rollout and
the warm start; 0 is a valid id."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from alignopsd.engine.generation.hf import HFGenerator
from alignopsd.engine.tokens.special import TokenIds, token_ids


def _tok(eos, pad):
    return SimpleNamespace(eos_token_id=eos, pad_token_id=pad)


def test_pad_id_zero_is_kept():
    assert token_ids(_tok(2, 0)) == TokenIds(eos=2, pad=0)
    assert token_ids(_tok(0, None)) == TokenIds(eos=0, pad=0)


def test_pad_falls_back_to_eos_then_to_the_stop_ids():
    assert token_ids(_tok(7, None), stop=(3, 5)) == TokenIds(eos=7, pad=7)
    assert token_ids(_tok(None, None), stop=(5, 3)) == TokenIds(eos=3, pad=3)
    assert token_ids(_tok(None, 4)) == TokenIds(eos=None, pad=4)


def test_an_explicit_pad_wins_zero_included():
    assert token_ids(_tok(2, 9), pad=0).pad == 0


def test_missing_ids_name_the_tokenizer():
    with pytest.raises(ValueError, match="tokenizer: no pad_token_id and no eos_token_id"):
        token_ids(_tok(None, None))
    with pytest.raises(ValueError, match="tokenizer: no eos_token_id to close an empty response"):
        token_ids(_tok(None, 4)).end_of_turn("close an empty response")


def test_hf_generator_pads_with_id_zero():
    model = SimpleNamespace(
        config=SimpleNamespace(eos_token_id=2), generation_config=SimpleNamespace(eos_token_id=None)
    )
    g = HFGenerator(model, _tok(2, 0), max_model_len=64)
    assert g.pad_token_id == 0 and g.eos_token_ids == {2}
    assert HFGenerator(model, _tok(None, None), max_model_len=64).pad_token_id == 2  # the model's EOS id
