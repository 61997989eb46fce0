"""Resume checks: the run's config against the config stored with the checkpoint.

Every checkpoint stores the resolved config of its run (``trainer_state.json`` → ``run_config``, the algorithm
section included). Resuming compares it key by key with the config of the new run:

* changes that do not alter the trajectory of training are allowed and listed: the run's name and output directory,
  save cadence and retention, logging and report switches (``trainer.logging.loggers`` and its sections), how restarts
  wait and stop (``trainer.restarts``), validation
  before/after training, environment workers and timeouts, ``total_steps`` upward (when no warm-up depends on it), and
  the data-parallel size (the trainer's checkpoint holds full weights and rank 0's optimizer state, a sharded one keys
  its shards by tensor-parallel rank only, so either reshards to any data-parallel size at the same tensor-parallel
  size);
* every other change (model, estimator or any algorithm setting, seed, group size, environment, learning
  rate, tensor-parallel size, ...) is refused with the list of differences, unless the user passes
  ``--allow-config-change``;
* ``total_steps`` below the checkpoint's step is refused in any case (there is nothing to run);
* with changes let through by ``--allow-config-change``, the checkpoint's weights must still fit the configured
  model: names and shapes from the safetensors header against the model built on the ``meta`` device, before
  anything loads (engine/config/arch_check.py), else the first mismatching parameter is named with both shapes;
* a sharded checkpoint (Megatron, torch.distributed.checkpoint) loads only into the model, dtype, backend,
  tensor-parallel size and optimizer sharding it was written with (it reshards over data-parallel ranks only):
  a change of these is refused in any case, ``--allow-config-change`` included (:data:`SHARDED_LAYOUT`); the
  backend checks the model's shapes against the folder's ``layout.json`` again before it reads a shard.

A LoRA checkpoint names its base (``trainer_state.json`` → ``lora_base``: ``model.name`` and the SHA-256 of the base's
weights, engine/policy/lora.py): its adapter only means something over those weights. A resume over another base
(another model, or the same name with other weights: a new revision, another dtype) is refused naming both, unless
``--allow-config-change``; a LoRA checkpoint written before checkpoints named their base resumes with a one-line
warning (:func:`check_lora_base`).

The run's side file ``span_lengths.json`` (the M2 span lengths of every step so far, for the report) is cut back
to the count the checkpoint records (:func:`read_span_lengths`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from alignopsd.engine.checkpoint.checkpoint import resolve_resume
from alignopsd.engine.checkpoint.manifest import ManifestError
from alignopsd.engine.checkpoint.trainer_state import TrainerState, read_trainer_state
from alignopsd.engine.checkpoint.weights import ADAPTER_DIR, ADAPTER_FILE, WEIGHTS_FILE
from alignopsd.engine.config.arch_check import check_architecture
from alignopsd.engine.config.dump import config_to_dict
from alignopsd.engine.config.schema import ConfigError, RunConfig
from alignopsd.engine.config.trainer_section import MlflowConfig, WandbConfig, sectioned
from alignopsd.engine.infra.mappings import flatten_config

# dotted keys whose change leaves the training trajectory as it is
TRAJECTORY_NEUTRAL = frozenset(
    {
        "name",
        "output_dir",
        "trainer.checkpoint.save_freq",
        "trainer.checkpoint.save_every_s",
        "trainer.checkpoint.keep_last",
        "trainer.checkpoint.export_hf_freq",
        "trainer.logging.tensorboard",  # the switch checkpoints of earlier versions store
        "trainer.logging.loggers",
        "trainer.logging.report",
        "trainer.logging.audit",
        "trainer.logging.audit_max_bytes",
        "trainer.validation.before_train",
        "trainer.validation.after_train",
        "trainer.preempt_grace_s",
        "env.workers",
        "env.step_timeout_s",
    }
)
# sections added after checkpoints were first written, with the switch that turns them on: absent from an older
# checkpoint's config they were off, so their keys are no change while the switch stays off
ADDED_SECTIONS = {"model.lora.": "model.lora.enabled"}
# keys added after checkpoints were first written, with the value that runs as before they existed
ADDED_KEYS = {"generation.quantize": "off", "trainer.checkpoint.save_every_s": None}
# keys added after checkpoints were first written that only divide the same work another way (the objective is the
# same exact token-mean; sums may round differently), with the values that divide it as before: absent from an older
# checkpoint's config, those are no change and any other is shown, not refused; a change between two stored values is
# refused like any other
ADDED_DIVISIONS = {
    "trainer.ppo.max_token_len_per_gpu": (0, None),
    "trainer.ppo.use_remove_padding": (False,),
    "trainer.ppo.activation_memory_gib": (None,),
}
NEUTRAL_SECTIONS = (
    "trainer.logging.wandb.",
    "trainer.logging.mlflow.",
    "trainer.restarts.",
)  # loggers, restarts: every key under
# neutral sections added after checkpoints were first written: absent from an older checkpoint's config, not listed
ADDED_NEUTRAL_SECTIONS = ("trainer.restarts.",)
WORLD_SIZE_KEY = "world_size (data-parallel ranks)"
# dotted keys a sharded checkpoint cannot be loaded across (its shards have this model's shapes and this layout)
SHARDED_LAYOUT = frozenset(
    {"model.name", "model.dtype", "policy.backend", "policy.tensor_parallel_size", "policy.distributed_optimizer"}
)


class ResumeConfigError(ConfigError):
    """The config of a resumed run differs from the checkpoint's in a way that alters training."""


