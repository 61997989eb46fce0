"""Thinking/action token regions and paired diagnostics (ALGORITHM.md §6 cases 17 and 19)."""

from __future__ import annotations

import pytest
import torch
from alignopsd.engine.step.regions import paired_region_stats, region_token_counts, token_regions

EOS = "<|eos|>"


class PieceTokenizer:
    """Greedy longest-match tokenizer over a fixed piece list plus single characters; exact offsets."""

    def __init__(self, pieces=(), offsets=True):
        self.pieces = sorted(set(pieces) | {EOS}, key=len, reverse=True)
        self.vocab: dict[str, int] = {}
        self.inv: dict[int, str] = {}
        self.offsets = offsets

    def _id(self, piece: str) -> int:
        if piece not in self.vocab:
            self.vocab[piece] = len(self.vocab)
            self.inv[self.vocab[piece]] = piece
        return self.vocab[piece]

    def encode_pieces(self, pieces):
        return [self._id(p) for p in pieces]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.inv[i] for i in ids)

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        if return_offsets_mapping and not self.offsets:
            raise NotImplementedError("no offsets")
        ids, offs, i = [], [], 0
        while i < len(text):
            for p in self.pieces:
                if text.startswith(p, i):
                    break
            else:
                p = text[i]
            ids.append(self._id(p))
            offs.append((i, i + len(p)))
            i += len(p)
        return {"input_ids": ids, "offset_mapping": offs}


def char_row(tok, text: str, eos=True):
    pieces = list(text) + ([EOS] if eos else [])
    return tok.encode_pieces(pieces), pieces


