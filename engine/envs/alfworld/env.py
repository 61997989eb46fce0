"""ALFWorld on its real engine: alfworld's TextWorld PDDL environment, official data or generated games.

Games are ``game.tw-pddl`` files in the layout of the ALFWorld download
(``<root>/json_2.1.1/{train,valid_seen,valid_unseen}/<task>/<trial>/game.tw-pddl`` next to
``traj_data.json``). They are played through alfworld's own text environment stack: TextWorld's
``PddlEnv`` wrapped in alfworld's ``AlfredDemangler`` (object names like ``apple 1``) and
``AlfredInfos`` (game file in the infos), the same wrappers ``AlfredTWEnv`` registers.

Task sources (:func:`load_tasks`):

* official data: ``data_dir=...`` or the ``ALFWORLD_DATA`` environment variable, when that folder
  holds ``json_2.1.1``; games are collected the way ``AlfredTWEnv.collect_game_files`` does (skip
  movable/sliced trajectories and games not marked solvable);
* otherwise the embedded default: games made by :mod:`.alfworld_gen`, generated on first use and cached
  under ``$ALIGNOPSD_CACHE`` or ``~/.cache/alignopsd/alfworld/<version>/``, keyed by split, seed and count.

Episode rules: reward 10 when won, else 0; at most 50 steps; admissible commands come from the engine;
the manager lower-cases actions. :func:`category_success` gives the per-category success rates of the
paper's Table 1 (Pick, Look, Clean, Heat, Cool, Pick2, All).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from alignopsd.engine.envs.alfworld.gen import CATEGORY, TASK_TYPES, generate_games
from alignopsd.engine.envs.alfworld.textworld import make_textworld_env
from alignopsd.engine.envs.base import StepResult, TaskSpec, percent

GEN_VERSION = "1"  # bump when the generator's output changes; part of the cache key
SPLITS = ("train", "valid_seen", "valid_unseen")
_SPLIT_ALIASES = {
    "eval_in_distribution": "valid_seen",
    "eval_out_of_distribution": "valid_unseen",
    "test": "valid_unseen",
}
DEFAULT_POOL = {"train": 120, "valid_seen": 60, "valid_unseen": 60}
_GEN_SEED = {"train": 1, "valid_seen": 2, "valid_unseen": 3}
TABLE1_LABELS = {"pick": "Pick", "look": "Look", "clean": "Clean", "heat": "Heat", "cool": "Cool", "pick2": "Pick2"}
_WELCOME = "-= Welcome to TextWorld, ALFRED! =-"


def _task_type_of(path: str) -> str | None:
    for t in TASK_TYPES:
        if t in path:
            return t
    return None


def collect_games(data_dir: str | os.PathLike, split: str) -> list[str]:
    """Solvable game files of ``split`` under ``data_dir/json_2.1.1`` (sorted), as AlfredTWEnv collects them."""
    split = _SPLIT_ALIASES.get(split, split)
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    root = Path(data_dir) / "json_2.1.1" / split
    if not root.is_dir():
        raise ValueError(f"data_dir: no ALFWorld split folder {root}")
    games = []
    for dirpath, _, files in os.walk(root):
        if "traj_data.json" not in files or "game.tw-pddl" not in files:
            continue
        if "movable" in dirpath or "Sliced" in dirpath:
            continue
        with open(os.path.join(dirpath, "traj_data.json")) as f:
            task_type = json.load(f).get("task_type")
        if task_type not in TASK_TYPES:
            continue
        gamefile = os.path.join(dirpath, "game.tw-pddl")
        with open(gamefile) as f:
            if not json.load(f).get("solvable", False):
                continue
        games.append(gamefile)
    return sorted(games)


def default_cache_dir() -> Path:
    base = os.environ.get("ALIGNOPSD_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "alignopsd")
    return Path(base) / "alfworld" / f"gen{GEN_VERSION}"


def generated_split(split: str, count: int, gen_seed: int | None = None, cache_dir: str | os.PathLike | None = None):
    """Root folder of a cached generated split (generating it first when missing)."""

    split = _SPLIT_ALIASES.get(split, split)
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    gen_seed = _GEN_SEED[split] if gen_seed is None else gen_seed
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root = root / f"{split}-seed{gen_seed}-n{count}"
    marker = root / "COMPLETE"
    if not marker.exists():
        import shutil  # noqa: PLC0415

        tmp = root.with_name(root.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        generate_games(count, tmp, seed=gen_seed, split=split)
        (tmp / "COMPLETE").write_text(json.dumps({"count": count, "seed": gen_seed, "split": split}))
        if root.exists() and not marker.exists():  # a partial folder from an interrupted older run
            shutil.rmtree(root, ignore_errors=True)
        try:
            tmp.rename(root)  # atomic publish; a concurrent process may have published first
        except OSError:
            if not marker.exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def official_data_dir(data_dir: str | os.PathLike | None = None) -> Path | None:
    """The official-data root to use: ``data_dir``, else ``ALFWORLD_DATA`` when it holds json_2.1.1."""
    if data_dir is not None:
        p = Path(data_dir)
        if not (p / "json_2.1.1").is_dir():
            raise ValueError(f"data_dir: {p} has no json_2.1.1 folder (expected the alfworld-download layout)")
        return p
    env = os.environ.get("ALFWORLD_DATA")
    if env and (Path(env) / "json_2.1.1").is_dir():
        return Path(env)
    return None


def load_tasks(
    split: str = "train",
    n: int | None = None,
    seed: int = 0,
    data_dir: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike | None = None,
    pool_size: int | None = None,
    **_: Any,
) -> list[TaskSpec]:
    """``n`` ALFWorld tasks of ``split`` (all when ``n`` is None), sampled with ``seed``.

    Official data when available (see module doc), else the generated pool of ``pool_size`` games
    (default 120 train / 60 valid, at least ``n``).
    """
    split = _SPLIT_ALIASES.get(split, split)
    root = official_data_dir(data_dir)
    source = "official"
    if root is None:
        count = max(pool_size or DEFAULT_POOL.get(split, 60), n or 0)
        root = generated_split(split, count, cache_dir=cache_dir)
        source = "generated"
    games = collect_games(root, split)
    if not games:
        raise ValueError(f"data_dir: no solvable games in split {split!r} under {root}")
    if n is not None and n > 0:
        r = random.Random(seed)
        games = r.sample(games, n) if n <= len(games) else [r.choice(games) for _ in range(n)]
    tasks = []
    for g in games:
        task_type = _task_type_of(g) or "pick_and_place_simple"
        rel = os.path.relpath(os.path.dirname(g), root / "json_2.1.1")
        tasks.append(
            TaskSpec(
                key=rel.replace(os.sep, "/"),
                env="alfworld",
                category=CATEGORY[task_type],
                data_source="text",
                payload={"gamefile": g, "task_type": task_type, "source": source},
            )
        )
    return tasks


def split_observation(text: str) -> tuple[str, str]:
    """Initial engine text -> (observation without the welcome banner, task description)."""
    obs = text.replace(_WELCOME, "").strip()
    task = ""
    marker = "Your task is to: "
    if marker in obs:
        task = obs.split(marker, 1)[1].strip()
    return obs, task


class AlfWorldEnv:
    """One ALFWorld episode at a time on alfworld's TextWorld engine (see module docstring).

    ``fast_engine`` applies ``alfworld_textworld.memoize_textworld_parsers`` (same observations, several times faster).
    """

    name = "alfworld"

    def __init__(self, max_steps: int = 50, win_reward: float = 10.0, fast_engine: bool = True, **_: Any) -> None:
        if not isinstance(max_steps, int) or max_steps <= 0:
            raise ValueError(f"max_steps: expected a positive int, got {max_steps!r}")
        self.max_steps = max_steps
        self.win_reward = float(win_reward)
        self._env = make_textworld_env(expert=False, fast=fast_engine)
        self._loaded: str | None = None
        self._t = 0
        self._task = ""
        self._gamefile: str | None = None

    def _info(self, state: Any) -> dict[str, Any]:
        return {
            "won": bool(state["won"]),
            "admissible_actions": list(state["admissible_commands"]),
            "gamefile": self._gamefile,
            "task": self._task,
        }

    def reset(self, task: TaskSpec, seed: int) -> tuple[str, dict[str, Any]]:
        gamefile = task.payload.get("gamefile")
        if not gamefile or not os.path.isfile(gamefile):
            raise ValueError(f"task: ALFWorld game file not found: {gamefile!r}")
        random.seed(seed)
        if self._loaded != gamefile:
            self._env.load(gamefile)
            self._loaded = gamefile
        self._gamefile = gamefile
        state = self._env.reset()
        obs, self._task = split_observation(state["feedback"])
        self._t = 0
        return obs, self._info(state)

    def step(self, action: str) -> StepResult:
        if not isinstance(action, str):
            raise ValueError(f"action: expected str, got {type(action).__name__}")
        state, _, done = self._env.step(action)
        self._t += 1
        won = bool(state["won"])
        done = bool(done) or won or self._t >= self.max_steps
        return StepResult(state["feedback"], self.win_reward if won else 0.0, done, self._info(state))


def category_success(results: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Per-category success rate (percent) as in Table 1: Pick, Look, Clean, Heat, Cool, Pick2, All.

    ``results``: dicts with ``category`` (pick/look/... or a full task type name) and ``won``
    (e.g. EnvManager.episode_results()). Categories without episodes are omitted; All is over all.
    """
    wins: dict[str, list[bool]] = {}
    allw: list[bool] = []
    for r in results:
        cat = r.get("category")
        cat = CATEGORY.get(cat, cat)
        if cat not in TABLE1_LABELS:
            raise ValueError(f"results: unknown ALFWorld category {r.get('category')!r}")
        wins.setdefault(TABLE1_LABELS[cat], []).append(bool(r.get("won")))
        allw.append(bool(r.get("won")))
    out = {label: 100.0 * sum(wins[label]) / len(wins[label]) for label in TABLE1_LABELS.values() if label in wins}
    if allw:
        out["All"] = 100.0 * sum(allw) / len(allw)
    return out


def table_columns(metrics: dict[str, float]) -> dict[str, float | None]:
    """The evaluation table (Table 1): success per task category and their average (All), in percent."""
    out = {label: percent(metrics, f"episode/success/{key}") for key, label in TABLE1_LABELS.items()}
    out["All"] = percent(metrics, "episode/success_rate")
    return out


def task_info(task: TaskSpec) -> dict[str, Any]:
    """What each row of a task carries into the row metadata (the registry entry's ``task_info``): its game file,
    which the skill bank matches the task type in (engine/envs/skills.py)."""
    return {"gamefile": task.payload.get("gamefile")}
