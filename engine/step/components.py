"""What a step is handed: the run's parts (config, policy, generator, environments, encoder, scorers, profiler,
audit), built by the composition root (engine/run/components.py) and read, never changed, by the step."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from alignopsd.engine.config.schema import RunConfig
from alignopsd.engine.envs.base import TaskSpec
from alignopsd.engine.envs.manager import EnvManager
from alignopsd.engine.generation.base import GenerationBackend, samples_from
from alignopsd.engine.models.encoder import TextEncoder
from alignopsd.engine.observe.profiler import StepProfiler
from alignopsd.engine.observe.strict import reraise_if_strict
from alignopsd.engine.parallel.tp_broadcast import share_lead_outcome, tp_layout
from alignopsd.engine.policy.base import PolicyBackend
from alignopsd.engine.step.rescoring import Rescorer
from alignopsd.engine.tokens.tokenizer import Tokenizer

from alignopsd.estimators import EstimatorSpec

if TYPE_CHECKING:
    from alignopsd.engine.observe.audit import Auditor
    from torch.distributed import ProcessGroup

log = logging.getLogger("alignopsd.components")


@dataclass(frozen=True)
class Components:
    """Everything a step needs, built once per run (engine/run/components.py: ``build_components``), never changed
    after: a phase that needs other parts (the teacher pass under tensor parallelism, the validation pass's own
    profiler) works on a copy, ``dataclasses.replace(parts, ...)``."""

    cfg: RunConfig
    device: torch.device
    rank: int  # data-parallel rank (the ranks of one tensor-parallel group share it)
    world_size: int  # data-parallel size
    tokenizer: Tokenizer  # the policy's (a Hugging Face tokenizer)
    policy: PolicyBackend
    generator: GenerationBackend | None  # None on tensor-parallel ranks other than their group's first
    env: EnvManager
    train_tasks: list[TaskSpec]
    val_tasks: list[TaskSpec]
    estimator: EstimatorSpec
    rescorer: Rescorer | None = None
    ref_scorer: Rescorer | None = None
    encoder: TextEncoder | None = None
    profiler: StepProfiler = field(default_factory=StepProfiler)
    dp_group: ProcessGroup | None = None  # data-parallel process group (None: the default group)
    audit: Auditor | None = None  # the run's audit records (set by the trainer; None: no audit records)
    encoder_factory: Callable[[], TextEncoder] | None = None
    skill_lookup: Callable[[dict], str] | None = None  # env.skills_dir's bank (None: the packaged bank)
    update_tokens: int = 0  # positions per micro-batch of the update (0: fixed rows; run/policy_builders.py)

    def __post_init__(self) -> None:
        if self.encoder_factory is not None:  # one encoder per run however often it is asked for (and copies share it)
            object.__setattr__(self, "encoder_factory", functools.cache(self.encoder_factory))

    def get_encoder(self) -> TextEncoder:
        """The thinking encoder, loaded on first use (estimators without alignment never load it)."""
        if self.encoder is not None:
            return self.encoder
        if self.encoder_factory is None:
            raise ValueError("encoder: this run's estimator declares no alignment phase, so no encoder was built")
        return self.encoder_factory()

    def sync_weights(self) -> None:
        """Push the policy's weights into the generation engine (no-op when it samples from the trained module).

        Under tensor parallelism every rank of the group calls it: the weights are gathered one conversion part at
        a time to the group's first rank, the only one with a generator (``policy.hf_weights``), and the other
        ranks only send their shards."""
        if samples_from(self.generator, self.policy.model):
            return
        weights = self.policy.hf_weights()
        if tp_layout(self.policy)[0] is None:
            if self.generator is not None:
                self.generator.load_weights(weights)
            return
        # tensor parallelism: the first rank's loading may fail part-way (out of memory, a bad name); it still
        # takes part in the group's remaining gathers, then every rank learns the outcome and raises with it
        error: BaseException | None = None
        try:
            if self.generator is not None:
                self.generator.load_weights(weights)
        except Exception as exc:  # noqa: BLE001 - shared with the group below, then raised
            error = exc
        try:
            left = sum(1 for _ in weights)  # the group's remaining gathers (all of them on a rank without a generator)
        except Exception as exc:  # noqa: BLE001 - a conversion failure on the first rank, raised after the gathers
            error, left = error or exc, 0
        if error is None and left and self.generator is not None:
            error = RuntimeError(
                f"generator: {type(self.generator).__name__}.load_weights left {left} weights of the sync unread "
                "(a weight sync must load every weight it is given)"
            )
        share_lead_outcome(self.policy, error)

    def release_generation(self) -> None:
        """A generation phase ended, the training phases follow: the generation engine gives back its accelerator
        memory (weights and KV cache) until it generates or receives weights again (vLLM's sleep mode; a no-op for
        an engine without one)."""
        if self.generator is not None:
            self.generator.sleep()

    def close(self) -> None:
        close_all([self.env, self.generator])


def close_all(objs) -> None:
    """Close each of ``objs`` (an environment manager, a generator; None skipped); a failure to close is logged, not
    raised (shutdown must not mask the run's result), except in strict mode."""
    for obj in objs:
        if obj is None:
            continue
        try:
            obj.close()
        except Exception as exc:  # noqa: BLE001 - shutdown must not mask the run's result
            reraise_if_strict(exc)
            log.warning("close %s: %s", type(obj).__name__, exc)
