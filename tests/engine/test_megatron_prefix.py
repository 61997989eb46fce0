"""Shared prefixes under Megatron: each prompt's rows scored in one packed sequence behind one copy of it.

The planning and the attention layout are checked on their own (any session); the scores of the packed
forwards are compared with the plain rows of the same tensor-parallel shards at TP=2 (``torchrun
--nproc_per_node=2 -m pytest -m distributed``).
"""

from __future__ import annotations

import os

import pytest
import torch
from alignopsd.engine.policy.megatron.scoring import ShardScoring, pack_layout, plan_forwards, plan_packs
from alignopsd.engine.policy.row_scoring import backend_prefix_logprobs, backend_scorer
from alignopsd.engine.step.batch import TurnBatch
from alignopsd.engine.step.rescoring import Rescorer

two_ranks = pytest.mark.skipif(os.environ.get("WORLD_SIZE") != "2", reason="needs torchrun --nproc_per_node=2")


def _pad(rows: list[list[int]], width: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, sl], mask[i, sl] = torch.tensor(r, dtype=torch.long), 1
    return ids, mask


def test_plan_packs_splits_at_the_cap_and_skips_empty_rows():
    _, p_mask = _pad([[1, 2, 3], [4, 5]], 3, left=True)
    _, r_mask = _pad([[1, 2, 3], [1, 2], [], [1, 2, 3, 4], [1]], 4, left=False)
    row_prompt = torch.tensor([0, 1, 0, 0, 0])
    packs, lengths = plan_packs(p_mask, row_prompt, r_mask, max_pack_tokens=7)
    # prompt 0 (3 tokens): rows 0 (+2), 3 (+3) fill 8 > 7 -> row 3 starts a new pack; row 4 (+0) joins it
    assert packs == [(0, [0]), (0, [3, 4]), (1, [1])]
    assert lengths == [3 + 2, 3 + 3 + 0, 2 + 1]
    assert plan_packs(p_mask, row_prompt, r_mask, max_pack_tokens=100)[0] == [(0, [0, 3, 4]), (1, [1])]
    # forwards: longest first, packs x longest <= max_tokens
    assert plan_forwards([5, 6, 3], max_tokens=12) == [[1, 0], [2]]
    assert plan_forwards([5, 6, 3], max_tokens=1) == [[1], [0], [2]]


def test_pack_layout_attends_to_the_prompt_and_its_own_response_only():
    p_ids, p_mask = _pad([[11, 12, 13]], 4, left=True)
    r_ids, r_mask = _pad([[21, 22, 23], [31, 32]], 3, left=False)
    r_mask[0, 1] = 0  # a masked-out token inside a response: never a key, its position not counted
    ids, pos, blocked, hid, row, col, tgt = pack_layout([(0, [0, 1])], p_ids, p_mask, r_ids, r_mask)
    assert ids.tolist() == [[11, 12, 13, 21, 22, 31]]  # prompt, then each response without its last token
    assert pos.tolist() == [[0, 1, 2, 3, 3, 3]]  # each response restarts right after the prompt
    seen = ~blocked[0, 0]
    assert seen[:3].tolist() == [[True, False, False] + [False] * 3, [True, True, False] + [False] * 3,
                                 [True] * 3 + [False] * 3]  # fmt: skip
    assert seen[3].tolist() == [True, True, True, True, False, False]
    assert seen[4].tolist() == [True, True, True, True, False, False]  # not its masked-out neighbour
    assert seen[5].tolist() == [True, True, True, False, False, True]  # not the other response
    # scored tokens: response 0 columns 0 and 2, response 1 columns 0 and 1; token 0 from the prompt's last
    assert row.tolist() == [0, 0, 1, 1] and col.tolist() == [0, 2, 0, 1]
    assert hid.tolist() == [2, 4, 2, 5] and tgt.tolist() == [21, 23, 31, 32]


def test_backend_prefix_scoring_needs_a_packing_backend():
    class RowsOnly:
        scores_itself = False  # no packed scoring of its own (PolicyBackend.scores_itself)

        def response_logprobs(self, *a, **kw):
            raise AssertionError("not reached")

    z = torch.ones(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="policy: RowsOnly"):
        backend_prefix_logprobs(RowsOnly(), z, z, torch.zeros(1, dtype=torch.long), z, z, False, temperature=1.0)
    with pytest.raises(ValueError, match="mode"):
        backend_scorer(RowsOnly(), "packed", temperature=1.0, device=torch.device("cpu"))

    class TransformerEngineShard(ShardScoring):
        spec = "te"  # its causal attention ignores an arbitrary mask: packing would let responses see each other

    with pytest.raises(ValueError, match="rescoring_mode=plain"):
        backend_prefix_logprobs(TransformerEngineShard(), z, z, torch.zeros(1, dtype=torch.long), z, z, False,
                                temperature=1.0)  # fmt: skip


