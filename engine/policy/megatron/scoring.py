"""Scoring with a tensor-parallel megatron-core ``GPTModel`` shard, shared by the trained policy and the frozen
reference (legend as in ``backend``: B rows, T tokens per row, L response length, N scored tokens, D hidden size).

:class:`ShardScoring` is the no-grad and training forward to per-token log-probs on this rank's vocabulary shard
(``alignopsd.kernels.logprob_vocab_parallel``; no rank holds the full [N, V] logits). A class using it sets
``model`` (the GPTModel shard), ``spec`` (its layer spec kind), ``tp``, ``tp_rank``, ``tp_group`` and
``padding_idx``.

Shared prefixes (``ShardScoring.prefix_logprobs``, the ``shared_prefix`` rescoring mode under Megatron): the rows
scored under one prompt go through the model as one packed sequence ``[prompt | resp_1 | resp_2 | ...]`` (the
prompt's attended tokens, then each response without its last token) with an attention layout in which the
prompt is causal, each response token sees the whole prompt and its own response causally (never another
response), and each response's positions continue from the prompt's length, as if it were alone after the
prompt. Response token 0 is scored from the prompt's last hidden state. A pack holds at most ``max_pack_tokens``
tokens (a prompt with more responses gets several packs, each repeating the prompt): attention over a pack costs
T^2, so the cap bounds it at max_pack_tokens / row width times the plain rows' attention per forward.

:class:`FrozenShard` is such a shard that never trains: a snapshot of a policy's shard (the reference model of the
KL term, built from the initial weights), sharded exactly like the policy, with no gradients, optimizer or
data-parallel wrapper.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from alignopsd.engine.parallel import devices
from alignopsd.engine.parallel.devices import module_device
from alignopsd.engine.policy.base import RowLayout, prompt_width
from alignopsd.engine.policy.lm_head import scatter_response
from alignopsd.engine.policy.megatron.model import build_gpt_model, forward_hidden, forward_layout, output_weight
from torch import Tensor


def response_spans(resp_mask_RL: Tensor) -> list[int]:
    """Used length of each response: its last attended column + 1 (0 when nothing is attended)."""
    m = resp_mask_RL.bool()
    cols = torch.arange(1, m.shape[1] + 1).expand_as(m)
    return (cols * m).amax(1).tolist() if m.numel() else [0] * int(m.shape[0])


def plan_packs(prompt_mask_SP: Tensor, row_prompt_R: Tensor, resp_mask_RL: Tensor, max_pack_tokens: int):
    """(packs, lengths): each pack ``(prompt s, [rows])`` in order of the rows' prompts, ``lengths`` its tokens
    (the prompt's attended tokens + each row's used length - 1). A pack holds as many rows of its prompt as fit in
    ``max_pack_tokens`` (at least one); rows with nothing attended are in no pack (they score nothing)."""
    lt_S = prompt_mask_SP.bool().sum(1).tolist()
    spans = response_spans(resp_mask_RL)
    rp = row_prompt_R.tolist()
    packs: list[tuple[int, list[int]]] = []
    lengths: list[int] = []
    for r in sorted(range(len(rp)), key=lambda i: rp[i]):
        if spans[r] == 0:
            continue
        n = spans[r] - 1
        if packs and packs[-1][0] == rp[r] and lengths[-1] + n <= max_pack_tokens:
            packs[-1][1].append(r)
            lengths[-1] += n
        else:
            packs.append((rp[r], [r]))
            lengths.append(lt_S[rp[r]] + n)
    return packs, lengths


def plan_forwards(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Packs per forward, longest first: as many as keep (packs x longest pack) within ``max_tokens`` (at least
    one per forward)."""
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def pack_layout(packs, prompt_ids_SP: Tensor, prompt_mask_SP: Tensor, resp_ids_RL: Tensor, resp_mask_RL: Tensor):
    """The packed forward of ``packs`` (see the module docstring): (ids [B, T], positions [B, T], blocked
    [B, 1, T, T] (True = not attended), hidden index [N] into the flattened [B * T] hidden states, row [N], column
    [N], target [N]) for the N attended response tokens of the packs' rows."""
    seqs, scored = [], []
    for s, rows in packs:
        keep = prompt_mask_SP[s].bool()
        ids, lt = [prompt_ids_SP[s][keep]], int(keep.sum())
        pos, seg, ok = [torch.arange(lt)], [torch.zeros(lt, dtype=torch.long)], [torch.ones(lt, dtype=torch.bool)]
        start = lt
        for i, r in enumerate(rows, 1):
            rm = resp_mask_RL[r].bool()
            used = response_spans(rm[None])[0]
            ids.append(resp_ids_RL[r, : used - 1])
            pos.append(lt + rm[: used - 1].long().cumsum(0) - 1)
            seg.append(torch.full((used - 1,), i, dtype=torch.long))
            ok.append(rm[: used - 1])
            cols = rm[:used].nonzero()[:, 0]
            hidden = torch.where(cols == 0, lt - 1, start + cols - 1)
            scored.append((len(seqs), hidden, torch.full_like(cols, r), cols))
            start += used - 1
        seqs.append((torch.cat(ids), torch.cat(pos), torch.cat(seg), torch.cat(ok)))
    b, t = len(seqs), max(int(x[0].numel()) for x in seqs)
    ids_BT = torch.zeros(b, t, dtype=torch.long)
    pos_BT = torch.zeros(b, t, dtype=torch.long)
    seg_BT = torch.full((b, t), -1, dtype=torch.long)
    ok_BT = torch.zeros(b, t, dtype=torch.bool)
    for j, (ids, pos, seg, ok) in enumerate(seqs):
        n = int(ids.numel())
        ids_BT[j, :n], pos_BT[j, :n], seg_BT[j, :n], ok_BT[j, :n] = ids, pos, seg, ok
    causal_TT = torch.ones(t, t, dtype=torch.bool).tril()
    same_BTT = (seg_BT[:, None, :] == 0) | (seg_BT[:, None, :] == seg_BT[:, :, None])
    blocked_B1TT = ~(causal_TT[None] & ok_BT[:, None, :] & same_BTT)[:, None]
    hid_N = torch.cat([j * t + h for j, h, _, _ in scored])
    row_N = torch.cat([r for _, _, r, _ in scored])
    col_N = torch.cat([c for _, _, _, c in scored])
    return ids_BT, pos_BT, blocked_B1TT, hid_N, row_N, col_N, resp_ids_RL[row_N, col_N]