def stored_config(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as stored with a checkpoint (JSON values)."""
    return json.loads(json.dumps(config_to_dict(cfg), default=str))


def with_loggers(saved: dict[str, Any]) -> dict[str, Any]:
    """A config stored by an earlier version, as this version stores it (so a resume compares like with like): its
    flat trainer keys in their sections (engine/config/trainer_section.py ``sectioned``) and, stored before
    ``trainer.logging.loggers`` existed, its ``trainer.tensorboard`` switch as the loggers list, the trackers'
    sections at their defaults."""
    trainer = saved.get("trainer")
    if not isinstance(trainer, dict):
        return saved
    trainer = sectioned(trainer)
    logging = trainer.get("logging", {})
    if isinstance(logging, dict) and "loggers" not in logging:
        logging = dict(logging)
        on = logging.pop("tensorboard", True)
        logging["loggers"] = ["jsonl", "tensorboard"] if on else ["jsonl"]
        logging.setdefault("wandb", json.loads(json.dumps(config_to_dict(WandbConfig()))))
        logging.setdefault("mlflow", json.loads(json.dumps(config_to_dict(MlflowConfig()))))
        trainer = {**trainer, "logging": logging}
    return {**saved, "trainer": trainer}


def config_changes(
    saved: dict[str, Any], current: dict[str, Any], *, step: int, saved_world: int = 1, world: int = 1
) -> tuple[list[str], list[str]]:
    """(changes that alter training, changes that do not), each as ``"key: old -> new"`` lines."""
    old, new = flatten_config(saved), flatten_config(current)
    blocking: list[str] = []
    neutral: list[str] = []
    missing = object()
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, missing), new.get(key, missing)
        if a == b:
            continue
        line = f"{key}: {'(absent)' if a is missing else repr(a)} -> {'(absent)' if b is missing else repr(b)}"
        if key == "trainer.total_steps" and isinstance(a, int) and isinstance(b, int):
            warm = float(new.get("trainer.optimizer.warmup_ratio", 0.0) or 0.0)
            if b >= step and (warm == 0.0 or round(warm * a) == round(warm * b)):
                neutral.append(line)
                continue
            line += " (changes the warm-up length)"
        if a is missing and any(key.startswith(sec) and new.get(on) is False for sec, on in ADDED_SECTIONS.items()):
            continue
        if a is missing and key.startswith(ADDED_NEUTRAL_SECTIONS):
            continue
        if a is missing and key in ADDED_KEYS and b == ADDED_KEYS[key]:
            continue
        if a is missing and key in ADDED_DIVISIONS:
            if b not in ADDED_DIVISIONS[key]:
                neutral.append(f"{line} (the same objective divided another way; sums may round differently)")
            continue
        (neutral if key in TRAJECTORY_NEUTRAL or key.startswith(NEUTRAL_SECTIONS) else blocking).append(line)
    if saved_world != world:
        neutral.append(f"{WORLD_SIZE_KEY}: {saved_world} -> {world}")
    return blocking, neutral


def check_resume(
    path: str | os.PathLike, cfg: RunConfig, *, world_size: int = 1, allow_changes: bool = False
) -> list[str]:
    """Compare ``cfg`` with the config stored in checkpoint ``path``; returns the lines describing the allowed
    changes (to be shown), raises ResumeConfigError listing those that alter training (unless
    ``allow_changes``, where they are returned too, marked as overridden)."""
    path = Path(path)
    try:
        state = read_trainer_state(path)
    except ManifestError as exc:
        raise ResumeConfigError(f"--resume: {exc}") from None
    step = state.step
    if cfg.trainer.total_steps < step:
        raise ResumeConfigError(
            f"trainer.total_steps: {cfg.trainer.total_steps} is below the checkpoint's step {step}; nothing would "
            f"be trained (set trainer.total_steps >= {step})"
        )
    saved = state.run_config
    if not isinstance(saved, dict):
        if allow_changes:
            _check_weights_fit(path, cfg, state)
            return [f"{path}: stores no run config; not compared (--allow-config-change)"]
        raise ResumeConfigError(
            f"--resume: {path} stores no run config, so the config cannot be compared; pass --allow-config-change "
            "to resume anyway"
        )
    blocking, neutral = config_changes(
        with_loggers(saved), stored_config(cfg), step=step, saved_world=state.world_size, world=world_size
    )
    fixed = [line for line in blocking if line.split(":", 1)[0] in SHARDED_LAYOUT]
    if state.sharded and fixed:
        listed = "\n  ".join(fixed)
        raise ResumeConfigError(
            f"--resume: {path} is a sharded checkpoint; it loads only into the model and parallel layout it was "
            f"written with (at any data-parallel size), and this run changes:\n  {listed}\nrestore these settings "
            "(--allow-config-change cannot override them), or start a new run from the checkpoint's Hugging Face "
            "export (model.safetensors)"
        )
    if blocking and not allow_changes:
        listed = "\n  ".join(blocking)
        raise ResumeConfigError(
            f"--resume: the config differs from the one checkpoint {path} was trained with, in ways that change "
            f"training:\n  {listed}\nrestore these settings, start a new run (another output_dir), or pass "
            "--allow-config-change to resume with them anyway"
        )
    if blocking:
        _check_weights_fit(path, cfg, state)
    return [f"{line} (overridden: --allow-config-change)" for line in blocking] + neutral


def _check_weights_fit(path: Path, cfg: RunConfig, state: TrainerState) -> None:
    """A resume whose config changes (--allow-config-change): the checkpoint's weights must fit the configured
    model, checked from the safetensors header before any model is built (engine/config/arch_check.py). A sharded
    checkpoint's layout is checked above and by its backend (layout.json)."""
    if not state.sharded and (path / WEIGHTS_FILE).is_file():  # a LoRA checkpoint's adapter is checked when loaded
        check_architecture(path, cfg.model.name, what="--resume: checkpoint")


def prepare_resume(
    cfg: RunConfig,
    resume: str | None,
    *,
    world_size: int = 1,
    allow_changes: bool = False,
    say: Callable[[str], None] | None = None,
) -> tuple[Path | None, list[str]]:
    """Resolve ``--resume`` (verified checkpoints only, with fallback) and check the config against it:
    (checkpoint path or None, lines describing the config changes that are let through)."""
    try:
        path = resolve_resume(resume, cfg.out_dir / "checkpoints", say=say)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if path is None:
        return None, []
    return path, check_resume(path, cfg, world_size=world_size, allow_changes=allow_changes)


def check_lora_base(path: Path, current: dict[str, str] | None, *, allow_changes: bool = False) -> list[str]:
    """A resume's LoRA base (``current``: ``{"model", "digest"}`` of this run's base, None without LoRA) against the
    one checkpoint ``path`` names: the lines to show (a warning for a checkpoint that names none, the override), or
    ResumeConfigError naming both bases."""
    if current is None or not (path / ADAPTER_DIR / ADAPTER_FILE).is_file():  # the load names a kind mismatch
        return []
    stored = read_trainer_state(path).lora_base
    if stored is None:
        return [
            f"[resume] warning: {path} does not name the base its LoRA adapter was trained over (written before "
            f"checkpoints did); resuming over {current['model']} ({current['digest'][:19]}) unchecked"
        ]
    if stored == current:
        return []
    both = (
        f"it was trained over {stored['model']} ({stored['digest'][:19]}) and this run's base is {current['model']} "
        f"({current['digest'][:19]})"
    )
    if not allow_changes:
        raise ResumeConfigError(
            f"--resume: the LoRA adapter of {path} belongs to another base: {both}; resume over the base it was "
            "trained on, or pass --allow-config-change to apply it to this one anyway"
        )
    return [f"[resume] LoRA base: {both} (overridden: --allow-config-change)"]


def read_span_lengths(path: Path, n: int) -> tuple[list[int], str | None]:
    """The first ``n`` span lengths of ``path`` and None, or ([], a warning) when the file is unreadable or short:
    the lengths feed the report only, so a damaged file costs the report's histogram, never the resume."""
    if n == 0:
        return [], None
    try:
        out = [int(x) for x in json.loads(path.read_text())][:n]
    except (OSError, ValueError, TypeError) as exc:
        why = f"unreadable ({exc})"
    else:
        if len(out) == n:
            return out, None
        why = f"holds {len(out)} of the {n} span lengths the checkpoint counts"
    return [], f"[resume] warning: {path} {why}; the report's span histogram starts over"