def _qwen2_tiny():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0, tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )  # fmt: skip
    torch.manual_seed(3)
    return Qwen2ForCausalLM(cfg).float().eval()


def _llama_tiny():
    from alignopsd.engine.models.loading import build_tiny_model

    return build_tiny_model().float().eval()


def _turns(seed: int) -> tuple[TurnBatch, torch.Tensor]:
    """6 turns of 2 tasks: ragged left-padded teacher prompts (turns 0 and 1 share theirs, as sibling turn-0
    prompts do), ragged right-padded responses (one of a single token, one with nothing attended), 9 cross pairs."""
    g = torch.Generator().manual_seed(seed)

    def toks(n):
        return torch.randint(3, 500, (n,), generator=g).tolist()

    shared = toks(7)
    t_ids, t_mask = _pad([shared, list(shared), toks(9), toks(4), toks(8), toks(6)], 10, left=True)
    s_ids, s_mask = _pad([toks(5), toks(3), toks(6), toks(2), toks(4), toks(5)], 6, left=True)
    r_ids, r_mask = _pad([toks(6), toks(3), toks(1), toks(5), toks(6), toks(4)], 6, left=False)
    r_mask[5] = 0
    m = 6
    cb = TurnBatch(
        task=torch.tensor([0, 0, 0, 1, 1, 1]), rollout=torch.tensor([0, 1, 2, 0, 1, 2]),
        turn=torch.zeros(m, dtype=torch.long), prompt_ids=s_ids, prompt_mask=s_mask, response_ids=r_ids,
        response_mask=r_mask, outcome=torch.zeros(m), action_valid=torch.ones(m, dtype=torch.bool),
        teacher_prompt_ids=t_ids, teacher_prompt_mask=t_mask,
    )  # fmt: skip
    pairs = torch.tensor([[0, 1], [0, 2], [1, 0], [2, 0], [2, 1], [3, 4], [4, 3], [5, 3], [3, 5]])
    return cb, pairs


@pytest.mark.distributed
@two_ranks
@pytest.mark.parametrize("name", ["llama_tied", "qwen2_bias_gqa_untied"])
@pytest.mark.parametrize("sizes", [dict(max_tokens=40, max_pack_tokens=16), dict()])
def test_packed_prefixes_equal_plain_rows_at_tp2(name, sizes):
    """Old log-probs (with entropy), diagonal and cross teacher rows: the packed shared-prefix forwards of the TP=2
    shards equal the plain rows of the same shards within 1e-5 (fp32), and push fewer tokens."""
    from alignopsd.engine.policy.megatron.backend import MegatronPolicy

    model = {"llama_tied": _llama_tiny, "qwen2_bias_gqa_untied": _qwen2_tiny}[name]()
    pol = MegatronPolicy(model.config, model.state_dict(), tp=2)
    cb, pairs = _turns(seed=11)
    cpu = torch.device("cpu")
    runs = {}
    for mode in ("plain", "shared_prefix"):
        kw = sizes if mode == "shared_prefix" else {}
        scorer = backend_scorer(pol, mode, temperature=0.9, device=cpu, **kw)
        runs[mode] = Rescorer(model, mode=mode, temperature=0.9, scorer=scorer)(cb, pairs, with_entropy=True)
    plain, ours = runs["plain"], runs["shared_prefix"]
    mask = cb.response_mask.float()
    assert (ours.old_logp - plain.old_logp).abs().max().item() <= 1e-5
    assert ((ours.entropy - plain.entropy) * mask).abs().max().item() <= 1e-5
    assert (ours.diag - plain.diag).abs().max().item() <= 1e-5
    assert (ours.cross - plain.cross).abs().max().item() <= 1e-5
    assert bool((ours.diag[5] == 0).all()) and bool((ours.diag[2, 1:] == 0).all()) and ours.diag[2, 0] < 0
    st_p, st_s = plain.stats, ours.stats
    assert st_s["teacher/token_forwards"] < st_p["teacher/token_forwards"]
    assert st_s["teacher/rows"] == st_p["teacher/rows"] == 6 + 9
    distinct = int(cb.teacher_prompt_mask[1:].sum())  # 5 distinct teacher prompts (turns 0 and 1 share theirs)
    if sizes:  # small sizes: prompts split over several packs and packs over several forwards
        assert st_s["teacher/forwards"] > 1 and st_s["teacher/prompt_tokens"] > distinct
    else:  # defaults: one forward, each distinct teacher prompt pushed once
        assert st_s["teacher/forwards"] == 1 and st_s["teacher/prompt_tokens"] == distinct
    # both ranks hold the same full result
    both = [torch.empty_like(ours.cross) for _ in range(2)]
    torch.distributed.all_gather(both, ours.cross.contiguous())
    assert torch.equal(both[0], both[1])