class ShardScoring:
    """Per-token log-probs of response tokens from a tensor-parallel GPTModel shard (see the module docstring)."""

    model: torch.nn.Module
    scores_itself = True  # ``PolicyBackend.scores_itself``: rows are scored through this shard, never a full module
    spec: str
    tp: int
    tp_rank: int
    tp_group: object
    padding_idx: int | None

    @functools.cached_property
    def rows(self) -> RowLayout:
        """``PolicyBackend.rows``: padded plain rows only (its prefix rows are packed already); packed ones are
        refused."""
        return RowLayout(False, can_pack=False)

    def _logprob(self, hidden_ND: Tensor, targets_N: Tensor, temperature: float, with_entropy: bool):
        from alignopsd.kernels.head import logprob, logprob_vocab_parallel  # noqa: PLC0415

        weight = output_weight(self.model)
        if self.tp == 1:
            out = logprob(hidden_ND, weight, targets_N, temperature=temperature, with_entropy=with_entropy)
        else:
            out = logprob_vocab_parallel(
                hidden_ND,
                weight,
                targets_N,
                group=self.tp_group,
                vocab_start=self.tp_rank * int(weight.shape[0]),
                temperature=temperature,
                with_entropy=with_entropy,
            )
        return out if with_entropy else (out, None)

    def _to_device(self, *rows: Tensor) -> tuple[Tensor, ...]:
        """The backend's device boundary: rows onto the shard's device."""
        dev = module_device(self.model)
        return tuple(devices.to_device(r, dev) for r in rows)

    def response_logprobs(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        response_length: int,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        grad: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """([B, L] fp32 log-probs of the last ``response_length`` columns, [B, L] entropy or None).

        Same contract as the Hugging Face backend: masked-out response positions get 0. Every rank of
        a tensor-parallel group must call this with the same rows.
        """
        lp = prompt_width(input_ids, attention_mask, response_length)
        input_ids, attention_mask = self._to_device(input_ids, attention_mask)
        rmask_BL = attention_mask[:, lp:].bool()
        ctx = contextlib.nullcontext() if grad else torch.no_grad()
        self.model.train(grad)
        with ctx:
            hidden_BTD = forward_hidden(self.model, input_ids[:, :-1], attention_mask[:, :-1], self.padding_idx)
            h_BLD = hidden_BTD[:, lp - 1 :]
            logp_BL, ent_BL = scatter_response(
                h_BLD, input_ids[:, lp:], rmask_BL, lambda h, t: self._logprob(h, t, temperature, with_entropy)
            )
        return logp_BL, ent_BL

    @torch.no_grad()
    def prefix_logprobs(
        self,
        prompt_ids_SP: Tensor,
        prompt_mask_SP: Tensor,
        row_prompt_R: Tensor,
        resp_ids_RL: Tensor,
        resp_mask_RL: Tensor,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        max_tokens: int = 16384,
        max_pack_tokens: int | None = None,
    ) -> tuple[Tensor, Tensor | None, dict]:
        """([R, L] fp32 log-probs, [R, L] entropy or None, counts) of the rows ``[prompt row_prompt_R[r] |
        response r]``, each prompt's rows packed behind one copy of it (see the module docstring); equal to
        :meth:`response_logprobs` on the plain rows up to floating-point reassociation. No gradients.

        prompt_ids_SP/prompt_mask_SP: [S, Lp] left-padded (every used prompt non-empty, last column attended);
        row_prompt_R: [R] prompt of each row; resp_ids_RL/resp_mask_RL: [R, L] right-padded. max_tokens: token
        positions per forward (packs x longest pack); max_pack_tokens: tokens per pack (default 2 x (Lp + L)).
        counts: ``prompt_tokens`` (prompt copies pushed), ``response_tokens`` (the rest, padding included),
        ``token_forwards``, ``forwards``, ``attention_scores`` (query-key pairs, rows x T^2 per forward). Every
        rank of a tensor-parallel group must call this with the same rows. Results are on the inputs' device.
        """
        if self.spec != "local":  # Transformer Engine's causal attention ignores the mask
            raise ValueError(
                "trainer.rescoring_mode: packed shared prefixes need the local layer spec (its attention "
                "honours an arbitrary mask: policy.layer_spec local or auto); use rescoring_mode=plain with the "
                "Transformer Engine spec"
            )
        r, lr = int(resp_ids_RL.shape[0]), int(resp_ids_RL.shape[1])
        used = row_prompt_R.unique()
        if r and (prompt_mask_SP.shape[1] == 0 or not bool(prompt_mask_SP[used, -1].bool().all())):
            raise ValueError("prompt_mask: every prompt must be non-empty and left-padded (last column attended)")
        cap = 2 * (int(prompt_ids_SP.shape[1]) + lr) if max_pack_tokens is None else int(max_pack_tokens)
        if cap < 1:
            raise ValueError(f"max_pack_tokens: must be >= 1, got {max_pack_tokens}")
        prompt_ids_SP, prompt_mask_SP, row_prompt_R = prompt_ids_SP.cpu(), prompt_mask_SP.cpu(), row_prompt_R.cpu()
        resp_ids_RL, resp_mask_RL = resp_ids_RL.cpu(), resp_mask_RL.cpu()
        packs, lengths = plan_packs(prompt_mask_SP, row_prompt_R, resp_mask_RL, cap)
        counts = {"prompt_tokens": 0, "response_tokens": 0, "token_forwards": 0, "forwards": 0, "attention_scores": 0}
        lp_RL = torch.zeros(r, lr, dtype=torch.float32)
        ent_RL = torch.zeros_like(lp_RL) if with_entropy else None
        self.model.eval()
        for fwd in plan_forwards(lengths, max_tokens):
            chosen = [packs[i] for i in fwd]
            ids, pos, blocked, hid, row, col, tgt = pack_layout(
                chosen, prompt_ids_SP, prompt_mask_SP, resp_ids_RL, resp_mask_RL
            )
            ids, pos, blocked, hid, tgt = self._to_device(ids, pos, blocked, hid, tgt)
            hidden_BTD = forward_layout(self.model, ids, pos, blocked)
            h_ND = hidden_BTD.reshape(-1, hidden_BTD.shape[-1]).index_select(0, hid)
            logp_N, ent_N = self._logprob(h_ND, tgt, temperature, with_entropy)
            lp_RL[row, col] = logp_N.float().cpu()
            if with_entropy:
                ent_RL[row, col] = ent_N.float().cpu()
            b, t = int(ids.shape[0]), int(ids.shape[1])
            n_prompt = sum(int(prompt_mask_SP[s].bool().sum()) for s, _ in chosen)
            counts["prompt_tokens"] += n_prompt
            counts["response_tokens"] += b * t - n_prompt
            counts["token_forwards"] += b * t
            counts["forwards"] += 1
            counts["attention_scores"] += b * t * t
        return lp_RL, ent_RL, counts


@contextlib.contextmanager
def rng_preserved() -> Iterator[None]:
    """Random states as they were before the block: the CPU generator, the current CUDA device's and
    megatron-core's model-parallel tracker (which initialises tensor-parallel weights)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker  # noqa: PLC0415

    tracker = get_cuda_rng_tracker()
    saved = tracker.get_states()
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            tracker.set_states(saved)


class FrozenShard(ShardScoring):
    """A frozen copy of ``policy``'s current shard (a ``MegatronPolicy``, or any ``ShardScoring`` with ``hf_config``
    and ``spec``): the same megatron-core layout, tensor-parallel group and parameter dtype, its parameters copied
    (no conversion: the copy is exact) and never trained. Build it before the first update to score the initial
    weights. Every rank of the tensor-parallel group builds its own shard."""

    def __init__(self, policy) -> None:
        src = policy.model
        params_dtype = next(src.parameters()).dtype
        self.hf_config = policy.hf_config
        self.tp, self.tp_rank, self.tp_group = policy.tp, policy.tp_rank, policy.tp_group
        self.padding_idx = policy.padding_idx
        with rng_preserved():  # the fresh model's random initialisation (overwritten below) draws no step's numbers
            self.model, self.spec = build_gpt_model(policy.hf_config, policy.tp, params_dtype, policy.spec, "none")
        missing, unexpected = self.model.load_state_dict(src.state_dict(), strict=False)
        if missing or unexpected:
            raise ValueError(
                f"policy: its shard does not match a fresh model (missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        self.model.requires_grad_(False)
        self.model.eval()

    def response_logprobs(
        self, input_ids, attention_mask, response_length, *, temperature=1.0, with_entropy=False, grad=False
    ):
        """``ShardScoring.response_logprobs`` without gradients (a frozen model has none to give)."""
        if grad:
            raise ValueError("grad: a frozen shard is never trained")
        return super().response_logprobs(
            input_ids, attention_mask, response_length, temperature=temperature, with_entropy=with_entropy, grad=False
        )