def run(tok, rows, length=None):
    length = length or max(len(r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return token_regions(ids, mask, tok), ids, mask


@pytest.mark.parametrize("tag", ["action", "search", "answer"])
def test_case17_regions_char_tokenizer(tag):
    tok = PieceTokenizer()
    text = f"<think>核验尺寸</think><{tag}>inspect dimensions</{tag}>"
    ids, pieces = char_row(tok, text)
    reg, _, _ = run(tok, [ids])
    think = "".join(p for p, f in zip(pieces, reg.thinking[0].tolist()) if f)
    act = "".join(p for p, f in zip(pieces, reg.action[0].tolist()) if f)
    assert think == "核验尺寸"
    assert act == "inspect dimensions"
    assert not bool((reg.thinking & reg.action).any())
    assert reg.counts["malformed_region_rows"] == 0


def test_case17_uppercase_action_found():
    tok = PieceTokenizer()
    ids, pieces = char_row(tok, "<think>ok</think><ACTION>buy</ACTION>")
    reg, _, _ = run(tok, [ids])
    assert "".join(p for p, f in zip(pieces, reg.action[0].tolist()) if f) == "buy"


@pytest.mark.parametrize(
    "text",
    [
        "<think>unclosed<action>go</action>",
        "<think>a</think><action>x</action><action>y</action>",
        "<think>a<think>b</think></think><action>x</action>",
        "<think>a <action>x</action></think>",
    ],
)
def test_case17_malformed_rows_counted_and_empty(text):
    tok = PieceTokenizer()
    ids, _ = char_row(tok, text)
    reg, _, _ = run(tok, [ids])
    assert reg.counts["malformed_region_rows"] == 1
    assert not bool(reg.thinking.any()) and not bool(reg.action.any())


def test_case17_round_trip_mismatch_and_missing_offsets_counted():
    tok = PieceTokenizer(pieces=["<action>"])
    # sampled as separate pieces, but re-encoding merges "<action>" into one piece -> mismatch
    ids = tok.encode_pieces(["<think>", "a", "</think>", "<act", "ion>", "x", "</action>"])
    tok.pieces = sorted(set(tok.pieces) | {"<think>", "</think>", "</action>"}, key=len, reverse=True)
    reg, _, _ = run(tok, [ids])
    assert reg.counts["round_trip_mismatch_rows"] == 1
    assert not bool(reg.action.any())
    tok2 = PieceTokenizer(offsets=False)
    ids2, _ = char_row(tok2, "<think>a</think><action>x</action>")
    reg2, _, _ = run(tok2, [ids2])
    assert reg2.counts["missing_offsets_rows"] == 1
    assert not bool(reg2.thinking.any())


def test_case17_straddling_token_excluded():
    tok = PieceTokenizer(pieces=["<action>b", "y</action>", "<think>", "</think>"])
    ids = tok.encode_pieces(["<action>b", "u", "y</action>"])
    reg, _, _ = run(tok, [ids])
    assert reg.action[0].tolist() == [False, True, False]


def test_case19_paired_end_to_end():
    """diag -2.1, student -2, cross -1.8, H = 1 -> alpha 0.2; cross flips every matched token, corrected does not."""
    from alignopsd import rectify

    tok = PieceTokenizer()
    text = "<think>abc</think><action>xy</action>"
    ids, pieces = char_row(tok, text)
    n = len(ids)
    reg, ids_t, mask = run(tok, [ids, ids])
    policy = mask.clone()
    y_pos = pieces.index("y")
    policy[:, y_pos] = 0  # one action token is not a policy token
    L = n
    old = torch.full((2, L), -2.0)
    diag = torch.full((2, L), -2.1)
    cross = torch.full((1, L), -1.8)
    H = torch.ones(2, 2)
    pairs = torch.tensor([[1, 0]])
    before = [t.clone() for t in (old, diag, cross, H)]
    rect = rectify(diag, cross, pairs, H, gamma=0.7, alpha_max=0.2)
    assert float(rect.alpha[0]) == pytest.approx(0.2)
    corrected_gap = rect.corrected - old
    assert float(corrected_gap[0, 0]) == pytest.approx(-0.04, abs=1e-6)
    cross_full = diag.clone()
    cross_full[0] = cross[0]
    matched = torch.tensor([True, False])
    stats = paired_region_stats(diag - old, cross_full - old, corrected_gap, policy, reg, matched)
    counts = region_token_counts(reg, policy, matched)
    assert counts["thinking"] == 3 and counts["action"] == 1 and counts["other"] == counts["response"] - 4
    assert stats["paired/response/token_count"] == n - 1
    assert stats["paired/response/strict/neg_to_pos_count"] == n - 1  # every matched policy token flips
    assert stats["paired/response/strict/corrected_neg_to_pos_count"] == 0
    assert stats["paired/thinking/strict/neg_to_pos_count"] == 3
    assert stats["paired/action/strict/neg_to_pos_count"] == 1
    assert stats["paired/thinking/token_count"] == 3 and stats["paired/action/token_count"] == 1
    for a, b in zip(before, (old, diag, cross, H)):
        assert torch.equal(a, b)  # inputs unchanged


def test_paired_stats_reject_bad_eps_and_empty_scope():
    tok = PieceTokenizer()
    ids, _ = char_row(tok, "<think>a</think><action>b</action>")
    reg, _, mask = run(tok, [ids])
    z = torch.zeros(mask.shape)
    for eps in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps"):
            paired_region_stats(z, z, z, mask, reg, torch.tensor([True]), eps=eps)
    out = paired_region_stats(z, z, z, mask, reg, torch.tensor([False]))
    assert out["paired/response/token_count"] == 0 and out["paired/response/strict/neg_to_pos_rate"] == 0.0


def test_region_metrics_on_the_device_with_host_old_logprobs():
    """The step hands region_metrics the host's old log-probs and mask and the rectification on the policy's device
    (cuda): the paired statistics are those of an all-host call, with no region error (strict mode would raise)."""
    import dataclasses

    from alignopsd.engine.step.regions import region_metrics
    from fake_cuda import FakeCuda

    from alignopsd import rectify

    tok = PieceTokenizer()
    ids, _ = char_row(tok, "<think>abc</think><action>xy</action>")
    reg, _, mask = run(tok, [ids, ids])
    old = torch.full(tuple(mask.shape), -2.0)
    rect = rectify(torch.full(old.shape, -2.1), torch.full((1, old.shape[1]), -1.8), torch.tensor([[1, 0]]),
                   torch.ones(2, 2), gamma=0.7, alpha_max=0.2)  # fmt: skip
    host = region_metrics(reg, mask, old, rect)
    with FakeCuda():
        moved = {f.name: getattr(rect, f.name) for f in dataclasses.fields(rect)}
        moved = {k: v.to("cuda") if isinstance(v, torch.Tensor) else v for k, v in moved.items()}
        on_device = region_metrics(reg, mask, old, dataclasses.replace(rect, **moved))
    assert "regions/errors" not in on_device and on_device["paired/response/token_count"] > 0
    assert on_device == host
