"""The step's sampling parts once per tensor-parallel group: the group's first rank samples, the others receive what
it produced (the broadcast itself: engine/parallel/tp_broadcast.py).

    rollout (student generation + environments + episode metrics)  -> :func:`group_rollout`
    teacher generation and thinking encoding of the teacher pass     -> :func:`group_sampling`

The other ranks never generate (they hold no generation engine: ``run/components.build_generator``), never step an
environment during training and never load the thinking encoder. Without tensor parallelism (no group, or a group
of one) both are the plain call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import torch
from alignopsd.engine.generation.base import GenerationBackend, GenerationOutput, SamplingParams
from alignopsd.engine.models.encoder import TextEncoder
from alignopsd.engine.parallel.tp_broadcast import broadcast_from_lead, is_group_lead, tp_layout
from alignopsd.engine.policy.base import PolicyBackend
from alignopsd.engine.step.components import Components
from torch import Tensor

T = TypeVar("T")


def group_rollout(parts: Components, run: Callable[[], T]) -> T:
    """The rollout phase once per tensor-parallel group: ``run()`` (returning the turn batch and its metrics) on
    the group's first rank, broadcast to the others."""
    return broadcast_from_lead(parts.policy, run)


class LeadGenerator:
    """A generation backend for the duration of a teacher pass: the group's first rank generates with the real
    backend (``inner``; None on the other ranks, which hold none), every rank returns its output. The ranks of the
    group call it with the same prompts (their batches are the group's one batch), so the calls line up."""

    # it hands every rank the lead's output: no module sampled on this rank, no prompt cache kept for it
    model = None
    keeps_prompt_cache: bool = False

    def __init__(self, inner: GenerationBackend | None, policy: PolicyBackend) -> None:
        self.inner = inner
        self.policy = policy

    # no limit checked here: the lead's backend checks its own, and its error reaches every rank of the group
    max_model_len: int = 1 << 62

    @property
    def eos_token_ids(self) -> set[int]:
        """The real backend's on the lead; empty elsewhere (only the lead builds rollouts)."""
        return set() if self.inner is None else set(self.inner.eos_token_ids)

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, *, keep_prompt_cache: bool = False
    ) -> GenerationOutput:
        """The lead's output on every rank (``keep_prompt_cache`` is ignored: the cache would be the lead's)."""
        return broadcast_from_lead(self.policy, lambda: self.inner.generate(prompts, sampling))

    def load_weights(self, state_dict) -> None:
        if self.inner is None:
            raise ValueError("generator: this rank holds no generation engine (weights go through sync_weights)")
        self.inner.load_weights(state_dict)

    def sleep(self) -> None:
        """The group's engine (on its first rank) gives back its memory (see ``Components.release_generation``)."""
        if self.inner is not None:
            self.inner.sleep()

    def close(self) -> None:
        """The wrapper holds nothing: the run closes the real backend."""

    def prefill_counts(self) -> dict[str, int]:
        """The real backend's counts on the lead; empty elsewhere (only the lead's metrics are written)."""
        return {} if self.inner is None else self.inner.prefill_counts()


class LeadEncoder:
    """The thinking encoder for the duration of a teacher pass: the group's first rank encodes with the real
    encoder (``inner``; loaded there only, None elsewhere), every rank gets the embeddings and validity on
    ``device``."""

    def __init__(self, inner: TextEncoder | None, policy: PolicyBackend, device: torch.device) -> None:
        self.inner = inner
        self.policy = policy
        self.device = device

    def encode(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        emb, valid = broadcast_from_lead(self.policy, lambda: self.inner.encode(texts))
        return emb.to(self.device), valid.to(self.device)


def group_sampling(parts: Components) -> Components:
    """The parts of a teacher pass: a copy of ``parts`` (not changed) whose teacher generation and thinking encoding
    run once per tensor-parallel group (see the module docstring); ``parts`` itself without tensor parallelism.
    Loads the encoder on the group's first rank."""
    if tp_layout(parts.policy)[0] is None:
        return parts
    encoder = parts.get_encoder() if is_group_lead(parts.policy) else parts.encoder
    return dataclasses.replace(
        parts,
        generator=LeadGenerator(parts.generator, parts.policy),
        encoder=LeadEncoder(encoder, parts.policy, parts.device),
    )
