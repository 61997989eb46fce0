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
* ``env.options``: every key must be an option of the environment (:func:`env_option_names`), and keys the
  env section sets itself (``max_steps`` is ``env.max_turns``, ...) are refused there;
* ``env.require_official_data`` (the paper profiles): the benchmark's official files must be where the
  environment's loader looks for them (:data:`OFFICIAL_DATA_CHECKS`, one function per environment), since the
  loaders otherwise fall back to generated games, catalogue or knowledge base without a word; the messages
  name the missing file or folder, the config key or environment variable that points to it, and the README
  section that explains where it comes from.

It imports torch and the environment's module; it loads no model.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from pathlib import Path

from alignopsd.engine.config.schema import ConfigError, RunConfig
from alignopsd.engine.envs.alfworld.env import SPLITS as ALFWORLD_SPLITS
from alignopsd.engine.envs.manager import EnvManager
from alignopsd.engine.envs.registry import get_entry, resolve
from alignopsd.engine.envs.search.retriever import URL_ENV_VAR
from alignopsd.engine.envs.webshop.env import find_original_files
from alignopsd.engine.models import loading as models
from alignopsd.engine.models.encoder import MINILM, minilm_path

from alignopsd.estimators import get_estimator

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
README_HINT = 'see README.md, "Running the paper\'s experiments"'
ALFWORLD_DEFAULT_DATA = "~/.cache/alfworld"  # where alfworld (alfworld.info) and alfworld-download put the data


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


def check_env_options(cfg: RunConfig) -> None:
    if not cfg.env.options:
        return
    allowed = env_option_names(cfg.env.name)
    for k in cfg.env.options:
        if k in SET_BY_ENV_SECTION:
            raise ConfigError(f"env.options.{k}: set by {SET_BY_ENV_SECTION[k]}, not through env.options")
        if k not in allowed:
            raise ConfigError(
                f"env.options.{k}: unknown option of environment {cfg.env.name!r}; allowed: {', '.join(allowed)}"
            )


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
    check_env_options(cfg)
    if cfg.env.require_official_data:
        check_official_data(cfg, env)


# ------------------------------------------------------------------------------------------ official data
# Each function mirrors where the environment's task loader looks (engine/envs/*: load_tasks) and raises a
# ConfigError where that loader would instead generate its data (or fail later, after the models loaded).


def _official_error(what: str, fix: str) -> ConfigError:
    return ConfigError(f"env.require_official_data: {what}; {fix} ({README_HINT})")


def alfworld_official_data(data_dir: str | None, splits: tuple[str, ...], env: Mapping[str, str]) -> Path:
    """The ALFWorld data root the loader will read: ``env.data_dir``, else ``$ALFWORLD_DATA``
    (engine/envs/alfworld/env.py official_data_dir), holding ``json_2.1.1/<split>/`` games of each split."""

    where = "env.data_dir" if data_dir else "ALFWORLD_DATA"
    raw = data_dir or env.get("ALFWORLD_DATA")
    layout = "json_2.1.1/{train,valid_seen,valid_unseen}/<task>/<trial>/game.tw-pddl, as `alfworld-download` writes it"
    if not raw:
        default = Path(ALFWORLD_DEFAULT_DATA).expanduser()
        if (default / "json_2.1.1").is_dir():
            raise _official_error(
                f"ALFWorld's data is in alfworld's default folder {default}, but neither env.data_dir nor "
                "ALFWORLD_DATA is set, so the run would train on generated games",
                f"export ALFWORLD_DATA={default} or set env.data_dir",
            )
        raise _official_error(
            "ALFWorld's official data not found (env.data_dir and ALFWORLD_DATA are unset)",
            f"run `alfworld-download` (it fills {ALFWORLD_DEFAULT_DATA}, or $ALFWORLD_DATA when set), then point "
            f"ALFWORLD_DATA or env.data_dir at the folder holding {layout}",
        )
    root = Path(raw).expanduser()
    if not (root / "json_2.1.1").is_dir():
        raise _official_error(
            f"{where}={raw} has no json_2.1.1 folder", f"point {where} at the folder holding {layout}"
        )
    for split in splits:
        folder = root / "json_2.1.1" / split
        if split in ALFWORLD_SPLITS and next(folder.glob("*/*/game.tw-pddl"), None) is None:
            raise _official_error(
                f"no ALFWorld games of split {split!r} in {folder}", f"{where} must hold the full download ({layout})"
            )
    return root


