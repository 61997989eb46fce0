"""Thinking encoder: §6 cases 1-2, MiniLM from its package, the last-token path on a tiny random model."""

from __future__ import annotations

import pytest
import torch
from alignopsd.engine.models.encoder import ThinkingEncoder, last_token_pool, preprocess
from alignopsd.engine.models.loading import resolve_model_path


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: OpenMP spin-waiting on a shared 2-core machine costs more than it gives
    yield
    torch.set_num_threads(n)


def test_case1_whitespace_collapse():
    assert preprocess("  choose   the green shirt ") == "choose the green shirt"
    assert preprocess("a\n\t b\r\nc") == "a b c"
    assert preprocess(" \n\t ") == ""


def test_case2_last_token_pool():
    hidden = torch.arange(12.0).reshape(2, 3, 2)
    left = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert torch.equal(last_token_pool(hidden, left), hidden[:, -1])
    right = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert torch.equal(last_token_pool(hidden, right), torch.stack([hidden[0, 1], hidden[1, 2]]))
    with pytest.raises(ValueError, match="mask_BT"):
        last_token_pool(hidden, left[:, :2])


@pytest.fixture(scope="module")
def minilm():
    return ThinkingEncoder(batch_size=3)


def test_minilm_embeddings(minilm):
    texts = ["  choose   the green shirt ", "", "choose the green shirt", "go to the kitchen", " \n "]
    emb, valid = minilm.encode(texts)
    assert emb.dtype == torch.float32 and emb.shape == (5, 384)
    assert valid.tolist() == [True, False, True, True, False]
    assert torch.equal(emb[1], torch.zeros(384)) and torch.equal(emb[4], torch.zeros(384))
    torch.testing.assert_close(emb[valid].norm(dim=-1), torch.ones(3))
    assert torch.equal(emb[0], emb[2])  # same text after whitespace collapse: encoded once, one vector
    assert minilm.stats["texts"] - minilm.stats["distinct_texts"] == 1  # the repeat did not reach the model
    related = float(emb[0] @ minilm.encode(["pick the green shirt"])[0][0])
    unrelated = float(emb[0] @ emb[3])
    assert related > 0.7 > unrelated  # a real sentence model, not random weights
    assert not minilm.model.training and not any(p.requires_grad for p in minilm.model.parameters())
    assert minilm.stats["texts"] >= 3 and minilm.stats["texts_per_s"] > 0
    # batch-size invariance
    one, _ = ThinkingEncoder(batch_size=1).encode(texts)
    torch.testing.assert_close(one, emb, atol=1e-5, rtol=0)
    empty, v = minilm.encode(["", "  "])
    assert empty.shape == (2, 384) and not v.any()


@pytest.fixture(scope="module")
def tiny_enc():
    return ThinkingEncoder(resolve_model_path("tiny"), kind="last_token", batch_size=2, device="cpu")


def test_last_token_construction(tiny_enc):
    assert tiny_enc.kind == "last_token" and tiny_enc.max_length == 4096
    assert tiny_enc.load_kwargs["attn_implementation"] == "sdpa"
    dtype_key = "dtype" if "dtype" in tiny_enc.load_kwargs else "torch_dtype"
    assert tiny_enc.load_kwargs[dtype_key] is torch.float32  # auto on CPU
    assert tiny_enc.model.dtype == torch.float32 and tiny_enc.model.config._attn_implementation == "sdpa"
    assert tiny_enc.tokenizer.padding_side == "left" and tiny_enc.tokenizer.truncation_side == "right"
    assert not tiny_enc.model.training and not any(p.requires_grad for p in tiny_enc.model.parameters())


def test_last_token_matches_unpadded_forward(tiny_enc):
    texts = ["go north", "", "take the red apple from the wooden table", "look  around\n"]
    emb, valid = tiny_enc.encode(texts)
    assert valid.tolist() == [True, False, True, True] and emb.shape == (4, 64)
    for i, t in enumerate(texts):
        if not valid[i]:
            assert not emb[i].any()
            continue
        ids = tiny_enc.tokenizer(preprocess(t), return_tensors="pt")
        with torch.no_grad():
            h = tiny_enc.model(**ids).last_hidden_state[0, -1]
        torch.testing.assert_close(emb[i], torch.nn.functional.normalize(h, dim=-1), atol=1e-5, rtol=0)
    assert next(tiny_enc.model.parameters()).device.type == "cpu"


def test_last_token_right_truncation(tiny_enc):
    enc = ThinkingEncoder(tiny_enc.path, kind="last_token", max_length=4, device="cpu")
    a, _ = enc.encode(["one two three four five six"])
    b, _ = enc.encode(["one two three four seven eight nine"])
    c, _ = enc.encode(["zero one two three four five"])
    torch.testing.assert_close(a, b)  # the beginning is kept
    assert not torch.allclose(a, c)


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="texts"):
        ThinkingEncoder.encode(None, "just a string")
    with pytest.raises(ValueError, match="batch_size"):
        ThinkingEncoder(batch_size=0)
    with pytest.raises(FileNotFoundError, match="not found"):
        ThinkingEncoder(str(tmp_path / "missing"))


def test_minilm_long_text_and_configured_max_length():
    enc = ThinkingEncoder("minilm", max_length=4096, batch_size=2)  # the run config's default limit
    assert enc.max_length == 512  # capped at MiniLM's position limit
    emb, valid = enc.encode(["word " * 3000, "short"])
    assert valid.all() and torch.isfinite(emb).all()
