"""Pre-flight check of a run: what the config names must exist on this machine, before anything heavy loads.

:func:`preflight` runs after the config has loaded (types, ranges and cross-section rules are checked there,
engine/config/schema.py) and before the trainer builds its components. It checks, each failure a ConfigError naming
the key:

* the device: ``trainer.device: cuda`` needs CUDA, and under torchrun every local rank needs its own GPU;
* the launch: a tensor-parallel backend (``policy.backend: megatron``) needs torchrun's distributed
  environment, and the world size must be a multiple of ``policy.tensor_parallel_size``;
* paths that must exist: the model and tokenizer (a local Hugging Face directory, a Hugging Face id in the
  local cache, or an embedded name, resolved as engine/models/loading.py resolves them but without building the
  embedded caches), the thinking encoder (as engine/models/encoder.py resolves it), ``env.data_dir``;
* ``env.options``: every key must be an option of the environment (:func:`env_option_names`), keys the
  env section sets itself (``max_steps`` is ``env.max_turns``, ...) are refused there, and the environment's own
  check of its options runs (its registry entry's ``check_options``: Search's retriever token and CA file);
* ``env.require_official_data`` (the paper profiles): the benchmark's official files must be where the
  environment's loader looks for them (its registry entry's ``official_data``: engine/envs/<family>/official.py),
  since the loaders otherwise fall back to generated games, catalogue or knowledge base without a word; the messages
  name the missing file or folder, the config key or environment variable that points to it, and the README
  section that explains where it comes from;
* the experiment trackers of ``trainer.logging.loggers`` (wandb, mlflow) can start: engine/config/logger_check.py.

It imports torch and the environment's module; it loads no model.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from pathlib import Path

from alignopsd.engine.config.errors import README_HINT
from alignopsd.engine.config.logger_check import check_loggers
from alignopsd.engine.config.schema import ConfigError, RunConfig
from alignopsd.engine.envs.manager import EnvManager
from alignopsd.engine.envs.official import OfficialDataQuery
from alignopsd.engine.envs.registry import env_names, get_entry, resolve
from alignopsd.engine.models import loading as models
from alignopsd.engine.models.encoder import MINILM, minilm_path

from alignopsd.estimators import get_estimator

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def check_device(cfg: RunConfig, env: Mapping[str, str]) -> None:
    import torch

    if cfg.trainer.device != "cuda":
        return
    if not torch.cuda.is_available():
        raise ConfigError("trainer.device: 'cuda' requested but CUDA is not available on this machine")
    local_rank, count = int(env.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(f"trainer.device: local rank {local_rank} needs GPU {local_rank}, this machine has {count}")


def check_launch(cfg: RunConfig, env: Mapping[str, str]) -> None:
    world = int(env.get("WORLD_SIZE", "1"))
    if world > 1 and any(v not in env for v in TORCHRUN_VARS):
        missing = [v for v in TORCHRUN_VARS if v not in env]
        raise ConfigError(f"WORLD_SIZE={world} without the rest of torchrun's environment (missing {missing})")
    if cfg.policy.backend == "megatron":
        missing = [v for v in TORCHRUN_VARS if v not in env]
        if missing:
            raise ConfigError(
                "policy.backend: 'megatron' needs the distributed environment torchrun sets up (missing "
                f"{', '.join(missing)}); launch with `torchrun --nproc_per_node=N -m alignopsd.engine train ...`"
            )
    tp = cfg.policy.tensor_parallel_size
    if world % tp:
        raise ConfigError(f"policy.tensor_parallel_size: {tp} does not divide the number of processes {world}")


def check_model_spec(key: str, spec: str, hint: str = "") -> None:
    """A model or tokenizer spec resolves locally (embedded names are checked without building their caches);
    ``hint`` is appended to the message."""

    low = spec.strip().lower()
    try:
        if low == models.TINY:
            return
        if low == models.SMOLLM2:
            models.smollm2_gguf_path()
            return
        models.resolve_model_path(spec)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"{key}: {exc}{hint}") from None


def check_encoder(spec: str, hint: str = "") -> None:

    try:
        if spec.lower() in (MINILM, "minilm"):
            minilm_path()
            return
        if Path(os.path.expanduser(spec)).is_dir():
            return
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"encoder.name: {exc}{hint}") from None
    check_model_spec("encoder.name", spec, hint)


# EnvManager keyword arguments that the env section sets itself (engine/step/recipe.py build_components)
SET_BY_ENV_SECTION = {
    "env_name": "env.name",
    "num_workers": "env.workers",
    "step_timeout": "env.step_timeout_s",
    "history_length": "env.history_length",
    "max_steps": "env.max_turns",
    "data_dir": "env.data_dir",
}
# options the environment manager hands to the task source rather than to the environment (EnvManager.task_source)
TASK_OPTIONS = ("cache_dir",)


def _named_params(fn) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds and p.name != "self"]


def env_option_names(env_name: str) -> list[str]:
    """Keys ``env.options`` may hold for ``env_name``: the named keyword arguments of its factory, the
    environment manager's own tuning arguments, and the task-source options the manager forwards. (The built-in
    factories swallow unknown keywords, so a misspelt option would otherwise be ignored without a word.)"""

    entry = get_entry(env_name)
    names = set(_named_params(resolve(entry.factory))) | set(_named_params(EnvManager.__init__))
    names |= set(TASK_OPTIONS) & set(_named_params(resolve(entry.tasks)))
    return sorted(names - set(SET_BY_ENV_SECTION))


def check_env_options(cfg: RunConfig, env: Mapping[str, str] | None = None) -> None:
    """The keys of ``env.options`` (:func:`env_option_names`), then the environment's own check of their values."""
    allowed = env_option_names(cfg.env.name) if cfg.env.options else []
    for k in cfg.env.options or {}:
        if k in SET_BY_ENV_SECTION:
            raise ConfigError(f"env.options.{k}: set by {SET_BY_ENV_SECTION[k]}, not through env.options")
        if k not in allowed:
            raise ConfigError(
                f"env.options.{k}: unknown option of environment {cfg.env.name!r}; allowed: {', '.join(allowed)}"
            )
    check = get_entry(cfg.env.name).check_options
    if check is not None:
        try:
            resolve(check)(dict(cfg.env.options or {}), os.environ if env is None else env)
        except ValueError as exc:
            raise ConfigError(f"env {cfg.env.name!r}: {exc}") from None