def webshop_official_data(data_dir: str | None) -> dict[str, str]:
    """WebShop's original files in ``env.data_dir`` (engine/envs/webshop/env.py find_original_files): products
    ``items_shuffle*.json``, instruction attributes ``items_ins_v2*.json`` and human instructions
    ``items_human_ins*.json``."""

    files = "items_shuffle.json, items_ins_v2.json and items_human_ins.json from WebShop's setup.sh -d all"
    if not data_dir:
        raise _official_error(
            "env.data_dir is unset, so the run would train on the generated catalogue",
            f"set env.data_dir to the folder holding {files}",
        )
    try:
        found = find_original_files(Path(data_dir).expanduser())
    except ValueError as exc:
        raise _official_error(str(exc), f"env.data_dir must hold {files}") from None
    names = {"attributes": "items_ins_v2*.json", "human_goals": "items_human_ins*.json"}
    for key, pattern in names.items():
        if found[key] is None:
            raise _official_error(f"env.data_dir: no {pattern} in {data_dir}", f"env.data_dir must hold {files}")
    return {k: str(v) for k, v in found.items()}


def search_official_data(
    data_dir: str | None, splits: tuple[str, ...], options: Mapping[str, object], env: Mapping[str, str]
) -> dict[str, str]:
    """Search-R1's ``<split>.parquet`` files in ``env.data_dir`` (engine/envs/search/env.py load_tasks) and a
    retriever for its corpus: ``env.options.retriever_url`` (a Search-R1 ``/retrieve`` server),
    ``env.options.corpus_path`` (the corpus jsonl; the engine serves it), or ``$ALIGNOPSD_RETRIEVER_URL``."""

    if not data_dir:
        raise _official_error(
            "env.data_dir is unset, so the run would train on the generated knowledge base",
            "set env.data_dir to the folder holding Search-R1's train.parquet and test.parquet",
        )
    out: dict[str, str] = {}
    for split in splits:
        path = Path(data_dir).expanduser() / f"{split}.parquet"
        if not path.is_file():
            raise _official_error(
                f"env.data_dir: no {split}.parquet in {data_dir}",
                "env.data_dir must hold the train.parquet and test.parquet that Search-R1's "
                "scripts/data_process/qa_search_{train,test}_merge.py write",
            )
        out[split] = str(path)
    url, corpus = options.get("retriever_url"), options.get("corpus_path")
    retriever = "set env.options.retriever_url to a running Search-R1 retrieval server, or env.options.corpus_path"
    if corpus is not None:
        if not Path(str(corpus)).expanduser().is_file():
            raise _official_error(f"env.options.corpus_path: no such file {corpus}", retriever)
        out["corpus_path"] = str(corpus)
    elif url == "local" or not (url or env.get(URL_ENV_VAR)):
        raise _official_error("no retriever for the Search-R1 corpus", f"{retriever} to its corpus jsonl")
    if url and url != "local":
        if not str(url).startswith(("http://", "https://")):
            raise _official_error(f"env.options.retriever_url: expected an http(s) URL, got {url!r}", retriever)
        out["retriever_url"] = str(url)
    return out


OFFICIAL_DATA_CHECKS = {
    "alfworld": lambda cfg, env: alfworld_official_data(cfg.env.data_dir, _splits(cfg), env),
    "webshop": lambda cfg, env: webshop_official_data(cfg.env.data_dir),
    "search": lambda cfg, env: search_official_data(cfg.env.data_dir, _splits(cfg), cfg.env.options, env),
}


def _splits(cfg: RunConfig) -> tuple[str, ...]:
    return tuple(dict.fromkeys((cfg.env.split, cfg.env.val_split)))


def check_official_data(cfg: RunConfig, env: Mapping[str, str]) -> None:
    check = OFFICIAL_DATA_CHECKS.get(cfg.env.name)
    if check is None:
        raise ConfigError(
            f"env.require_official_data: environment {cfg.env.name!r} has no official data; "
            f"it applies to {', '.join(OFFICIAL_DATA_CHECKS)}"
        )
    check(cfg, env)
