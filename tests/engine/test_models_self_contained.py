"""The self-contained tiny models ("tiny-bpe", "tiny-encoder"): built-in BPE tokenizer, no wheel, no gguf."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from alignopsd.engine.models import loading as M
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("ALIGNOPSD_CACHE", str(tmp_path / "a"))
    return tmp_path


def test_bpe_tokenizer_is_deterministic_and_lossless():
    a, b = M.build_bpe_tokenizer(), M.build_bpe_tokenizer()
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    assert len(a) <= M.BPE_VOCAB_SIZE
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id) == (1, 2, 2)  # the tiny Llama's special ids
    text = "Step 3: observation 'the chest is open', action 'say zébra' — ünïcode ✓ \t\n"
    ids = a(text, add_special_tokens=False)["input_ids"]
    assert a.decode(ids) == text  # byte-level: every string round-trips
    assert len(ids) < len(text.encode())  # the merges compress
    chat = a.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_bpe_model_matches_its_tokenizer(cache, monkeypatch):
    tok = M.load_tokenizer("tiny-bpe")
    model = M.load_causal_lm("tiny-bpe")
    assert model.config.vocab_size == len(tok)  # every id the model samples decodes
    assert model.config.eos_token_id == tok.eos_token_id
    ids = tok("<think>go</think>", return_tensors="pt")["input_ids"]
    assert torch.isfinite(model(ids).logits).all()
    first = load_file(str(Path(M.resolve_model_path("tiny-bpe")) / "model.safetensors"))
    monkeypatch.setenv("ALIGNOPSD_CACHE", str(cache / "b"))  # built again elsewhere: the same weights
    again = load_file(str(Path(M.resolve_model_path("tiny-bpe")) / "model.safetensors"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    with pytest.raises(ValueError, match="name"):
        M.ensure_self_contained("tiny")


def test_tiny_encoder_through_the_run_config(cache):
    from alignopsd.engine.config.schema import load_config
    from alignopsd.engine.run.components import build_encoder

    cfg = load_config(str(ROOT / "configs" / "tiny.yaml"), ["encoder.name=tiny-encoder"])
    enc = build_encoder(cfg, torch.device("cpu"))
    assert enc.kind == "last_token" and enc.max_length == cfg.encoder.max_length
    emb, valid = enc.encode(["i will go north", "  ", "i will  go\nnorth", "open the chest"])
    assert valid.tolist() == [True, False, True, True]
    assert torch.allclose(emb[valid].norm(dim=-1), torch.ones(3), atol=1e-5)
    assert torch.equal(emb[1], torch.zeros_like(emb[1]))
    assert torch.allclose(emb[0], emb[2])  # whitespace is normalised before encoding
    assert not torch.allclose(emb[0], emb[3], atol=1e-3)  # different texts, different embeddings
