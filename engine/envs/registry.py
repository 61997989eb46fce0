"""Environment registry: name -> environment factory, task source and prompt builder.

Entries are ``"module:attribute"`` strings, imported lazily, so a worker process started with the
``spawn`` context resolves the same name without the parent's runtime state. To add an environment,
add one :class:`EnvEntry` to ``_BUILTIN`` (or call :func:`register_env` for code that only runs in
the parent; worker processes then still need the factory importable by its path).

* ``factory(**env_kwargs) -> Environment`` builds one environment instance (inside a worker).
* ``tasks(split, n, seed, **kw) -> list[TaskSpec]`` returns ``n`` tasks of ``split``, seeded
  (``n=None`` or ``n <= 0``: the whole split).
* ``prompt(**kw) -> PromptBuilder`` builds the student prompt builder (kw: ``history_length``).
* ``action_tags``: tag types the manager accepts as actions (``("action",)``; Search:
  ``("search", "answer")``). With more than one tag type, the manager hands the environment the
  action wrapped in its tag (``<search>q</search>``) so the environment knows which it was.
* ``lowercase_actions``: the manager lower-cases the parsed action before stepping (ALFWorld).
* ``admissible_check``: actions not in ``info["admissible_actions"]`` are invalid (ALFWorld, toy).
* ``truncation``: a student prompt longer than ``max_prompt_length`` raises (``"error"``) or keeps its tail
  (``"left"``, Search) (§1.3).
* ``task_pool``: without ``env.data_dir`` the task source takes ``pool_size`` (ALFWorld's generated games: the
  training tasks are drawn from ``env.num_games`` games, the validation tasks from ``env.val_tasks``).
* ``eval_columns``: ``fn(metrics) -> {column: percent or None}``, the evaluation table (``alignopsd eval``).
* ``official_data``: ``fn(query, environ)`` raising ConfigError when the benchmark's official files are not where
  the task source looks (``env.require_official_data``; ``query``: the run's data place and splits,
  engine/envs/official.py ``OfficialDataQuery``; None: the environment has none).
* ``action_rule``: ``fn(source_action, target_action) -> bool``, the environment's pair rule in the teacher pass's
  action filter (``alignopsd.actions.ActionRule``; WebShop: the method's search/click rule of ALGORITHM.md §2.5);
  None: the embedding threshold alone.
* ``skills``: the package whose ``skills/`` folder holds the environment's skill bank (engine/envs/skills.py).
* ``task_info``: ``fn(task) -> dict`` merged into every row's info: what the row metadata and the skill bank read
  of the task's own ``payload`` (ALFWorld: its ``gamefile``); None: nothing.
* ``check_options``: ``fn(options, environ)`` raising ValueError (one line) when ``env.options`` (or the environment
  variables the environment reads with them) cannot work: the pre-flight check, before anything loads (Search: the
  retriever's token and CA file); None: nothing to check beyond the option names.

* ``expert_data``: ``fn(manager, tasks, *, seed, max_turns) -> list[ExpertTurn]``, the warm start's supervised turns:
  expert episodes of ``tasks`` played through the run's ``EnvManager`` (its rendered prompts are the rollout's),
  ``max_turns`` the run's turn limit (ALFWorld: its walkthroughs with searched receptacles); None: the environment
  brings no expert data and ``alignopsd sft`` refuses it.

Everything environment-specific the engine needs is one of these fields: an environment is its folder plus its
entry.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EnvEntry:
    name: str
    factory: str  # "module:attr" -> callable(**env_kwargs) -> Environment
    tasks: str  # "module:attr" -> callable(split, n, seed, **kw) -> list[TaskSpec]
    prompt: str  # "module:attr" -> callable(**kw) -> PromptBuilder
    action_tags: tuple[str, ...] = ("action",)
    lowercase_actions: bool = False
    admissible_check: bool = True
    history_length: int = 2
    truncation: str = "error"  # a prompt over max_prompt_length: "error" raises, "left" keeps its tail (§1.3)
    task_pool: bool = False  # without env.data_dir, ``tasks`` draws from a pool of pool_size generated tasks
    eval_columns: str = "alignopsd.engine.envs.base:success_columns"  # "module:attr" -> fn(metrics) -> table
    official_data: str | None = None  # "module:attr" -> fn(query, environ): env.require_official_data's check
    action_rule: str | None = None  # "module:attr" -> fn(source_action, target_action) -> bool (alignopsd.actions)
    skills: str | None = None  # package whose skills/ folder holds the packaged skill bank (None: none)
    task_info: str | None = None  # "module:attr" -> fn(task) -> dict: what each row carries of its task's payload
    check_options: str | None = None  # "module:attr" -> fn(options, environ): raises ValueError before anything loads
    expert_data: str | None = None  # "module:attr" -> fn(manager, tasks, *, seed, max_turns) -> list[ExpertTurn]


_PKG = "alignopsd.engine.envs"

_BUILTIN: dict[str, EnvEntry] = {
    "alfworld": EnvEntry(
        "alfworld",
        f"{_PKG}.alfworld.env:AlfWorldEnv",
        f"{_PKG}.alfworld.env:load_tasks",
        f"{_PKG}.alfworld.prompt:alfworld_prompt",
        lowercase_actions=True,
        task_pool=True,
        eval_columns=f"{_PKG}.alfworld.env:table_columns",
        official_data=f"{_PKG}.alfworld.official:check_official_data",
        skills=f"{_PKG}.alfworld",
        task_info=f"{_PKG}.alfworld.env:task_info",
        expert_data=f"{_PKG}.alfworld.expert:expert_data",
    ),
    "codeword": EnvEntry(
        "codeword",
        f"{_PKG}.codeword.env:CodewordEnv",
        f"{_PKG}.codeword.env:load_tasks",
        f"{_PKG}.codeword.prompt:codeword_prompt",
        lowercase_actions=True,
        history_length=4,
    ),
    # Credit-assignment family with known decisive turns (bench/credit.py); 8 turns, whole history shown.
    "credit": EnvEntry(
        "credit",
        f"{_PKG}.credit.env:CreditEnv",
        f"{_PKG}.credit.env:load_tasks",
        f"{_PKG}.credit.env:credit_prompt",
        lowercase_actions=True,
        history_length=8,
        skills=f"{_PKG}.credit",
    ),
    # WebShop: free-form search queries, so admissibility is the env's own judgement (info["action_admissible"]).
    "webshop": EnvEntry(
        "webshop",
        f"{_PKG}.webshop.env:WebShopEnv",
        f"{_PKG}.webshop.env:load_tasks",
        f"{_PKG}.webshop.env:webshop_prompt",
        admissible_check=False,
        eval_columns=f"{_PKG}.webshop.env:table_columns",
        official_data=f"{_PKG}.webshop.official:check_official_data",
        action_rule="alignopsd.actions:webshop_actions_agree",
        skills=f"{_PKG}.webshop",
    ),
    "search": EnvEntry(
        "search",
        f"{_PKG}.search.env:SearchEnv",
        f"{_PKG}.search.env:load_tasks",
        f"{_PKG}.search.env:search_prompt",
        action_tags=("search", "answer"),
        admissible_check=False,
        history_length=4,
        truncation="left",
        eval_columns=f"{_PKG}.search.env:table_columns",
        official_data=f"{_PKG}.search.official:check_official_data",
        skills=f"{_PKG}.search",
        check_options=f"{_PKG}.search.env:check_options",
    ),
}

_RUNTIME: dict[str, EnvEntry] = {}


TRUNCATION_MODES = ("error", "left")


def register_env(entry: EnvEntry, *, replace: bool = False) -> None:
    """Register an environment at runtime (refuses duplicates unless ``replace``)."""
    if not isinstance(entry, EnvEntry):
        raise ValueError(f"entry: expected EnvEntry, got {type(entry).__name__}")
    if entry.truncation not in TRUNCATION_MODES:
        raise ValueError(f"entry.truncation: expected one of {TRUNCATION_MODES}, got {entry.truncation!r}")
    if entry.action_rule is not None and not (isinstance(entry.action_rule, str) and ":" in entry.action_rule):
        raise ValueError(f"entry.action_rule: expected None or 'module:attr' of a pair rule, got {entry.action_rule!r}")
    if not replace and (entry.name in _BUILTIN or entry.name in _RUNTIME):
        raise ValueError(f"entry: environment {entry.name!r} is already registered")
    _RUNTIME[entry.name] = entry


def env_names() -> list[str]:
    return sorted(set(_BUILTIN) | set(_RUNTIME))


def get_entry(name: str) -> EnvEntry:
    if not isinstance(name, str):
        raise ValueError(f"env_name: expected str, got {type(name).__name__}")
    if name in _RUNTIME:
        return _RUNTIME[name]
    if name in _BUILTIN:
        return _BUILTIN[name]
    raise ValueError(f"env_name: unknown environment {name!r}; known: {env_names()}")


def resolve(path: str) -> Callable[..., Any]:
    """Import ``"module:attr"`` and return the attribute."""
    if not isinstance(path, str) or ":" not in path:
        raise ValueError(f"path: expected 'module:attr', got {path!r}")
    mod, attr = path.split(":", 1)
    obj: Any = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def load_tasks(env_name: str, split: str = "train", n: int | None = None, seed: int = 0, **kw: Any) -> list:
    """Task source of a registered environment: ``n`` seeded tasks of ``split``."""
    return resolve(get_entry(env_name).tasks)(split, n, seed, **kw)


def make_prompt(env_name: str, history_length: int | None = None):
    entry = get_entry(env_name)
    hl = entry.history_length if history_length is None else history_length
    return resolve(entry.prompt)(history_length=hl)


def expert_data_of(env_name: str) -> Callable[..., list]:
    """The ``expert_data`` hook of a registered environment; ValueError naming it when it has none."""
    entry = get_entry(env_name)
    if entry.expert_data is None:
        with_data = [n for n in env_names() if get_entry(n).expert_data is not None]
        raise ValueError(
            f"env.name: the warm start needs expert data, and environment {env_name!r} brings none "
            f"(its registry entry's expert_data; environments with it: {', '.join(with_data)})"
        )
    return resolve(entry.expert_data)
