"""The policy-backend interface shared by the Hugging Face and Megatron backends.

Legend: B = rows, T = Lp + L input length, L = response length.
Inputs are ``[prompt (left-padded) | response (right-padded)]`` rows; log-probs are of the
response tokens (the last L positions) under logits / temperature, computed with the fused
log-prob head (no [B, T, V] logits).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from alignopsd.engine.checkpoint.trainer_state import RowsChoice
from alignopsd.engine.policy.lora import LoraAdapter
from torch import Tensor, nn


def prompt_width(input_ids: Tensor, attention_mask: Tensor, response_length: int) -> int:
    """Validate ``[prompt | response]`` rows and return the prompt width Lp = T - L (ValueError names the culprit)."""
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(f"attention_mask: expected the shape of input_ids {tuple(input_ids.shape)}")
    t = int(input_ids.shape[1])
    if not 0 < response_length < t:
        raise ValueError(f"response_length: must be in [1, {t - 1}], got {response_length}")
    return t - response_length


def check_loss_fn(loss_fn) -> None:
    if not callable(loss_fn):
        raise ValueError(f"loss_fn: expected a callable, got {type(loss_fn).__name__}")


@dataclass(frozen=True)
class ParallelLayout:
    """Where a backend's process sits: its tensor- and data-parallel rank, size and process group.

    ``tp_group`` is None without tensor parallelism; ``dp_group`` None means the default (world) group.
    The first rank of a tensor-parallel group is its lead: it generates, writes the audit and the metrics.
    """

    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: Any = None

    @property
    def tensor_parallel(self) -> bool:
        return self.tp_size > 1 and self.tp_group is not None

    @property
    def is_group_lead(self) -> bool:
        return self.tp_rank == 0


class RowLayout:
    """How a policy's training and scoring forwards lay out their rows, packed (padding-free) or padded: the one place
    that says it. The policy owns it; the scorers of its architecture (the rescorer's plain rows, the reference) hold
    the same object, so a choice set here is every forward's.

    ``packed``: True or False as configured (``trainer.ppo.use_remove_padding`` resolved on the device), or None where
    it is auto on a CPU and not chosen yet: padded rows until :meth:`choose` sets the choice the run's first update
    measured (engine/step/packing_trial.py), a checkpoint stored or rank 0 made (:attr:`choice`, a
    :class:`RowsChoice`, is what a checkpoint stores). ``can_pack``: False for a backend that builds no packed rows
    (Megatron's plain rows): packed rows are refused.
    """

    def __init__(self, packed: bool | None, *, can_pack: bool = True) -> None:
        if packed and not can_pack:
            raise ValueError("packed: this backend builds no packed rows (can_pack is False)")
        self.packed = packed
        self.can_pack = can_pack
        self.choice: RowsChoice | None = None
        self.forcing: bool | None = None  # set by :meth:`forced` while it lasts

    @property
    def undecided(self) -> bool:
        """Auto and not chosen yet (the packing trial measures it)."""
        return self.packed is None

    def packs(self) -> bool:
        """Whether the next forward runs in packed rows."""
        return self.forcing if self.forcing is not None else self.packed is True

    def choose(self, choice: RowsChoice) -> RowsChoice:
        """Take ``choice`` for every later forward (only where undecided: a configured True or False stays)."""
        if choice.packed and not self.can_pack:
            raise ValueError("rows: this backend builds no packed rows; a packed choice cannot be taken")
        if self.undecided:
            self.packed, self.choice = choice.packed, choice
        return choice

    @contextlib.contextmanager
    def forced(self, packed: bool) -> Iterator[None]:
        """Forwards in packed (True) or padded rows while the context lasts, whatever :attr:`packed` says (the trial
        that times the two)."""
        if packed and not self.can_pack:
            raise ValueError("rows: this backend builds no packed rows; they cannot be forced")
        before, self.forcing = self.forcing, packed
        try:
            yield
        finally:
            self.forcing = before


class PolicyBackend(Protocol):
    layout: ParallelLayout
    """This process's place in the tensor- and data-parallel layout."""

    model: nn.Module
    """The module it trains: the Hugging Face causal LM, or this rank's Megatron ``GPTModel`` shard."""

    rows: RowLayout
    """Whether its training and scoring forwards run in padding-free rows: configured, or measured faster on this CPU,
    forward and backward (``trainer.ppo.use_remove_padding``; engine/step/packing_trial.py)."""

    scores_itself: bool
    """True for a policy trained apart from any Hugging Face module (Megatron shards): it scores rows itself
    (:meth:`response_logprobs`, :meth:`prefix_logprobs`) and the rescorer goes through it; False: the rescorer scores
    with :attr:`model` directly."""

    def response_logprobs(
        self,
        input_ids: Tensor,  # [B, T]
        attention_mask: Tensor,  # [B, T]
        response_length: int,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        grad: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """([B, L] fp32 log-probs of the response tokens, [B, L] entropy or None)."""
        ...

    def prefix_logprobs(
        self,
        prompt_ids_SP: Tensor,
        prompt_mask_SP: Tensor,
        row_prompt_R: Tensor,
        resp_ids_RL: Tensor,
        resp_mask_RL: Tensor,
        *,
        temperature: float,
        with_entropy: bool = False,
        max_tokens: int = 16384,
        max_pack_tokens: int | None = None,
    ) -> tuple[Tensor, Tensor | None, dict]:
        """Rows scored in packed sequences behind one copy of their prompt ([R, L] log-probs, [R, L] entropy or None,
        token counts). Only where :attr:`scores_itself` (engine/policy/megatron/scoring.py)."""
        ...

    supports_fused_loss: bool
    """Whether ``response_loss`` is available (the trainer falls back to ``response_logprobs`` otherwise)."""

    def response_loss(
        self,
        input_ids: Tensor,  # [B, T]
        attention_mask: Tensor,  # [B, T]
        response_length: int,
        loss_fn: Callable[[Tensor, Tensor | None], Tensor],
        *,
        loss_fill: Tensor | None = None,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """Training forward through the fused head loss: ([B, L] log-probs, [B, L] entropy or None, a zero-valued
        scalar carrying the gradient of ``loss_fn(logp_BL, ent_BL)``, a sum of per-token terms)."""
        ...

    def optimizer_step(self, max_grad_norm: float) -> dict:
        """Clip, step, zero grads. Returns {"grad_norm": float, "skipped": bool}; a non-finite norm skips."""
        ...

    def zero_grad(self) -> None: ...

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Skip the data-parallel gradient reduction (every micro-batch of an update but the last)."""
        ...

    # -- weights and checkpoints: everything the trainer, evaluation and the checkpoint call ----------------------

    hf_config: Any
    """The model's Hugging Face config (written beside exported weights as ``config.json``)."""

    adapter: LoraAdapter | None
    """The policy's LoRA adapters (trained alone, checkpointed alone, disabled
    for the reference model), or None for a full fine-tune."""

    hf_model: Any
    """The Hugging Face module holding the full weights (the one Hugging Face generation samples from): the Hugging
    Face backend's own model; for a sharded backend a full copy where the run keeps one, else None."""

    def hf_state_dict(self) -> dict[str, Tensor]:
        """Full weights in Hugging Face layout, on every rank (for checkpoints and exports)."""
        ...

    def load_hf_state_dict(self, state: dict[str, Tensor]) -> None:
        """Load full Hugging Face weights in place (each rank keeps its shard); fp32 master weights follow them.
        ValueError names the weights that do not match the model."""
        ...

    def optimizer_state(self) -> dict[str, Any]:
        """Optimizer, learning-rate schedule and step counters for a plain checkpoint (gathered over the
        tensor-parallel group; identical on every rank). Tensors and JSON values only (checkpoint/statefile.py)."""
        ...

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`optimizer_state`'s state (after :meth:`load_hf_state_dict`); ValueError when it was
        written by another backend or layout."""
        ...

    sharded_checkpoint: bool
    """True: checkpoints hold this backend's own sharded state (:meth:`save_checkpoint` / :meth:`load_checkpoint`,
    with a Hugging Face export only when asked); False: the gathered weights and :meth:`optimizer_state`."""

    def local_state(self) -> dict[str, Tensor]:
        """This rank's own weights (its shards), checked for NaN/inf before a sharded save."""
        ...

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Sharded save into the folder ``path`` with its own manifest; collective (every rank, the same path).
        Only when :attr:`sharded_checkpoint`."""
        ...

    def load_checkpoint(self, path: str | os.PathLike, *, verify: bool = True) -> None:
        """Load a folder :meth:`save_checkpoint` wrote (``verify=False``: its manifest was just verified)."""
        ...

    def hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The full weights in Hugging Face layout as (name, tensor) pairs, for pushing into the generation engine;
        a sharded backend yields them only where an engine runs (collective there: every rank iterates it)."""
        ...