def preflight(cfg: RunConfig, env: Mapping[str, str] | None = None) -> None:
    """Every check of this module; ConfigError on the first failure."""
    env = os.environ if env is None else env
    hint = f" ({README_HINT})" if cfg.env.require_official_data else ""
    check_launch(cfg, env)
    check_device(cfg, env)
    check_model_spec("model.name", cfg.model.name, hint)
    if cfg.model.tokenizer:
        check_model_spec("model.tokenizer", cfg.model.tokenizer, hint)

    if get_estimator(cfg.algorithm.estimator).phases(cfg.algorithm).alignment:  # the encoder of Mechanism 1
        check_encoder(cfg.encoder.name, hint)
    if cfg.env.data_dir and not Path(cfg.env.data_dir).expanduser().exists():
        raise ConfigError(f"env.data_dir: no such directory {cfg.env.data_dir!r}{hint}")
    check_env_options(cfg, env)
    if cfg.env.require_official_data:
        check_official_data(cfg, env)
    check_loggers(cfg.trainer, cfg.out_dir, env)


# ------------------------------------------------------------------------------------------ official data
# Each environment's check (engine/envs/<family>/official.py) mirrors where its task loader looks and raises a
# ConfigError where that loader would instead generate its data (or fail later, after the models loaded).


def check_official_data(cfg: RunConfig, env: Mapping[str, str]) -> None:
    """The environment's own official-data check (its registry entry's ``official_data``)."""
    entry = get_entry(cfg.env.name)
    if entry.official_data is None:
        having = [n for n in env_names() if get_entry(n).official_data is not None]
        raise ConfigError(
            f"env.require_official_data: environment {cfg.env.name!r} has no official data; "
            f"it applies to {', '.join(having)}"
        )
    splits = tuple(dict.fromkeys((cfg.env.split, cfg.env.val_split)))  # the splits the run reads, each once
    resolve(entry.official_data)(OfficialDataQuery(cfg.env.data_dir, splits, dict(cfg.env.options)), env)
